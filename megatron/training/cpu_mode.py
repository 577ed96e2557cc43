"""CPU mode: run megatron-core 0.19.2 on a machine without CUDA (development, CI, laptops).

    from megatron.training import cpu_mode
    cpu_mode.enable_if_needed()   # before building models; a no-op where CUDA is available

Active only when ``torch.cuda.is_available()`` is false, or when ``MEGATRON_CPU_MODE=1`` asks for
it. It leaves the GPU path untouched: nothing here runs unless enabled.

What it redirects (the CUDA assumptions of megatron-core found on CPU):

* ``device='cuda'``, a CUDA device index and ``Tensor.cuda()``: a ``TorchFunctionMode`` rewrites
  CUDA devices to the CPU at the call. torch runs ``autograd.Function.apply`` and
  ``autograd.backward`` inside their own ``__torch_function__`` dispatch, where the mode is off,
  so what Megatron's autograd Functions do is covered by the patches below instead.
* ``torch.device('cuda:N')`` (also ``f'cuda:{torch.cuda.current_device()}'``, which the CPU
  device below would make ``'cuda:cpu'``): the CPU device (Megatron-FSDP's adapter).
* ``DeviceMesh(device_type='cuda')`` (Megatron-FSDP, torch FSDP2, fsdp_dtensor checkpoints): a CPU
  mesh, so FSDP2 shards live on the CPU and its device is not asked of the CUDA handle.
* Megatron-FSDP's gradient division fused into the reduction (NCCL's ``PREMUL_SUM``, which gloo
  lacks): its unfused path, the gradients scaled and then summed.
* ``param.type() == 'torch.cuda.FloatTensor'`` checks (optimizers, grad clipping): ``Tensor.type()``
  answers with the ``torch.cuda.*`` name of the CPU tensor's type.
* ``torch.cuda.current_device / synchronize / nvtx``: the CPU device and no-ops; streams and
  events: stand-ins whose methods do nothing.
* ``torch.distributed.all_to_all_single`` with split sizes as (CPU) tensors: made lists.
* The CUDA RNG behind ``tensor_parallel.random``'s tracker: the CPU default generator, the one that
  CPU kernels (dropout, init) draw from, so forking the tracker swaps the state those kernels use.

Why a shim and not patches: the assumptions are spread over a dozen upstream files, none of them
about Muon. Patching each site (``device=get_device()``) would be the right upstream change, but it
would bury the Muon patch series under unrelated device plumbing and conflict with every upstream
release. One mode, enabled in one place, keeps ``patches/`` about Muon and is easy to delete.
"""

import contextlib
import functools
import logging
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_mode = None


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True  # a CUDA device index, e.g. torch.cuda.set_device(local_rank) callers
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cuda_type_name(name: str) -> str:
    return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA devices to the CPU in every torch call made while the mode is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return _cuda_type_name(func(*args))
        if func is torch.device and args and _is_cuda(args[0]):
            return _CPU  # torch.device('cuda:0'), ('cuda', index), (index)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NoStream:
    """Stands in for ``torch.cuda.Stream``/``Event``: work on the CPU is already in order.

    Every method is a no-op that returns another stand-in, so ``stream.record_event().wait()``
    and ``with torch.cuda.stream(s)`` chains work.
    """

    def __init__(self, *args, **kwargs):
        pass

    def __getattr__(self, name):
        return lambda *args, **kwargs: _NoStream()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # The CPU device rather than the index 0: Megatron passes it as ``device=``, also from
    # autograd.Function.backward, which torch 2.13 runs inside torch.autograd.backward's own
    # __torch_function__ dispatch, i.e. with this mode switched off.
    cuda.current_device = lambda: _CPU
    cuda.synchronize = lambda device=None: None
    cuda.get_rng_state = cuda.random.get_rng_state = lambda device="cuda": torch.get_rng_state()
    cuda.set_rng_state = cuda.random.set_rng_state = lambda s, device="cuda": torch.set_rng_state(s)
    cuda.manual_seed = cuda.random.manual_seed = lambda seed: torch.manual_seed(seed)
    cuda.Stream = cuda.Event = _NoStream
    cuda.current_stream = cuda.default_stream = lambda device=None: _NoStream()
    cuda.stream = lambda stream=None: contextlib.nullcontext()
    cuda.nvtx.range_push = cuda.nvtx.range_pop = lambda *args, **kwargs: None


