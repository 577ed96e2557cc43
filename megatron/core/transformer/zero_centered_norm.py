"""Zero-centered gamma for the local (torch) norms: ``TransformerConfig.
layernorm_zero_centered_gamma`` (Megatron-LM's ``--apply-layernorm-1p``) without Transformer
Engine or Apex.

    y = norm(x) * (1 + gamma) + beta        gamma initialized to 0, so y = norm(x) at init

The stored weight is gamma, as in TE's and Apex's zero-centered norms, so weight decay pulls the
scale towards 1 rather than 0 and checkpoints hold the same numbers as those backends.
megatron-core's ``WrappedTorchNorm`` asserts the field is off; patch 0015 builds these
modules instead.
"""

import torch


class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
    """LayerNorm whose ``weight`` is gamma: the scale applied is ``1 + weight``."""

    def reset_parameters(self) -> None:
        """Initialize gamma to 0 (scale 1), so the module equals plain LayerNorm at init."""
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """LayerNorm of ``x`` over ``normalized_shape`` with scale ``1 + weight``."""
        return torch.nn.functional.layer_norm(
            x, self.normalized_shape, self.weight + 1, self.bias, self.eps
        )


class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
    """RMSNorm whose ``weight`` is gamma: the scale applied is ``1 + weight``."""

    def reset_parameters(self) -> None:
        """Initialize gamma to 0 (scale 1), so the module equals plain RMSNorm at init."""
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm of ``x`` over ``normalized_shape`` with scale ``1 + weight``."""
        return torch.nn.functional.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


ZERO_CENTERED_NORMS = {"LayerNorm": ZeroCenteredLayerNorm, "RMSNorm": ZeroCenteredRMSNorm}


def zero_centered_norm_class(normalization: str) -> type:
    """The zero-centered module class for ``config.normalization``; ValueError for one without a
    learned scale to center (L2Norm).

    Args:
        normalization: ``TransformerConfig.normalization``, "LayerNorm" or "RMSNorm".

    Returns:
        ``ZeroCenteredLayerNorm`` or ``ZeroCenteredRMSNorm`` (torch's constructor arguments).
    """
    if normalization not in ZERO_CENTERED_NORMS:
        raise ValueError(
            f"layernorm_zero_centered_gamma needs normalization LayerNorm or RMSNorm, "
            f"got {normalization!r}"
        )
    return ZERO_CENTERED_NORMS[normalization]
