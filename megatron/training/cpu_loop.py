"""Stand-ins that upstream's training loop (megatron-core 0.19's own ``megatron.training``) needs.

    from megatron.training import cpu_loop
    cpu_loop.install()   # before pretrain(); CPU stand-ins only where CUDA is absent

Two kinds, each counted in ``HITS`` (``"name <- caller module"``: one entry per call site's
module, so a test sees both a stand-in that is no longer reached and one reached from new code):

* packaging, on every machine: **P1** ``initialize._compile_dependencies`` runs ``make`` in
  ``megatron/core/datasets`` (``compile_helpers``); an installed package has no Makefile there
  and the run exits 1. The helpers are built at install (``helpers_cpp``), so when they import,
  ``compile_helpers`` does nothing.
* CPU, only where ``cpu_mode.requested()`` (no CUDA, or ``MEGATRON_CPU_MODE=1``), on top of
  ``cpu_mode.enable()`` (devices, ``Tensor.cuda()``, ``Tensor.type()``, RNG, streams):

  - **T1** ``initialize_megatron`` asserts ``torch.cuda.is_available()`` unless
    ``allow_no_cuda``, which ``pretrain()`` never passes: the loop's call passes it.
  - **T2** ``_initialize_distributed`` and ``_set_random_seed`` skip
    ``mpu.initialize_model_parallel`` and the model-parallel RNG tracker when
    ``torch.cuda.device_count() == 0``: inside those two functions only, the count is 1.
  - **T3** ``_initialize_distributed`` then calls ``torch.cuda.set_device(local_rank)``: a no-op
    there.
  - **T4** ``torch.cuda.Stream()`` / ``wait_stream`` around the DDP wrapping (``training.py``) and
    **T5** ``with torch.cuda.stream(...)``: ``cpu_mode``'s stand-ins, counted here.
  - **T6** ``build_pretraining_data_loader``'s DataLoader draws its worker seed from torch's
    global generator when an iterator is made. On CPU that generator is also the "CUDA" one that
    dropout uses, and upstream makes the iterators after loading a checkpoint: a resumed run's
    dropout would be shifted. The loader gets its own generator (seeded with ``--seed``); on
    GPUs nothing changes.
  - **T7** ``validate_args`` reads the GPU architecture (``get_device_arch_version``, through
    ``torch.cuda.get_device_properties``) with TP or CP > 1, and a CPU has none: 0 there, as a
    pre-Blackwell GPU, so upstream's rules for those (``CUDA_DEVICE_MAX_CONNECTIONS=1`` with TP)
    apply unchanged. Reached only with TP or CP > 1 or ``--use-megatron-fsdp`` (its high-priority
    stream groups, Blackwell and later) (``LAYOUT_STAND_INS``).

Not stand-ins: packages that upstream's loop imports only for some flags, which
``missing_dependencies`` names before the run starts: ``psutil``, an undeclared dependency of the
torch_dist async writer (``filesystem_async``; without it every torch_dist save fails), and
``wandb`` for ``--wandb-project`` (an optional extra, requirements/wandb.txt): upstream imports it
on the last rank only, inside ``parse_and_validate_args`` (``set_global_variables``), and the
other ranks go on until torchrun stops them; ``gpt_entry`` checks upstream's parser's flags first.
"""

import collections
import functools
import importlib.util
import json
import os
import sys

import torch

from megatron.training import cpu_mode

HITS: collections.Counter = collections.Counter()
_installed = False

# Every stand-in by name; a test compares the hit names against this list. Those that only some
# layouts reach are apart: a data-parallel run does not.
STAND_INS = ("P1", "T1", "T2", "T3", "T4", "T5", "T6")
LAYOUT_STAND_INS = ("T7",)


def _hit(name: str, depth: int = 2) -> None:
    caller = sys._getframe(depth).f_globals.get("__name__", "?")
    HITS[f"{name} <- {caller}"] += 1


def install() -> bool:
    """Install the packaging stand-in, and the CPU ones where CUDA is absent (idempotent).
    Returns whether the CPU ones are on. ``MEGATRON_CPU_LOOP_HITS=DIR`` writes each rank's
    counts to ``DIR/hits.RANK.json`` at exit."""
    global _installed
    if _installed:
        return cpu_mode.is_enabled()
    _installed = True
    _packaging()
    if cpu_mode.requested():
        cpu_mode.enable()
        _cpu()
    if os.environ.get("MEGATRON_CPU_LOOP_HITS"):
        import atexit

        atexit.register(_write_hits, os.environ["MEGATRON_CPU_LOOP_HITS"])
    return cpu_mode.is_enabled()


