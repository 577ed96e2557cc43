"""The loop's rerun wiring on 2 gloo ranks: a re-run reads the step's micro-batches again (and
the next step the next ones), and every rank re-runs when only one rank rejected a result.
megatron-core's own RerunStateMachine decides; what is tested is rerun.wrap / rerun.steps /
rerun.validate_loss as training.train_step and pretrain_gpt's loss_func use them."""

import argparse
import random

import torch

from tests.harness import run_distributed

ARGS = dict(
    rerun_mode="validate_results",
    error_injection_type="transient_error",
    check_for_nan_in_loss_and_grad=False,
    check_for_spiky_loss=True,  # non-fatal: a transient fault re-runs, then training goes on
)
STEPS, MICRO = 3, 2


def _record(rate: int, break_rewind: bool = False) -> list:
    """Per step, per (re-)run: (the micro-batches read, this rank rejected its result)."""
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    from megatron.training import rerun

    if break_rewind:  # negative control: a re-run that reads on instead of replaying
        RerunDataIterator.rewind = lambda self: None
    random.seed(0)  # the injector draws from `random`: same stream, so ranks differ by rank alone
    rerun.initialize(argparse.Namespace(**ARGS, error_injection_rate=rate))
    rank = torch.distributed.get_rank()
    data = rerun.wrap(iter(range(100 * rank, 100 * rank + 100)))
    machine, steps = get_rerun_state_machine(), []
    for _ in range(STEPS):
        runs = []
        for _ in rerun.steps(data):
            batches = [next(data) for _ in range(MICRO)]
            # one checked result per (re-)run: with rate 2 exactly one of the two ranks rejects
            rerun.validate_loss(argparse.Namespace(**ARGS), torch.tensor(float(batches[0])))
            runs.append((batches, machine.rerun_requested))
        steps.append(runs)
    return steps


def test_a_rerun_replays_the_steps_batches_and_every_rank_reruns():
    per_rank = run_distributed(_record, 2, args=(2,))
    for rank, steps in enumerate(per_rank):
        first = [runs[0][0] for runs in steps]
        expected = [[100 * rank + MICRO * s + m for m in range(MICRO)] for s in range(STEPS)]
        assert first == expected  # each step reads the next micro-batches, none twice
        assert len(steps[0]) == 1  # nothing is validated before a first optimizer step
        for runs in steps[1:]:
            assert len(runs) == 2 and runs[1][0] == runs[0][0], runs  # same batches again
    rejected = [[runs[0][1] for runs in steps[1:]] for steps in per_rank]
    # in each re-run step one rank rejected and the other re-ran on the all-reduced decision
    assert all(a != b for a, b in zip(*rejected)), rejected


def test_negative_control_without_the_replay_the_rerun_reads_new_batches():
    per_rank = run_distributed(_record, 2, args=(2, True))
    assert all(runs[1][0] != runs[0][0] for steps in per_rank for runs in steps[1:])


# ------------------------------------------------ state a re-run must not advance: expert bias

