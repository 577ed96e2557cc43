"""Our Muon (``--optimizer muon --muon-impl megatron_muon``) through upstream's training loop
(base megatron-core 0.19.2) at TP2, PP2, PP2 with virtual stages, DP2 with the
DistributedOptimizer, and an MoE model at EP2: each run's per-iteration lm losses equal a
one-rank run's of the same model, data and initial weights, within fp32 reordering.

Every run starts from one initial checkpoint: upstream seeds each pipeline stage apart
(``seed + 100 * pp_rank``) and each TP/EP rank draws its own shard, so two layouts would not
start from the same weights; a one-rank, lr-0 iteration saves them (torch_dist) and every run
loads them with ``--finetune`` (weights only; iteration, optimizer and RNG start fresh),
resharded by torch_dist for its layout. Dropout is off, so every layout sees the same numbers.

    .venv/bin/python -m pytest -q tests/e2e/test_upstream_layouts.py
"""

import functools
from pathlib import Path

import pytest
from upstream_cli import CPU, MUON, hits, launch
from upstream_runs import FINAL
from upstream_runs import step_losses as _step_losses

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(900),
]

ITERS = 5
# 4 experts (SequentialMLP), top-2; upstream's fused bias-GeLU has no kernel for the experts'
# routing weights (mlp.py: swiglu and quick_gelu only), so it is off, as in upstream's MoE recipes.
MOE = "--num-experts 4 --moe-router-topk 2 --no-bias-gelu-fusion".split()
LAYOUTS = {  # name: (ranks, flags, the model's extra flags)
    "tp2": (2, ["--tensor-model-parallel-size", "2"], []),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"], []),
    "pp2_vpp2": (
        2,
        ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
        [],
    ),
    "dp2_distopt": (2, ["--use-distributed-optimizer"], []),
    "moe_ep2": (2, ["--expert-model-parallel-size", "2"], MOE),
}
# Tolerance on |loss - reference| / reference per iteration (the loss is printed to 7 digits,
# ~2e-7 relative). The layouts only reorder fp32 sums (TP's and DP's reductions, the pipeline's
# micro-batch order, the MoE dispatch): ~1e-7 relative on gradients. Muon's update is a smooth
# function of its momentum, and Newton-Schulz amplifies a relative perturbation by at most
# ~a^5 (a = 3.4445) on the smallest singular directions; tests/distributed measured <= 8.5e-6 on
# the updates over 3 steps (test_muon_parity.TOL) and losses within 0.042 of LOSS_RTOL = 1e-5
# under four summation orders. The same 1e-5 here; the negative control below shows a real
# layout error (TP blockwise) lands far above it.
LOSS_RTOL = 1e-5


@functools.cache
def _initial(tmp: Path, moe: bool) -> Path:
    """A torch_dist checkpoint of the model's initial weights: one rank, one iteration at lr 0."""
    folder = tmp / ("init_moe" if moe else "init")
    extra = [*MUON, *(MOE if moe else []), "--lr", "0", "--train-iters", "1"]
    launch(tmp, folder.name, 1, *extra, "--save", str(folder), "--save-interval", "1")
    return folder


@functools.cache
def _run(tmp: Path, name: str, ranks: int, flags: tuple, moe: bool) -> tuple:
    """(per-iteration lm losses, final validation/test losses) of one run from the initial
    weights."""
    init = _initial(tmp, moe)
    extra = [*MUON, *(MOE if moe else []), "--train-iters", str(ITERS)]
    out = launch(tmp, name, ranks, *extra, *flags, "--load", str(init), "--finetune")
    return _step_losses(out), FINAL.findall(out)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("layouts")


def _reference(tmp: Path, moe: bool) -> tuple:
    return _run(tmp, "reference_moe" if moe else "reference", 1, (), moe)


def _worst(tmp: Path, layout: str, ranks: int, flags: list, moe: bool) -> float:
    """The layout's worst per-iteration loss error relative to the one-rank reference's."""
    ref, ref_final = _reference(tmp, moe)
    assert ref[ITERS] < ref[1] - 0.05  # it trains: the comparison is of moving numbers
    losses, final = _run(tmp, layout, ranks, tuple(flags), moe)
    assert sorted(losses) == sorted(ref) == list(range(1, ITERS + 1))
    # and upstream's validation and test losses after the last step
    assert [name for name, _ in final] == [name for name, _ in ref_final] == ["validation", "test"]
    pairs = [(losses[i], ref[i]) for i in ref]
    pairs += [(float(got), float(want)) for (_, got), (_, want) in zip(final, ref_final)]
    worst = max(abs(got - want) / abs(want) for got, want in pairs)
    print(f"{layout}: worst loss error / LOSS_RTOL {worst / LOSS_RTOL:.3f}")
    return worst


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_one_rank(tmp, layout):
    ranks, flags, model = LAYOUTS[layout]
    assert _worst(tmp, layout, ranks, flags, bool(model)) <= LOSS_RTOL
    if CPU and "--tensor-model-parallel-size" in flags:  # its CPU stand-in (cpu_loop.T7) ran
        from megatron.training import cpu_loop

        assert set(cpu_loop.LAYOUT_STAND_INS) <= hits(tmp, layout)


def test_a_wrong_layout_misses(tmp):
    """Negative control: TP2 with upstream's default --muon-tp-mode blockwise, which
    orthogonalizes each TP shard of a matrix alone (another update than the whole matrix's), misses
    the reference by far more than LOSS_RTOL: the tolerance tells a layout's real error from
    fp32 reordering."""
    flags = ["--tensor-model-parallel-size", "2", "--muon-tp-mode", "blockwise"]
    assert _worst(tmp, "tp2_blockwise", 2, flags, False) > 10 * LOSS_RTOL
