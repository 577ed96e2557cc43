"""Megatron-LM's rerun state machine (megatron-core's ``rerun_state_machine``) in this loop.

    --rerun-mode validate_results (default)   a rejected result (NaN/Inf loss or local grad norm
                                              with --check-for-nan-in-loss-and-grad, a spiky loss
                                              with --check-for-spiky-loss, large grads with
                                              --check-for-large-grads) re-runs the step on the
                                              same data and RNG state: a different result is a
                                              transient fault (exit 17 after a checkpoint when
                                              the check is fatal, else training goes on); the
                                              same result saves a checkpoint holding the
                                              machine's state and exits 16, to be resumed on
                                              another GPU, which tells a persistent fault from
                                              a correct result (exit 17 if fatal)
    --rerun-mode report_stats                 every step runs twice; the relative differences
                                              of the checked values are logged every 2 steps
    --rerun-mode disabled                     no re-run; a spiky loss or large grads only warn

``--error-injection-rate N`` makes one rank in N reject a checked result (from the process's
second step on: the machine validates nothing before its first optimizer step) and
``--error-injection-type`` decides what its re-runs see. Every decision is an all-reduce over
all ranks inside the machine, so every rank re-runs, saves and exits together.
"""

import contextlib
import functools
import logging
import sys

import torch
from megatron.core.rerun_state_machine import (
    RerunDataIterator,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    destroy_rerun_state_machine,
    get_rerun_state_machine,
    initialize_rerun_state_machine,
)

from megatron.core import tensor_parallel

# Megatron-LM's CLI names; its report_stats is the machine's REPORT_DETERMINISM_STATS
MODES = {
    "disabled": RerunMode.DISABLED,
    "validate_results": RerunMode.VALIDATE_RESULTS,
    "report_stats": RerunMode.REPORT_DETERMINISM_STATS,
}
SPIKY_LOSS_FACTOR = 10  # Megatron-LM's pretrain_gpt: a loss >= 10x the largest seen is spiky


def _checks(a) -> bool:
    return a.check_for_nan_in_loss_and_grad or a.check_for_spiky_loss or a.check_for_large_grads


# Cross-flag checks (validation.py runs them): nothing given here may be silently ignored.
RULES = (
    (
        lambda a: a.error_injection_rate < 0,
        lambda a: f"--error-injection-rate must be >= 0 (one rank in N rejects a checked "
        f"result; 0: no injection), got {a.error_injection_rate}",
    ),
    (
        lambda a: a.error_injection_rate > 0 and a.rerun_mode != "validate_results",
        lambda a: f"--error-injection-rate injects faults into --rerun-mode validate_results's "
        f"checks; with --rerun-mode {a.rerun_mode} nothing is injected: drop it or change the mode",
    ),
    (
        lambda a: a.error_injection_rate > 0 and not _checks(a),
        lambda a: "--error-injection-rate needs a check to inject into: "
        "--check-for-nan-in-loss-and-grad (on unless --no-check-for-nan-in-loss-and-grad), "
        "--check-for-spiky-loss or --check-for-large-grads",
    ),
    (
        lambda a: "error_injection_type" in a.given and a.error_injection_rate == 0,
        lambda a: "--error-injection-type needs --error-injection-rate > 0 (no fault is injected)",
    ),
)


class Stop(Exception):
    """The machine ends the run: ``checkpoint`` (save first) and the process exit ``code``."""

    def __init__(self, checkpoint: bool, code: int):
        super().__init__(f"rerun state machine: exit code {code}")
        self.checkpoint, self.code = checkpoint, code


def _routers(model) -> list:
    """The MoE routers with an aux-loss-free expert bias (--moe-router-enable-expert-bias)."""
    return [
        m for chunk in model for m in chunk.modules() if getattr(m, "expert_bias", None) is not None
    ]


def _save_states(model):
    """What a (re-)run changes before the optimizer step besides the RNG states the machine
    keeps: the model-parallel RNG tracker's (dropout), and the routers' expert bias, which
    finalize_model_grads moves at the end of every run (a re-run must start from the bias the
    step started from, or it routes differently and the bias moves twice)."""
    return {
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
        "expert_bias": [r.expert_bias.detach().clone() for r in _routers(model)],
    }


def _restore_states(model, saved) -> None:
    if saved["rng_tracker_states"]:
        tensor_parallel.get_cuda_rng_tracker().set_states(saved["rng_tracker_states"])
    with torch.no_grad():
        for router, bias in zip(_routers(model), saved["expert_bias"], strict=True):
            router.expert_bias.copy_(bias)


def initialize(args, model=()) -> None:
    """The process's machine from the flags (replacing one a previous run in this process left),
    for ``model`` (its chunks): a re-run restores the state ``_save_states`` names, as Megatron-LM
    restores the RNG tracker's."""
    destroy_rerun_state_machine()
    injector = RerunErrorInjector(
        error_injection_rate=args.error_injection_rate,
        error_injection_type=RerunDiagnostic(args.error_injection_type),
    )
    initialize_rerun_state_machine(
        state_save_func=functools.partial(_save_states, model),
        state_restore_func=functools.partial(_restore_states, model),
        mode=MODES[args.rerun_mode],
        error_injector=injector,
    )
    if args.rerun_mode == "report_stats":
        _show_reports()


