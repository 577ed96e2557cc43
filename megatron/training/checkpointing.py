"""Save and resume, in Megatron-LM's layout:

    {save}/iter_0000010/                 torch_dist: dist_checkpointing files (metadata.json, ...)
    {save}/iter_0000010/mp_rank_00[_000][_000]/model_optim_rng.pt (+ distrib_optim.pt)   torch
    {save}/latest_checkpointed_iteration.txt

A checkpoint is written under ``iter_XXXXXXX.partial`` and renamed when every rank is done; the
tracker file is then replaced atomically (temp file + os.replace). A crash mid-save therefore
leaves the previous checkpoint as the latest one, loadable. With ``--async-save`` (torch_dist) the
rename and the tracker wait until every rank's background write has finished (``dist_ckpt.py``,
which also holds the other torch_dist options). On load, the model shape and the
TP/PP/EP layout recorded in the checkpoint are compared with this run's first, so that a mismatch
is reported by flag name rather than as a tensor-shape error deep in a loader.
"""

import functools
import os
import random
import shutil
import time

import numpy
import torch
from megatron.core.dist_checkpointing.core import CheckpointingException
from megatron.core.dist_checkpointing.mapping import ShardedObject

# torch.distributed.checkpoint reports a failed read as a BaseException subclass.
from torch.distributed.checkpoint.api import CheckpointException

from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.training import cpu_mode

from . import dist_ckpt, rerun
from .log import print_rank_0

TRACKER = "latest_checkpointed_iteration.txt"

