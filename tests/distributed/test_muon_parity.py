"""Muon inside Megatron matches one process under TP (duplicated, distributed), PP and DP.

A tiny real GPT (local spec, GQA 4 heads / 2 query groups, SwiGLU, QKV split on) trains 3 steps
with ``OptimizerConfig(optimizer='muon')`` on gloo CPU ranks. Reproduce one case by hand:

    .venv/bin/python -m pytest tests/distributed/test_muon_parity.py -k tp2_pp2_dp2 -q
"""

import dataclasses
import functools

import pytest
from cli_config import transformer_config
from harness import run_distributed
from parity import assert_close_runs, misses, update_rel_error
from tiny_gpt import TinyGPT, build_model, shard, train, unshard

from megatron.core.optimizer.megatron_muon.functional import MuonParamInfo, orthogonalize_matrices
from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
# fp32 Newton-Schulz, so the comparison measures the layouts, not bf16 matmul rounding.
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)

# Tolerance on parity.update_rel_error (||got - ref|| / ||ref - initial||). Measured: TP2 both
# exact modes ~7e-6, DP2 ~5e-6, PP2 0, TP2xPP2xDP2 ~7e-6, the layouts of
# --pipeline-model-parallel-layout 0 (PP3) and ~5e-6 (PP2 x 2 virtual stages x DP2, DistOpt);
# blockwise vs exact ~0.7; the worst of every file's fp32 parity checks under all the summation
# orders tools/parity_margins.py runs (ATEN_CPU_CAPABILITY default/avx2 x 1/2 threads) 8.5e-6. TP
# and DP
# only reorder fp32 sums (~1e-7 relative on gradients); Muon's update is a smooth function of
# the momentum (no sign flips as in Adam's first steps), and NS's small-singular-value gain
# (a^k = 3.4445^5 ~ 500 at most) bounds the amplification. 1e-4 leaves >10x margin over the
# measured error and sits >1000x below what a wrong layout (blockwise, wrong partition_dim) gives.
TOL = 1e-4
LOSS_RTOL = 1e-5
WRONG = 100 * TOL  # a broken exchange must miss the reference by at least this
CLI = (  # TinyGPT's shape, as pretrain_gpt.py flags
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 3 --lr 1e-2 --mock-data"
)


def cli_spec(layout: str, pp: int, world_size: int | None = None) -> TinyGPT:
    """The tiny GPT with the pipeline fields ``pretrain_gpt.py`` sets for this layout: the
    parsed layout and, with virtual stages, the send/recv settings (core_configs.pipeline_p2p)."""
    flags = f"{CLI} --pipeline-model-parallel-size {pp} --pipeline-model-parallel-layout {layout}"
    config = transformer_config(flags.split(), world_size=world_size or pp)
    names = ("pipeline_model_parallel_layout", "overlap_p2p_comm", "batch_p2p_comm")
    return TinyGPT(extra={name: getattr(config, name) for name in names})


FIRST1 = {"num_layers_in_first_pipeline_stage": 1}
LAST1 = {"num_layers_in_last_pipeline_stage": 1}
LAYOUTS = {
    "tp2_duplicated": dict(world_size=2, tp=2, muon_tp_mode="duplicated"),
    "tp2_distributed": dict(world_size=2, tp=2, muon_tp_mode="distributed"),
    "pp2": dict(world_size=2, pp=2),
    "dp2": dict(world_size=2),
    "tp2_pp2_dp2_duplicated": dict(world_size=8, tp=2, pp=2, muon_tp_mode="duplicated"),
    "tp2_pp2_dp2_distributed": dict(world_size=8, tp=2, pp=2, muon_tp_mode="distributed"),
    # uneven stages (--decoder-first/last-pipeline-num-layers): layers 1 | 3, and 1 | 2 | 1
    "pp2_first1_dp2_distopt": dict(world_size=4, pp=2, spec=TinyGPT(extra=FIRST1), distopt=True),
    "pp3_first1_last1": dict(world_size=3, pp=3, spec=TinyGPT(extra={**FIRST1, **LAST1})),
    # --pipeline-model-parallel-layout: the loss alone on the last stage (layers 1 | 3 | 0); the
    # embedding alone on a virtual stage, layers 0 1 | 2 1 over PP2 x 2 virtual stages, DistOpt
    "pp3_layout_loss_stage": dict(world_size=3, pp=3, spec=cli_spec("Et|ttt|L", pp=3)),
    "pp2_vpp2_layout_dp2_distopt": dict(
        world_size=4, pp=2, vpp=2, spec=cli_spec("E|tt|t|tL", pp=2, world_size=4), distopt=True
    ),
}
STAGES = {  # each rank's model chunks, spelt as the layout spells a stage
    "pp2_first1_dp2_distopt": [["Et"]] * 2 + [["tttL"]] * 2,
    "pp3_first1_last1": [["Et"], ["tt"], ["tL"]],
    "pp3_layout_loss_stage": [["Et"], ["ttt"], ["L"]],
    "pp2_vpp2_layout_dp2_distopt": [["E", "t"]] * 2 + [["tt", "tL"]] * 2,
}


