"""Smoke test of the installed fork (``make install`` runs it; by hand: ``.venv/bin/python
tools/smoke.py``). One gloo process on the CPU:

1. ``import megatron.core`` and ``import megatron.training`` (upstream's training package);
2. our Muon (``muon_impl='megatron_muon'``) inside the DistributedOptimizer: 3 steps of a tiny GPT
   on one batch, the loss must fall;
3. upstream's ``optimizer='muon'`` (the default ``muon_impl='emerging'``) still builds upstream's
   emerging-optimizers Muon and steps.

The CPU stand-ins are this checkout's ``megatron/training/cpu_mode.py``, loaded by path (our core
imports nothing of ours from ``megatron.training``, which is upstream's). Exits non-zero
on a failure; prints one line per check.
"""

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _cpu_mode():
    path = ROOT / "megatron" / "training" / "cpu_mode.py"
    spec = importlib.util.spec_from_file_location("megatron_muon_cpu_mode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_gpt(distopt: bool):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        use_cpu_initialization=True,
        gated_linear_unit=True,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        hidden_dropout=0.0,  # deterministic: the same steps at any DP size
        attention_dropout=0.0,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=128,
        max_sequence_length=16,
        position_embedding_type="rope",
    )
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=distopt)
    return [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)]


def _steps(model, optimizer, n: int) -> list:
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).expand(2, 16)
    losses = []
    for _ in range(n):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        loss = model[0](tokens, position_ids, None, labels=tokens).float().mean()
        loss.backward()
        for chunk in model:
            chunk.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok, "optimizer step skipped"
        losses.append(round(loss.item(), 4))
    return losses


def main() -> int:
    t0 = time.time()
    import megatron.core.package_info as info

    import megatron.core
    import megatron.training  # noqa: F401  upstream's package in the 0.19.2 base

    print(f"smoke: megatron-core {info.__version__} from {Path(megatron.core.__file__).parent}")
    print(f"smoke: import megatron.core, megatron.training ok ({time.time() - t0:.1f} s)")
    print(f"smoke: cpu mode {_cpu_mode().enable_if_needed()} | torch {torch.__version__}")

    from megatron.core import parallel_state as ps
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    ps.initialize_model_parallel()

    model = _tiny_gpt(distopt=True)
    config = OptimizerConfig(
        optimizer="muon", muon_impl="megatron_muon", lr=0.02, use_distributed_optimizer=True
    )
    optimizer = get_megatron_optimizer(config, model)
    inner = {type(o).__name__: type(o.optimizer).__name__ for o in optimizer.chained_optimizers}
    losses = _steps(model, optimizer, 3)
    print(f"smoke: ours (muon_impl='megatron_muon') {inner}: loss {losses}")
    assert "MegatronMuon" in inner.values(), inner
    assert losses[-1] < losses[0], losses

    model = _tiny_gpt(distopt=False)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="muon", lr=0.02), model)
    inner = [type(getattr(o, "optimizer", o)).__name__ for o in optimizer.chained_optimizers]
    losses = _steps(model, optimizer, 2)
    print(f"smoke: upstream's (muon_impl='emerging', the default) {inner}: loss {losses}")
    assert "TensorParallelMuon" in inner, inner
    torch.distributed.destroy_process_group()
    print(f"smoke: ok ({time.time() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