# (args attribute, flag) that must match between a checkpoint and the run loading it.
MODEL_SHAPE = (
    ("num_layers", "--num-layers"),
    ("hidden_size", "--hidden-size"),
    ("ffn_hidden_size", "--ffn-hidden-size"),
    ("num_attention_heads", "--num-attention-heads"),
    ("num_query_groups", "--num-query-groups"),
    ("kv_channels", "--kv-channels"),
    ("padded_vocab_size", "vocabulary size (tokenizer, --make-vocab-size-divisible-by)"),
    ("max_position_embeddings", "--max-position-embeddings"),
    ("position_embedding_type", "--position-embedding-type"),
    ("normalization", "--normalization"),
    ("swiglu", "--swiglu"),
    ("qk_layernorm", "--qk-layernorm"),
    ("untie_embeddings_and_output_weights", "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", "--disable-bias-linear"),
    ("num_experts", "--num-experts"),
    ("mtp_num_layers", "--mtp-num-layers"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
    ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    (
        "virtual_pipeline_size",  # either spelling of the same chunks loads
        "model chunks per pipeline rank (--num-layers-per-virtual-pipeline-stage or "
        "--num-virtual-stages-per-pipeline-rank)",
    ),
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("expert_model_parallel_size", "--expert-model-parallel-size"),
)
OPTIMIZER_SHAPE = (
    ("optimizer", "--optimizer"),
    ("use_distributed_optimizer", "--use-distributed-optimizer"),
    ("bf16", "--bf16"),
    ("fp16", "--fp16"),
)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded into this run; the message says why."""


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _barrier() -> None:
    torch.distributed.barrier()


def _rank0() -> bool:
    return torch.distributed.get_rank() == 0


# ---------------------------------------------------------------------------------- state


def _saved_args(args) -> dict:
    from .checkpoint_args import FROM_CHECKPOINT  # what --use-checkpoint-args reads back

    keys = [attr for attr, _ in MODEL_SHAPE + OPTIMIZER_SHAPE] + ["ckpt_format"]
    keys += [dest for dest, _ in FROM_CHECKPOINT if dest not in keys]
    return {key: getattr(args, key, None) for key in keys}


def _common_state(args, scheduler, state) -> dict:
    return {
        "checkpoint_version": 3.0,
        "iteration": state.iteration,
        "consumed_train_samples": state.consumed_train_samples,
        "consumed_valid_samples": state.consumed_valid_samples,
        "skipped_train_samples": state.skipped_train_samples,
        "args": _saved_args(args),
        "opt_param_scheduler": scheduler.state_dict(),
        # What --no-save-optim / --no-save-rng left out; a load that needs it is refused.
        "saved_parts": {"optimizer": not args.no_save_optim, "rng": not args.no_save_rng},
    }


def rng_state() -> dict:
    on_gpu = torch.cuda.is_available() and not cpu_mode.is_enabled()
    return {
        "random_rng_state": random.getstate(),
        "np_rng_state": numpy.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if on_gpu else None,
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def restore_pending_rng(state) -> None:
    if state.pending_rng_state is not None:
        set_rng_state(state.pending_rng_state)
        state.pending_rng_state = None


def set_rng_state(saved: dict) -> None:
    random.setstate(saved["random_rng_state"])
    numpy.random.set_state(saved["np_rng_state"])
    torch.set_rng_state(saved["torch_rng_state"])
    if saved["cuda_rng_state"] is not None and not cpu_mode.is_enabled():
        torch.cuda.set_rng_state(saved["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(saved["rng_tracker_states"])


def _model_key(model, index: int) -> str:
    return "model" if len(model) == 1 else f"model{index}"


# ----------------------------------------------------------------------------------- save


def save(args, model, optimizer, scheduler, state, on_saved=None, rerun_state=None) -> None:
    """Write a complete checkpoint of ``state.iteration``, then point the tracker at it and call
    ``on_saved()`` (with --async-save: once every rank's background write has finished).
    ``rerun_state``: the rerun state machine's (rerun.state_dict), when a step waits to be
    re-run from this checkpoint."""
    start = time.perf_counter()
    if args.overlap_param_gather:  # params updated by the last step are gathered lazily
        for chunk in model:
            chunk.start_param_sync(force_sync=True)
    final = checkpoint_dir(args.save, state.iteration)
    partial = final + ".partial"
    if _rank0():
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    writer = _save_torch_dist if args.ckpt_format == "torch_dist" else _save_torch
    request = writer(partial, args, model, optimizer, scheduler, (state, rerun_state))
    finish = functools.partial(_publish, args, partial, final, (state.iteration, start), on_saved)
    if request is not None:  # --async-save: the files are still being written
        dist_ckpt.schedule_async(request, finish)
        print_rank_0(f"  scheduled an async save of iteration {state.iteration:7d} to {final}")
        return
    _barrier()
    finish()
    _barrier()


def _publish(args, partial: str, final: str, when: tuple, on_saved) -> None:
    """Every rank's files are written: rank 0 gives the checkpoint its name and points the
    tracker at it. ``when``: (iteration, perf_counter at the save's start)."""
    iteration, start = when
    if _rank0():
        shutil.rmtree(final, ignore_errors=True)
        os.replace(partial, final)
        previous = _tracked(args.save)
        write_tracker(args.save, iteration)
        if retired(previous, iteration, args.save_retain_interval):
            _delete(args.save, previous)
    print_rank_0(
        f"  successfully saved checkpoint from iteration {iteration:7d} to {final} "
        f"[ {args.ckpt_format}{', async' if args.async_save else ''}, "
        f"{time.perf_counter() - start:.1f} s ]"
    )
    if on_saved is not None:
        on_saved()


def retired(previous, iteration: int, retain_interval) -> bool:
    """Megatron-LM's --save-retain-interval N: a new save retires the checkpoint the tracker
    named before it (``previous``) unless N divides its iteration; the latest one always stays,
    and so do checkpoints the run did not write last (older ones, another run's)."""
    if retain_interval is None or previous is None:
        return False
    return 0 < previous != iteration and previous % retain_interval != 0


def _tracked(root: str):
    """The tracker's iteration, None when there is none or it does not read as one (rank 0
    alone reads it here: nothing is raised while the other ranks wait)."""
    try:
        return read_tracker(root)
    except CheckpointError:
        return None


def _delete(root: str, iteration: int) -> None:
    """Remove a retired checkpoint (a symbolic link is left alone, as Megatron-LM)."""
    folder = checkpoint_dir(root, iteration)
    if os.path.islink(folder):
        print(f"  kept checkpoint {folder} (--save-retain-interval): a symbolic link", flush=True)
        return
    shutil.rmtree(folder, ignore_errors=True)
    print(f"  deleted checkpoint {folder} (--save-retain-interval)", flush=True)


def finalize_async_saves(blocking: bool = False) -> None:
    """Publish the async saves that finished (all, waiting, if ``blocking``); collective."""
    dist_ckpt.finalize_async_saves(blocking)


def write_tracker(root: str, iteration: int) -> None:
    tmp = os.path.join(root, f".{TRACKER}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, TRACKER))


def _sharded_state(args, model, optimizer, scheduler, states, *, sharding, loading, optim, rng):
    """The sharded state dict of a save or a load; ``sharding``: the DistOpt layout (a save's,
    or the one the loaded checkpoint has); ``optim``/``rng``: whether those parts are in it;
    ``states``: (TrainState, the rerun state machine's state or None)."""
    state, rerun_state = states
    sd = _common_state(args, scheduler, state)
    if rerun_state is not None:  # common: mode, state, iteration; a ShardedObject per rank
        sd["rerun_state_machine"] = rerun_state
    for i, chunk in enumerate(model):
        sd[_model_key(model, i)] = chunk.module.sharded_state_dict()
    if optim:
        model_sd = {k: v for k, v in sd.items() if k.startswith("model")}
        sd["optimizer"] = optimizer.sharded_state_dict(
            model_sd, is_loading=loading, metadata=sharding
        )
    if rng:
        sd["rng_state"] = ShardedObject(
            "rng_state",
            [rng_state()],
            (
                parallel_state.get_pipeline_model_parallel_world_size(),
                parallel_state.get_tensor_model_parallel_world_size(),
            ),
            (
                parallel_state.get_pipeline_model_parallel_rank(),
                parallel_state.get_tensor_model_parallel_rank(),
            ),
            replica_id=parallel_state.get_data_parallel_rank(),
        )
    return sd


def _save_torch_dist(folder, args, model, optimizer, scheduler, states):
    """Write (or, with --async-save, start writing) ``folder``; the AsyncRequest or None."""
    sharding = dist_ckpt.sharding_metadata(args)
    parts = dict(optim=not args.no_save_optim, rng=not args.no_save_rng)
    sd = _sharded_state(
        args, model, optimizer, scheduler, states, sharding=sharding, loading=False, **parts
    )
    strategy, validate = dist_ckpt.save_strategy(args)
    return dist_checkpointing.save(
        sd,
        folder,
        sharded_strategy=strategy,
        validate_access_integrity=validate,
        async_sharded_save=args.async_save,
        content_metadata=sharding,
    )


def torch_file(folder: str) -> str:
    """Megatron-LM's per-model-parallel-rank file name."""
    name = f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_pipeline_model_parallel_rank():03d}"
    if parallel_state.get_expert_model_parallel_world_size() > 1:
        name += f"_{parallel_state.get_expert_model_parallel_rank():03d}"
    return os.path.join(folder, name, "model_optim_rng.pt")


def rerun_file(folder: str, rank: int) -> str:
    """The torch format's file of one rank's rerun state machine state (every rank has its own:
    its flags, failed result and micro-batches)."""
    return os.path.join(folder, "rerun_state_machine", f"rank_{rank:05d}.pt")


def _save_torch(folder, args, model, optimizer, scheduler, states) -> None:
    state, rerun_state = states
    if rerun_state is not None:
        path = rerun_file(folder, torch.distributed.get_rank())
        _makedirs_for(path)
        torch.save(rerun.per_rank(rerun_state), path)
    path = torch_file(folder)
    if args.use_distributed_optimizer and not args.no_save_optim:  # a DP collective
        _makedirs_for(path)
        optimizer.save_parameter_state(os.path.join(os.path.dirname(path), "distrib_optim.pt"))
    if parallel_state.get_expert_data_parallel_rank() != 0:
        return
    sd = _common_state(args, scheduler, state)
    for i, chunk in enumerate(model):
        sd[_model_key(model, i)] = chunk.module.state_dict()
    if not args.no_save_optim:
        sd["optimizer"] = optimizer.state_dict()
    if not args.no_save_rng:
        sd["rng_state"] = rng_state()
    _makedirs_for(path)
    torch.save(sd, path)


def _makedirs_for(path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)


# ----------------------------------------------------------------------------------- load


def read_tracker(root: str):
    """The latest iteration under ``root``, or None when there is no tracker file."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} is corrupt: expected an iteration number, got {text!r}")
    return int(text)


def load(args, model, optimizer, scheduler, state) -> None:
    """Resume from --load's latest checkpoint (or, without a tracker file, start fresh as
    Megatron-LM does). Raises CheckpointError naming what is missing or does not match."""
    iteration = read_tracker(args.load)
    if iteration is None:
        print_rank_0(f" > no {TRACKER} in --load {args.load}: starting from scratch")
        return
    folder = checkpoint_dir(args.load, iteration)
    if not os.path.isdir(folder):
        raise CheckpointError(f"{TRACKER} names iteration {iteration}, but {folder} is missing")
    start = time.perf_counter()
    try:
        loaded = _load_any(folder, args, model, optimizer, scheduler, state)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # a loader's error: say which and why
        raise CheckpointError(
            f"cannot load checkpoint {folder} (corrupt, truncated or incomplete?): {_why(err)}"
        ) from err
    _apply(loaded, args, model, optimizer, scheduler, state)
    print_rank_0(
        f"  successfully loaded checkpoint from {folder} at iteration {state.iteration} "
        f"[ {time.perf_counter() - start:.1f} s ]"
    )


def saved_format(folder: str) -> str:
    """The format a checkpoint folder was written in: torch_dist has dist_checkpointing's
    metadata.json, torch has per-rank files."""
    return "torch_dist" if os.path.isfile(os.path.join(folder, "metadata.json")) else "torch"


def check_format(args, folder: str) -> str:
    """Megatron-LM reads a checkpoint in the format it finds when --ckpt-format is torch_dist or
    --auto-detect-ckpt-format is given; --ckpt-format torch alone reads only torch files. Saves
    always use --ckpt-format, so a detected other format is converted by the next save."""
    found = saved_format(folder)
    if found != args.ckpt_format:
        if args.ckpt_format == "torch" and not args.auto_detect_ckpt_format:
            raise CheckpointError(
                f"checkpoint {folder} is in {found} format, this run reads --ckpt-format torch: "
                f"give --ckpt-format {found} or --auto-detect-ckpt-format"
            )
        print_rank_0(
            f" > loading a {found} checkpoint (detected); saving in --ckpt-format "
            f"{args.ckpt_format}"
        )
    return found


def _load_any(folder, args, model, optimizer, scheduler, state) -> dict:
    if check_format(args, folder) == "torch_dist":
        common = _read(lambda: dist_checkpointing.load_common_state_dict(folder), folder)
        check_compatible(args, common.get("args", {}), folder)
        check_saved_parts(args, common.get("saved_parts", {}), folder)
        return _load_torch_dist(folder, common, args, model, optimizer, scheduler, state)
    path = torch_file(folder)
    if not os.path.isfile(path):
        raise CheckpointError(
            f"{folder} has neither torch_dist metadata.json nor {os.path.basename(path)} in "
            f"{os.path.basename(os.path.dirname(path))}/ (saved with another TP/PP/EP layout?)"
        )
    loaded = _read(lambda: torch.load(path, map_location="cpu", weights_only=False), path)
    check_compatible(args, loaded.get("args", {}), folder)
    check_saved_parts(args, loaded.get("saved_parts", {}), folder)
    loaded["_distrib_optim"] = os.path.join(os.path.dirname(path), "distrib_optim.pt")
    loaded["rerun_state_machine"] = _read_rerun_file(args, folder)
    return loaded


def _loads_rerun_state(args, folder: str, saved_ranks) -> bool:
    """Whether this run loads the step to re-run a checkpoint holds. Not with --rerun-mode
    disabled (the machine would ignore it, as upstream); another number of ranks is refused on
    every rank (each rank's part holds its own micro-batches and failed result)."""
    if not rerun.enabled(args):
        print_rank_0(f" > --rerun-mode disabled: the step to re-run in {folder} is not re-run")
        return False
    world = torch.distributed.get_world_size()
    if saved_ranks is not None and saved_ranks != world:
        raise CheckpointError(
            f"checkpoint {folder} holds a step to re-run saved by {saved_ranks} ranks (rerun "
            f"state machine): resume it with that many ranks to re-run it, or give --rerun-mode "
            f"disabled to train on without it; this run has {world}"
        )
    return True


def _read_rerun_file(args, folder: str):
    """This rank's rerun state machine state of a torch checkpoint, None when it has none or
    this run does not load it. The folder's file count is the same on every rank."""
    files = os.path.dirname(rerun_file(folder, 0))
    if not os.path.isdir(files) or not _loads_rerun_state(args, folder, len(os.listdir(files))):
        return None
    path = rerun_file(folder, torch.distributed.get_rank())
    return _read(lambda: torch.load(path, map_location="cpu", weights_only=False), path)


def _load_torch_dist(folder, common, args, model, optimizer, scheduler, state) -> dict:
    """Load in the DistOpt layout the checkpoint has, with --dist-ckpt-strictness and
    --ckpt-fully-parallel-load."""
    sharding = dist_ckpt.loaded_sharding_metadata(common)
    parts = dict(optim=not args.no_load_optim, rng=not args.no_load_rng)
    # the rank's part of a saved rerun state machine (a template the load fills)
    saved = common.get("rerun_state_machine")
    loads = saved and _loads_rerun_state(args, folder, saved.get("world_size"))
    rerun_state = rerun.state_dict(None, force=True) if loads else None
    sd = _sharded_state(
        args,
        model,
        optimizer,
        scheduler,
        (state, rerun_state),
        sharding=sharding,
        loading=True,
        **parts,
    )
    strict = dist_ckpt.strictness(args)
    strategy = dist_ckpt.load_strategy(args, folder)
    try:
        loaded = dist_checkpointing.load(sd, folder, sharded_strategy=strategy, strict=strict)
    except CheckpointingException as err:
        if "keys" not in str(err):  # not a key mismatch that the strictness refused
            raise
        raise CheckpointError(
            f"checkpoint {folder} and what this run loads differ, refused by "
            f"--dist-ckpt-strictness {strict.value}: {err}"
        ) from err
    return dist_ckpt.loaded_state(loaded, strict)


def _why(err: BaseException) -> str:
    """One line per failure; torch's CheckpointException text embeds whole tracebacks."""
    if isinstance(err, CheckpointException):
        return "; ".join(
            f"rank {rank}: {_why(failure[0] if isinstance(failure, tuple) else failure)}"
            for rank, failure in err.failures.items()
        )
    return f"{type(err).__name__}: {err}".rstrip(": ")


def _read(reader, path):
    try:
        return reader()
    except (Exception, CheckpointException) as err:
        raise CheckpointError(
            f"checkpoint {path} is unreadable (corrupt or truncated?): {_why(err)}"
        ) from err


def check_saved_parts(args, parts: dict, folder: str) -> None:
    """A checkpoint saved with --no-save-optim / --no-save-rng lacks that part: loading it needs
    --no-load-optim / --no-load-rng (or --finetune), as Megatron-LM says."""
    for part, save_flag, load_flag in (
        ("optimizer", "--no-save-optim", "--no-load-optim"),
        ("rng", "--no-save-rng", "--no-load-rng"),
    ):
        needed = not getattr(args, load_flag[2:].replace("-", "_"))
        if needed and parts.get(part, True) is False:
            raise CheckpointError(
                f"checkpoint {folder} was saved with {save_flag}: it has no {part} state; "
                f"load it with {load_flag} (or --finetune)"
            )


def _with_virtual_size(saved: dict) -> dict:
    """Checkpoints that recorded only --num-layers-per-virtual-pipeline-stage: the model chunks
    per pipeline rank it gave (None: one)."""
    if "virtual_pipeline_size" in saved or "pipeline_model_parallel_size" not in saved:
        return saved
    per = saved.get("num_layers_per_virtual_pipeline_stage")
    size = saved["num_layers"] // saved["pipeline_model_parallel_size"] // per if per else 1
    return {**saved, "virtual_pipeline_size": size if size > 1 else None}


def check_compatible(args, saved: dict, folder: str) -> None:
    """Compare the model shape, layout (and, when loading it, the optimizer) to this run."""
    saved = _with_virtual_size(saved)
    rows = MODEL_SHAPE + (() if args.no_load_optim else OPTIMIZER_SHAPE)
    diffs = [
        f"{flag}: checkpoint {saved[attr]!r}, this run {getattr(args, attr, None)!r}"
        for attr, flag in rows
        if attr in saved and saved[attr] != getattr(args, attr, None)
    ]
    if not saved:
        diffs.append("the checkpoint records no run settings (not written by this trainer?)")
    if diffs:
        raise CheckpointError(f"checkpoint {folder} does not match this run: " + "; ".join(diffs))


def _group_lrs(optimizer) -> list:
    """Each param group's lr bounds as this run built them (--lr, --min-lr, --decoupled-lr):
    loading the optimizer restores the saved ones, which the scheduler reads per group."""
    return [{k: g[k] for k in ("max_lr", "min_lr") if k in g} for g in optimizer.param_groups]


def _load_scheduler(scheduler, saved: dict) -> None:
    """Megatron-LM's rule: without --use-checkpoint-opt_param-scheduler or
    --override-opt_param-scheduler the saved schedule must equal the command line's. Every rank
    holds the same schedule and arguments, so every rank raises here, none waits in a collective."""
    try:
        scheduler.load_state_dict(saved)
    except AssertionError as err:
        raise CheckpointError(
            f"the learning-rate schedule differs from the checkpoint's ({err}): give "
            "--use-checkpoint-opt_param-scheduler to continue the saved schedule, or "
            "--override-opt_param-scheduler to take this command line's"
        ) from None
    # load_state_dict sets the groups' lr and weight decay at the restored step before it reads
    # the checkpoint's weight-decay settings: set them again from the schedule as loaded.
    scheduler.step(increment=0)


def _apply(loaded, args, model, optimizer, scheduler, state) -> None:
    for i, chunk in enumerate(model):
        chunk.module.load_state_dict(loaded[_model_key(model, i)], strict=True)
    if (args.finetune or args.no_load_optim) and (args.fp16 or args.bf16):
        # The fp32 main params still hold this run's init: copy the loaded weights into them
        # (Megatron-LM does), or the first step writes the init back over the model.
        optimizer.reload_model_params()
    if args.finetune:
        return  # weights only: iteration 0, fresh optimizer, scheduler and data position
    if not args.no_load_optim:
        fresh = _group_lrs(optimizer) if args.override_opt_param_scheduler else None
        optimizer.load_state_dict(loaded["optimizer"])
        if "_distrib_optim" in loaded and args.use_distributed_optimizer:
            # DP rank 0 reads the file inside upstream's call: say which file on failure
            _read(
                lambda: optimizer.load_parameter_state(loaded["_distrib_optim"]),
                loaded["_distrib_optim"],
            )
        if fresh is not None:  # the groups' own lr bounds are part of the schedule replaced
            for group, lrs in zip(optimizer.param_groups, fresh, strict=True):
                group.update(lrs)
        _load_scheduler(scheduler, loaded["opt_param_scheduler"])
    if not args.no_load_rng:
        saved = loaded["rng_state"]
        # Applied by the caller once the data iterators exist: creating a DataLoader iterator
        # draws from torch's default generator, which the uninterrupted run did at its start.
        state.pending_rng_state = saved[0] if isinstance(saved, list) else saved
    state.iteration = loaded["iteration"]
    state.consumed_train_samples = loaded["consumed_train_samples"]
    state.consumed_valid_samples = loaded["consumed_valid_samples"]
    state.skipped_train_samples = loaded.get("skipped_train_samples", 0)  # older: none recorded
    if rerun.load_state_dict(loaded.get("rerun_state_machine")):
        print_rank_0(f" > the rerun state machine re-runs iteration {state.iteration + 1}")