def run_layout(world_size, tp=1, pp=1, vpp=None, spec=None, **kwargs):
    return run_distributed(
        train,
        world_size,
        tp=tp,
        pp=pp,
        vpp=vpp,
        args=(spec or TinyGPT(), STEPS),
        kwargs={**MUON, **kwargs},
    )


@functools.cache
def reference(hook=None):
    return run_distributed(
        train, 1, args=(TinyGPT(), STEPS), kwargs={**MUON, "optimizer_hook": hook}
    )[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_muon_layout_matches_one_process(layout):
    got = run_layout(**LAYOUTS[layout])
    errors = assert_close_runs(reference(), got, tol=TOL, loss_rtol=LOSS_RTOL)
    # Muon touched every hidden matrix: none is trivially equal because it did not move
    initial, ref, _ = reference()
    assert all((ref[k] - initial[k]).norm() > 0 for k in errors)


def _stages(spec: TinyGPT) -> list[str]:
    """This rank's chunks as built: E where it holds the embedding, t per layer, L the loss."""
    built = [chunk.module for chunk in build_model(spec)]
    return ["E" * m.pre_process + "t" * len(m.decoder.layers) + "L" * m.post_process for m in built]


@pytest.mark.parametrize("name", STAGES)
def test_uneven_layouts_build_uneven_stages(name):
    """The uneven layouts above are what they say (an even split would match one process too)."""
    layout = LAYOUTS[name]
    args = (layout["world_size"],)
    got = run_distributed(
        _stages, *args, pp=layout["pp"], vpp=layout.get("vpp"), args=(layout["spec"],)
    )
    assert got == STAGES[name]


# ----------------------------------------------------------------- blockwise: TP-local Muon

SPEC = TinyGPT()
FC1_SHAPE = (2 * SPEC.ffn_hidden_size, SPEC.hidden_size)  # only SwiGLU's fc1 has this shape


class BlockwiseReference:
    """One-process orthogonalizer that cuts each TP-split matrix as TP=2 ranks hold it and
    orthogonalizes every slice on its own (local shape, local query groups): what TP=2
    ``blockwise`` must compute."""

    def __init__(self, tp: int) -> None:
        self.tp = tp

    def __call__(self, updates, infos, spec):
        return [self._one(u, info, spec) for u, info in zip(updates, infos)]

    def _one(self, u, info, spec):
        dim = info.partition_dim
        if dim is None:
            return orthogonalize_matrices([u], [info], spec)[0]
        name = "linear_fc1.weight" if tuple(u.shape) == FC1_SHAPE else "w"
        slices = [shard(u, name, dim, self.tp, r) for r in range(self.tp)]
        local = [MuonParamInfo(tuple(s.shape), info.qkv_split) for s in slices]
        return unshard(orthogonalize_matrices(slices, local, spec), name, dim)


def _inner_muons(optimizer):
    return [opt.optimizer for opt in optimizer.chained_optimizers if opt.optimizer is not None]


def use_blockwise_reference(optimizer):
    for muon in _inner_muons(optimizer):
        infos = [i for group in muon.group_infos for i in group]
        assert {i.partition_dim for i in infos} == {0, 1}, "TP attributes missing at TP=1"
        muon.orthogonalizer = BlockwiseReference(tp=2)


def test_blockwise_matches_tp_local_reference_and_differs_from_exact():
    got = run_layout(world_size=2, tp=2, muon_tp_mode="blockwise")
    assert_close_runs(reference(use_blockwise_reference), got, tol=TOL, loss_rtol=LOSS_RTOL)
    initial, exact, _ = reference()
    errors = update_rel_error(initial, exact, got[0][1])
    assert misses(errors, WRONG), "blockwise should not be exact Muon"


# ------------------------------------------------------------- negative control: partition_dim


def swap_partition_dim(optimizer):
    """The proof of concept's bug: read rows as columns (and back). QKV keeps its dim: the
    distributed mode asserts that a fused QKV is row-split, which would end the run early."""
    for muon in _inner_muons(optimizer):
        muon.group_infos = [
            [
                i
                if i.partition_dim is None or i.qkv_split
                else dataclasses.replace(i, partition_dim=1 - i.partition_dim)
                for i in group
            ]
            for group in muon.group_infos
        ]
        muon.param_info.clear()  # rebuilt from group_infos on the next lookup


@pytest.mark.parametrize("mode", ["duplicated", "distributed"])
def test_negative_control_wrong_partition_dim_breaks_parity(mode):
    initial, ref, _ = reference()
    got = run_layout(world_size=2, tp=2, muon_tp_mode=mode, optimizer_hook=swap_partition_dim)
    errors = update_rel_error(initial, ref, got[0][1])
    broken = {k for k, e in errors.items() if e > WRONG}
    # the row- and the column-split matrices both go wrong (and, through the loss, the rest)
    assert any("linear_proj" in k for k in broken) and any("linear_fc1" in k for k in broken)
    assert misses(errors, 1000 * TOL)
