"""An MoE GPT (4 experts, SequentialMLP, top-2) trains with Muon under expert parallelism and its
expert weights match one process (each expert is its own Muon matrix, expert-TP group for TP).

    .venv/bin/python -m pytest tests/distributed/test_muon_moe.py -q
"""

import functools

import pytest
from harness import RankFailure, run_distributed
from parity import assert_close_runs
from tiny_gpt import TinyGPT, train

STEPS = 3
# The allgather dispatcher: the alltoall one waits on a CUDA event that CPU mode stubs out.
SPEC = TinyGPT(num_layers=2, num_moe_experts=4, moe_token_dispatcher_type="allgather")
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="fp32")
# Same reasoning as test_muon_parity.TOL (fp32 sums reordered by the all-to-all dispatch and
# the DP/TP reductions; NS is smooth). Top-2 routing is discrete, but a tie flip would change the
# loss by far more than LOSS_RTOL, which the comparison would catch.
TOL = 1e-4
LOSS_RTOL = 1e-5

# Expert parallelism (and expert TP) does not run on CPU yet: the allgather dispatcher's backward allocates on
# torch.cuda.current_device() outside CPU mode's TorchFunctionMode, the alltoall one waits on a
# stubbed CUDA event (megatron/core/cpu_mode.py). Expected to pass on a GPU; xfail here.
CPU_EP = pytest.mark.xfail(raises=RankFailure, reason="EP on CPU: cpu_mode gaps", strict=True)

LAYOUTS = {
    "dp2": dict(world_size=2, ep=1),
    "dp2_expert_tp2": pytest.param(dict(world_size=2, ep=1, etp=2), marks=CPU_EP),
    "ep2": pytest.param(dict(world_size=2, ep=2), marks=CPU_EP),
    # MoE with TP > 1 requires sequence parallelism, which the local spec lacks; expert TP
    # alone (etp=2, tp=1) still shards every expert matrix over the expert-TP group.
    "ep2_expert_tp2_duplicated": pytest.param(
        dict(world_size=4, ep=2, etp=2, muon_tp_mode="duplicated"), marks=CPU_EP
    ),
}


@functools.cache
def reference():
    return run_distributed(train, 1, args=(SPEC, STEPS), kwargs=MUON)[0]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS)
def test_moe_expert_weights_match_one_process(layout):
    kwargs = dict(layout)
    world, ep, etp = kwargs.pop("world_size"), kwargs.pop("ep"), kwargs.pop("etp", None)
    got = run_distributed(
        train, world, ep=ep, etp=etp, args=(SPEC, STEPS), kwargs={**MUON, **kwargs}
    )
    errors = assert_close_runs(reference(), got, tol=TOL, loss_rtol=LOSS_RTOL)
    experts = [k for k in errors if ".experts.local_experts." in k]
    assert len(experts) == SPEC.num_layers * SPEC.num_moe_experts * 2  # fc1 and fc2 each
    initial, ref, _ = reference()
    assert all((ref[k] - initial[k]).norm() > 0 for k in experts), "an expert never trained"
