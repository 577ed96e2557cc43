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


PLAIN_NORMS = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}


def _sequence_parallel_class(norm_cls: type) -> type:
    """``norm_cls`` whose params are marked ``sequence_parallel``, as TE's and Apex's norms mark
    theirs: each TP rank normalizes its part of the sequence, so their grads are partial and
    ``finalize_model_grads`` all-reduces them over the TP group."""

    class SequenceParallelNorm(norm_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            for param in self.parameters():
                param.sequence_parallel = True

    SequenceParallelNorm.__name__ = SequenceParallelNorm.__qualname__ = norm_cls.__name__
    return SequenceParallelNorm


def local_norm_class(config) -> type:
    """The local norm's module class where ``WrappedTorchNorm`` asserted a field off: a
    zero-centered gamma (``layernorm_zero_centered_gamma``) and/or params marked for sequence
    parallelism (``sequence_parallel``).

    Args:
        config: the TransformerConfig (``normalization`` LayerNorm or RMSNorm).

    Returns:
        A module class taking torch's constructor arguments (``normalized_shape``, ``eps``).
    """
    if config.layernorm_zero_centered_gamma:
        norm_cls = zero_centered_norm_class(config.normalization)
    elif config.normalization in PLAIN_NORMS:
        norm_cls = PLAIN_NORMS[config.normalization]
    else:
        raise ValueError(
            f"sequence_parallel with the local norms needs normalization LayerNorm or RMSNorm, "
            f"got {config.normalization!r}"
        )
    return _sequence_parallel_class(norm_cls) if config.sequence_parallel else norm_cls
