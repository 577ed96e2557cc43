"""Process start-up: device, process groups, model-parallel groups, seeds, micro-batch counter.
The same code runs on GPUs (nccl) and on CPUs (gloo, megatron-core's CPU mode)."""

import datetime
import logging
import os
import random

import numpy
import torch
from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from megatron.core import parallel_state
from megatron.training import cpu_mode

from .core_configs import virtual_pipeline_size


def initialize(args) -> None:
    set_logging_level(args.logging_level)
    on_cpu = cpu_mode.enable_if_needed()
    if on_cpu and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)  # ranks share the cores; more threads only contend
    _init_process_group(on_cpu, args.distributed_timeout_minutes, args.local_rank)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=virtual_pipeline_size(args),
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
    )
    set_seeds(args.seed)
    if args.deterministic_mode:  # Megatron-LM's --deterministic-mode
        torch.use_deterministic_algorithms(True)
    init_num_microbatches_calculator(
        torch.distributed.get_rank(),
        args.rampup_batch_size,
        args.global_batch_size,
        args.micro_batch_size,
        parallel_state.get_data_parallel_world_size(),
    )


def _init_process_group(on_cpu: bool, timeout_minutes: int, local_rank: int) -> None:
    if torch.distributed.is_initialized():
        return
    if not on_cpu:
        torch.cuda.set_device(local_rank)  # Megatron-LM's --local-rank: $LOCAL_RANK by default
    backend, timeout = "gloo" if on_cpu else "nccl", datetime.timedelta(minutes=timeout_minutes)
    if "RANK" not in os.environ:  # a plain `python pretrain_gpt.py`: one process
        # an in-memory store: no TCP port to collide with another run on this machine
        os.environ.update(RANK="0", WORLD_SIZE="1")
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group(
            backend=backend, store=store, rank=0, world_size=1, timeout=timeout
        )
        return
    torch.distributed.init_process_group(backend=backend, timeout=timeout)


def set_logging_level(level) -> None:
    """Megatron-LM's precedence: --logging-level, else $MEGATRON_LOGGING_LEVEL, else Python's
    default; set on the root logger (megatron-core logs through module loggers under it)."""
    env = os.environ.get("MEGATRON_LOGGING_LEVEL")
    level = level if level is not None else (int(env) if env is not None else None)
    if level is not None:
        logging.getLogger().setLevel(level)


def set_seeds(seed: int) -> None:
    """Megatron-LM's _set_random_seed: distinct per pipeline stage, model-parallel RNG tracker
    seeded per TP rank (so dropout in TP regions differs across TP ranks, as it should)."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