def _patch_all_to_all() -> None:
    # MoE's all-to-all dispatcher turns its split sizes into host numpy arrays only when they are
    # CUDA tensors (moe_utils.maybe_move_tensor_to_cpu); CPU tensors reach c10d, which wants lists.
    original = torch.distributed.all_to_all_single

    @functools.wraps(original)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, **kw):
        return original(
            output, input, _as_list(output_split_sizes), _as_list(input_split_sizes), **kw
        )

    torch.distributed.all_to_all_single = all_to_all_single


def _as_list(sizes):
    return sizes.tolist() if isinstance(sizes, torch.Tensor) else sizes


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as tp_random

    tp_random._set_cuda_rng_state = lambda state, device=-1, graph_safe=False: (
        torch.set_rng_state(state)
    )
    tp_random._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    # With one generator for "CPU" and "CUDA", the tracker's check that the CPU state is unchanged
    # inside fork() fires on every dropout; it is meaningless here.
    logging.getLogger(tp_random.__name__).addFilter(
        lambda record: "CPU RNG state changed" not in record.getMessage()
    )


def _patch_device_mesh() -> None:
    # Megatron-FSDP and FSDP2 (and the fsdp_dtensor checkpoints) build their meshes with
    # device_type="cuda"; torch's fully_shard then asks the CUDA handle for its device. A CPU mesh
    # makes FSDP2 and the DTensors live on the CPU, where the ranks' tensors are.
    from torch.distributed.device_mesh import DeviceMesh

    original = DeviceMesh.__init__

    @functools.wraps(original)
    def __init__(self, device_type, *args, **kwargs):
        original(self, "cpu" if _is_cuda(device_type) else device_type, *args, **kwargs)

    DeviceMesh.__init__ = __init__


def _patch_megatron_fsdp() -> None:
    # Megatron-FSDP divides gradients inside the reduction (NCCL's PREMUL_SUM) when
    # gradient_reduce_div_fusion is on (its default); gloo has no such op ("Cannot use
    # ReduceOp.PREMUL_SUM with Gloo"). Its own fallback (scale, then SUM: what NCCL fuses) here.
    import dataclasses

    from megatron.core.distributed.fsdp.src.megatron_fsdp import param_and_grad_buffer as buffer

    original = buffer.gradient_reduce_preprocessing

    @functools.wraps(original)
    def gradient_reduce_preprocessing(grad_data, scaling_factor, ddp_config):
        if ddp_config.gradient_reduce_div_fusion:
            ddp_config = dataclasses.replace(ddp_config, gradient_reduce_div_fusion=False)
        return original(grad_data, scaling_factor, ddp_config)

    buffer.gradient_reduce_preprocessing = gradient_reduce_preprocessing


def requested() -> bool:
    """True when CPU mode should be on: no CUDA, or ``MEGATRON_CPU_MODE=1``."""
    forced = os.environ.get("MEGATRON_CPU_MODE", "").lower() in ("1", "true", "yes")
    return forced or not torch.cuda.is_available()


def is_enabled() -> bool:
    return _mode is not None


def enable() -> None:
    """Turn CPU mode on for this process (idempotent); the mode is entered for this thread."""
    global _mode
    if _mode is not None:
        return
    _inductor_cache_per_capability()
    _patch_torch_cuda()
    _patch_all_to_all()
    _patch_rng_tracker()
    _patch_megatron_fsdp()
    _patch_device_mesh()
    _mode = CudaToCpuMode()
    _mode.__enter__()


def _inductor_cache_per_capability() -> None:
    """One inductor cache folder per ``ATEN_CPU_CAPABILITY``. torch 2.13 reuses a CPU kernel that
    a run of another capability generated (vectorized for avx2, say) and compiles it with this
    run's flags: ``'at::vec' has not been declared``, and every ``torch.compile`` fusion (upstream's
    ``jit_fuser``) fails. torch's default folder (which torch writes into the environment on first
    use, e.g. when ``import megatron.core`` compiles emerging-optimizers' kernels) gets the
    capability as a suffix; a folder the user chose stays, and so does torch's without a
    capability."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability:
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # no torch imports

    default = os.path.abspath(default_cache_dir())
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default) != default:
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default}_{capability}"
    utils = sys.modules.get("torch._inductor.utils")
    if utils is not None:
        utils.clear_caches()  # paths inductor memoized under the old folder


def enable_if_needed() -> bool:
    """Enable CPU mode where CUDA is unavailable (or asked for); return whether it is on."""
    if requested():
        enable()
    return is_enabled()


def device() -> torch.device:
    """The device models and batches should live on: the current CUDA device, or the CPU."""
    if is_enabled():
        return _CPU
    return torch.device("cuda", torch.cuda.current_device())