def _show_reports() -> None:
    """report_stats's only output is the machine's INFO-level report, which Python's default
    logging (WARNING and up, no handler) would drop: show that logger's INFO lines."""
    logger = logging.getLogger("megatron.core.rerun_state_machine")
    if logger.level == logging.NOTSET or logger.level > logging.INFO:
        logger.setLevel(logging.INFO)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)


def enabled(args) -> bool:
    return args.rerun_mode != "disabled"


def checks_nan(args) -> bool:
    """Whether the machine validates NaN/Inf (losses here, each bucket's local grad norm in DDP:
    ``core_configs``): --check-for-nan-in-loss-and-grad with the machine on. Disabled, upstream's
    checks raise on the failing rank alone while its peers wait in a collective; the loop's
    collective check (failures.check_finite) covers that mode."""
    return args.check_for_nan_in_loss_and_grad and enabled(args)


def wrap(iterators):
    """The training iterator(s) made replayable: each micro-batch read in a step is kept until
    the next step starts, so that a re-run reads the same batches (None: a rank without data)."""
    if isinstance(iterators, list):
        return [wrap(it) for it in iterators]
    return None if iterators is None else RerunDataIterator(iterators)


def drop_batches(iterators) -> None:
    """Forget the micro-batches read since the step began (a step dropped by
    --iterations-to-skip: a range of them would otherwise keep all theirs until the next step)."""
    for iterator in iterators if isinstance(iterators, list) else [iterators]:
        if iterator is not None:
            iterator.advance()


_EVALUATING = []  # non-empty inside evaluating()


@contextlib.contextmanager
def evaluating():
    """Evaluation's forwards are no training step: the machine is off (as Megatron-LM's evaluate
    turns it off) and no loss is checked, so none feeds the spiky-loss reference either."""
    machine = get_rerun_state_machine()
    mode = machine.get_mode()
    machine.mode = RerunMode.DISABLED  # set_mode would log a warning at every evaluation
    _EVALUATING.append(True)
    try:
        yield
    finally:
        _EVALUATING.pop()
        machine.mode = mode


def judges_nan(args) -> bool:
    """Whether the machine checks this step's losses and local grad norms for NaN/Inf
    (validate_results with --check-for-nan-in-loss-and-grad; fp16: the loss, its loss scaler
    owns the grads), as upstream from a process's second step on. Where it does, the loop's own
    collective check (failures.check_finite) would be the same work again every step."""
    return (
        args.rerun_mode == "validate_results"
        and args.check_for_nan_in_loss_and_grad
        and get_rerun_state_machine().first_iteration_complete
    )


def validate_loss(args, loss: torch.Tensor) -> None:
    """Megatron-LM's pretrain_gpt checks of one micro-batch's loss (before any DP reduction);
    NaN/Inf only where ``checks_nan``."""
    if _EVALUATING:
        return
    # A copy: the machine keeps the first run's result to compare with the re-run's, and the
    # schedule divides the loss in place after this (by its tokens and micro-batches).
    loss = loss.detach().clone()
    machine = get_rerun_state_machine()
    if checks_nan(args):
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(
                result=loss,
                rejection_func=reject,
                message=f"found {what} in local forward loss calculation",
                tolerance=0.0,  # the forward pass is deterministic: a re-run must match exactly
                fatal=True,
            )
    if args.check_for_spiky_loss:
        machine.validate_result(
            result=loss,
            rejection_func=functools.partial(
                machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"
            ),
            message="Spiky loss",
            tolerance=0.0,
            fatal=False,
        )


def steps(data_iterator):
    """Yield once per (re-)run of this step's forward and backward; then raise ``Stop`` if the
    machine ends the run. Collective: every rank loops the same number of times."""
    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):
        yield
    checkpoint, stop, code = machine.should_checkpoint_and_exit()
    if stop:
        raise Stop(checkpoint, code)


def state_dict(data_iterator, force: bool = False):
    """The machine's state to checkpoint: None unless a step waits to be re-run from this
    checkpoint (exit 16; ``force``: the template a torch_dist load fills). After an exit 17 the
    diagnosis is done: its checkpoint holds no machine state, so a restarted job trains on (a
    finished in-place re-run, restored, would need RNG states only the exited process had).
    {mode, state, current_iteration, world_size} are the same on every rank; "sharded" (a
    ShardedObject per rank) holds the rank's flags, failed result and the step's micro-batches."""
    machine = get_rerun_state_machine()
    if not force and machine.state != RerunState.WILL_RERUN_FROM_CHECKPOINT:
        return None
    saved = machine.state_dict(data_iterator, "torch_dist", force=force)
    # the ranks that saved it: a resume with another number is refused by name
    return {**saved, "world_size": torch.distributed.get_world_size()}


def per_rank(saved: dict) -> dict:
    """A state_dict() with the rank's part as a plain dict (the torch format's per-rank file)."""
    return {**saved, "sharded": saved["sharded"].data}


def load_state_dict(saved) -> bool:
    """Restore a checkpointed machine (a step to re-run); False when there is none to restore,
    or --rerun-mode disabled (the machine says it ignores the saved state, as upstream)."""
    machine = get_rerun_state_machine()
    if not machine.validate_state_dict(saved):
        return False
    machine.load_state_dict(saved)
    return machine.get_mode() != RerunMode.DISABLED