MOE = dict(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid")


def _moe_run(mode: str, steps: int = 3) -> dict:
    """A tiny MoE GPT with aux-loss-free expert bias trained with the rerun wiring of
    training.train_step (rerun.steps around the schedule, rerun.validate_loss in the loss)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron.core import parallel_state as ps
    from megatron.training import rerun
    from tests import tiny_gpt

    spec = tiny_gpt.TinyGPT(
        num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather", extra=MOE
    )
    model = tiny_gpt.build_model(spec)
    optimizer = tiny_gpt.build_optimizer(spec, model)
    args = argparse.Namespace(
        **{**ARGS, "check_for_nan_in_loss_and_grad": True, "rerun_mode": mode},
        error_injection_rate=0,
    )
    rerun.initialize(args, model)  # as training.pretrain does

    def forward_step(data_iterator, chunk):
        output, loss_func = tiny_gpt._forward_step(data_iterator, chunk)

        def checked(per_token):
            loss, report = loss_func(per_token)
            rerun.validate_loss(args, loss)
            return loss, report

        return output, checked

    losses, runs = [], 0
    for batch in tiny_gpt.global_batches(spec, steps):
        micro = tiny_gpt._micro_batches(spec, batch)
        data = rerun.wrap(iter(micro))
        for _ in rerun.steps(data):
            runs += 1
            for chunk in model:
                chunk.zero_grad_buffer()
            optimizer.zero_grad()
            out = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=data,
                model=model,
                num_microbatches=len(micro),
                seq_length=spec.seq_length,
                micro_batch_size=spec.micro_batch_size,
                forward_only=False,
            )
        optimizer.step()
        losses.append(tiny_gpt._dp_mean_loss(out))
    biases = [m.expert_bias.clone() for m in model[0].modules() if hasattr(m, "expert_bias")]
    assert biases and ps.get_data_parallel_world_size() == 1
    return dict(losses=losses, biases=biases, runs=runs)


def _moe_runs() -> dict:
    return {mode: _moe_run(mode) for mode in ("disabled", "report_stats")}


def test_a_rerun_leaves_the_expert_bias_as_one_run_does():
    """report_stats runs every step twice; the model it trains must be the one a single run
    trains: the expert bias the first run's finalize_model_grads moved is restored for the
    re-run, which moves it once (same tokens per expert, same update)."""
    (runs,) = run_distributed(_moe_runs, 1)  # one process: MoE's first build is the slow part
    once, twice = runs["disabled"], runs["report_stats"]
    assert once["runs"] == 3 and twice["runs"] == 6  # every step re-run under report_stats
    assert twice["losses"] == once["losses"]  # CPU: deterministic, so exactly equal
    for a, b in zip(once["biases"], twice["biases"]):
        assert torch.equal(a, b), (a, b)


# ------------------------------------ the loop's own NaN check: only where the machine judges not


def _finite_checks(mode: str, steps: int = 3) -> list:
    """training.train_step on a tiny GPT: per step, whether the loop's collective NaN/Inf check
    (failures.check_finite: a pass over every grad buffer and an all-reduce) ran."""
    from unittest import mock

    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from megatron.training import failures, rerun, training
    from tests import tiny_gpt

    spec = tiny_gpt.TinyGPT(num_layers=2)
    # the bucket grad norms judged as core_configs.ddp_config has them with the machine on
    model = tiny_gpt.build_model(spec, ddp_extra=dict(check_for_nan_in_grad=mode != "disabled"))
    optimizer = tiny_gpt.build_optimizer(spec, model)
    args = argparse.Namespace(
        **{**ARGS, "check_for_nan_in_loss_and_grad": True, "rerun_mode": mode},
        error_injection_rate=0,
        fp16=False,
        empty_unused_memory_level=0,
        barrier_with_L1_time=False,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        num_experts=None,
    )
    rerun.initialize(args, model)
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, spec.global_batch_size, spec.micro_batch_size, 1)

    def forward_step(data_iterator, chunk):
        output, _ = tiny_gpt._forward_step(data_iterator, chunk)

        def loss_func(per_token):  # pretrain_gpt's shape: [loss sum, tokens] reported
            loss = per_token.float().sum()
            rerun.validate_loss(args, loss)
            tokens = torch.tensor(per_token.numel(), dtype=torch.int)
            return loss, tokens, {"lm loss": torch.stack([loss.detach(), tokens.float()])}

        return output, loss_func

    ran, calls = [], []
    real = failures.check_finite
    scheduler = mock.Mock()
    with mock.patch.object(failures, "check_finite", lambda *a: calls.append(real(*a))):
        for batch in tiny_gpt.global_batches(spec, steps):
            before = len(calls)
            data = rerun.wrap(iter(tiny_gpt._micro_batches(spec, batch)))
            training.train_step(args, forward_step, data, model, optimizer, scheduler)
            ran.append(len(calls) - before)
    return ran


def test_the_loops_nan_check_runs_only_where_the_machine_judges_not():
    """validate_results judges each loss and bucket grad norm from a process's second step on
    (upstream's only check): the loop's own check is then redundant work per step (an extra
    all-reduce and sync, a bool copy of every grad buffer). It stays on the first step and
    where the machine does not judge (disabled, report_stats)."""
    (judged,) = run_distributed(_finite_checks, 1, args=("validate_results",))
    assert judged == [1, 0, 0]
    (off,) = run_distributed(_finite_checks, 1, args=("disabled",))
    assert off == [1, 1, 1]  # negative control: without the machine, every step
    (stats,) = run_distributed(_finite_checks, 1, args=("report_stats",))
    assert stats == [1, 1, 1]  # report_stats rejects nothing


# ---------------------------------------------- --iterations-to-skip: no batch kept for replay


def _kept_while_skipping(skipped: int) -> list:
    """Micro-batches the replay iterator holds after each of ``skipped`` dropped steps
    (training._skip_step) and after the next real step has read its own."""
    from megatron.core.num_microbatches_calculator import (
        destroy_num_microbatches_calculator,
        init_num_microbatches_calculator,
    )

    from megatron.training import rerun, training

    rerun.initialize(argparse.Namespace(**ARGS, error_injection_rate=0))
    destroy_num_microbatches_calculator()
    init_num_microbatches_calculator(0, None, MICRO, 1, 1)  # MICRO micro-batches per step
    data, state = rerun.wrap(iter(range(1000))), training.TrainState()
    kept = []
    for _ in range(skipped):
        training._skip_step(data, state, MICRO)
        kept.append(len(data.saved_microbatches))
    for _ in rerun.steps(data):
        [next(data) for _ in range(MICRO)]
    kept.append(data.saved_microbatches)
    return kept


def test_skipped_steps_leave_no_batches_to_replay():
    """A re-run replays its own step's micro-batches only: a dropped step's are dropped, or a
    range of skipped steps would pile up all its batches until the next step."""
    (kept,) = run_distributed(_kept_while_skipping, 1, args=(5,))
    assert kept[:-1] == [0] * 5, kept
    assert kept[-1] == list(range(5 * MICRO, 6 * MICRO))  # the real step's own, read after