def missing_dependencies(args) -> list:
    """(package, why) pairs that upstream's loop needs for ``args`` but cannot import (none
    where ``args`` is None: a command line that does not parse)."""
    missing = []
    if args is None:
        return missing
    if (
        args.save
        and args.ckpt_format == "torch_dist"
        and importlib.util.find_spec("psutil") is None
    ):
        missing.append(("psutil", "the torch_dist checkpoint writer (filesystem_async) imports it"))
    if getattr(args, "wandb_project", None) and importlib.util.find_spec("wandb") is None:
        missing.append(
            ("wandb", "--wandb-project logs to Weights & Biases (requirements/wandb.txt)")
        )
    return missing


def exit_status(main) -> int:
    """``main()``'s exit status (its return, or the code of the ``sys.exit`` upstream's loop
    calls: 0 after a signal, 16/17 from the rerun state machine), also written to
    ``MEGATRON_CPU_LOOP_HITS/exit.RANK`` where that is set: torchrun reports no rank's status
    when it is itself stopped by a signal, and a test reads each one there."""
    status = 1  # an exception
    try:
        status = main()
    except SystemExit as done:
        status = _code(done.code)
        raise
    finally:
        folder = os.environ.get("MEGATRON_CPU_LOOP_HITS")
        if folder:
            os.makedirs(folder, exist_ok=True)
            with open(os.path.join(folder, f"exit.{os.environ.get('RANK', '0')}"), "w") as f:
                f.write(str(status))
    return status


def _code(code) -> int:
    """The exit status Python gives ``sys.exit(code)``."""
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def _write_hits(folder: str) -> None:
    rank = os.environ.get("RANK", "0")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"hits.{rank}.json"), "w") as f:
        json.dump(dict(HITS), f, indent=1, sort_keys=True)


def _packaging() -> None:
    from megatron.core.datasets import utils as dataset_utils

    original = dataset_utils.compile_helpers
    if importlib.util.find_spec("megatron.core.datasets.helpers_cpp") is None:
        return  # a source tree with its Makefile: upstream's make builds them

    @functools.wraps(original)
    def compile_helpers():
        _hit("P1")

    dataset_utils.compile_helpers = compile_helpers


def _cpu() -> None:
    from megatron.training import initialize, training

    original_init = training.initialize_megatron

    @functools.wraps(original_init)
    def initialize_megatron(*args, **kwargs):
        _hit("T1")
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    training.initialize_megatron = initialize_megatron
    for name in ("_initialize_distributed", "_set_random_seed"):
        setattr(initialize, name, _with_one_device(getattr(initialize, name)))

    stream_context = torch.cuda.stream  # cpu_mode's stand-ins, counted

    class Stream(torch.cuda.Stream):
        def __init__(self, *args, **kwargs):
            _hit("T4")
            super().__init__(*args, **kwargs)

    def stream(s=None):
        _hit("T5")
        return stream_context(s)

    torch.cuda.Stream, torch.cuda.stream = Stream, stream

    original_loader = training.build_pretraining_data_loader

    @functools.wraps(original_loader)
    def build_pretraining_data_loader(dataset, consumed_samples):
        loader = original_loader(dataset, consumed_samples)
        if isinstance(loader, torch.utils.data.DataLoader):
            _hit("T6")
            from megatron.training import get_args

            loader.generator = torch.Generator().manual_seed(get_args().seed)
        return loader

    training.build_pretraining_data_loader = build_pretraining_data_loader
    _no_device_arch()


def _no_device_arch() -> None:
    from megatron.training import arguments

    def get_device_arch_version():
        _hit("T7")
        return 0

    arguments.get_device_arch_version = get_device_arch_version


def _with_one_device(function):
    """``function`` run with ``torch.cuda.device_count() == 1`` and ``set_device`` a no-op."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        cuda = torch.cuda
        count, set_device = cuda.device_count, cuda.set_device

        def one_device():
            _hit("T2")
            return 1

        def no_set_device(device):
            _hit("T3")

        cuda.device_count, cuda.set_device = one_device, no_set_device
        try:
            return function(*args, **kwargs)
        finally:
            cuda.device_count, cuda.set_device = count, set_device

    return wrapper
