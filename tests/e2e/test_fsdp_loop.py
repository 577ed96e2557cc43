"""ZeRO-3 through upstream's own loop (base megatron-core 0.19.2): pretrain_gpt.py with AdamW under
Megatron-FSDP (its fsdp_dtensor checkpoints) and torch FSDP2 (torch_dcp) on 2 ranks (gloo CPU
ranks where CUDA is absent): train, evaluate, save, and a resume that is exact. By hand:

    .venv/bin/python -m torch.distributed.run --nproc-per-node 2 --standalone pretrain_gpt.py \\
        --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2 \\
        --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \\
        --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 --train-iters 4 \\
        --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion \\
        --distributed-backend gloo --optimizer adam --use-megatron-fsdp \\
        --data-parallel-sharding-strategy optim_grads_params --ckpt-format fsdp_dtensor \\
        --save ckpt --save-interval 2
"""

import pytest
from upstream_runs import (
    CPU,
    FINAL,
    expected_stand_ins,
    hits,
    launch,
    logged,
    resume,
    same_checkpoints,
    step_losses,
)

from megatron.training import cpu_loop

pytestmark = [pytest.mark.e2e]

ADAM = ["--optimizer", "adam"]
SETUPS = {
    # ZeRO-3, the sharding the Muon work targets; the other strategies train in
    # tests/distributed/test_fsdp_adam.py. Upstream requires fsdp_dtensor with Megatron-FSDP.
    # Patch 0080: without it the save hangs (a rank with an empty shard has no Adam state).
    "megatron-fsdp-optim_grads_params": [
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--ckpt-format",
        "fsdp_dtensor",
    ],
    # FSDP2 needs untied embeddings (upstream asserts it) and torch_dcp: upstream's default
    # torch_dist fails at the first save ("Param id ... does not match any model sharded param").
    # Patch 0081: without it the resume raises (state_dict(is_loading=True)).
    "torch-fsdp2": [
        "--use-torch-fsdp2",
        "--untie-embeddings-and-output-weights",
        "--ckpt-format",
        "torch_dcp",
    ],
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("setup", list(SETUPS))
def test_fsdp_trains_and_a_resume_is_exact(tmp_path, setup):
    """4 iterations saving at 2 and 4, then a resume from 2: the loss falls, both runs evaluate
    (validation and test sets) alike, the resumed run logs the straight run's losses, and its
    iteration-4 checkpoint (weights, optimizer state, scheduler, RNG) equals the straight run's
    bit for bit."""
    straight = tmp_path / "straight"
    flags = [*ADAM, *SETUPS[setup], "--save-interval", "2"]
    out = launch(tmp_path, "straight", 4, *flags, "--save", str(straight))
    losses = step_losses(out)
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1] - 0.1
    # Megatron-FSDP asks for the GPU architecture (its high-priority streams): T7 too
    layout = set(cpu_loop.LAYOUT_STAND_INS) if CPU and "--use-megatron-fsdp" in flags else set()
    assert hits(tmp_path, "straight") == expected_stand_ins() | layout

    resumed, again = resume(tmp_path, straight, 2, 4, *flags)
    assert min(logged(again)) == 3
    # iteration 4's console line is the mean of 3 and 4 after a restart (design.md section 12)
    assert logged(again)[3] == logged(out)[3]
    assert step_losses(again) == pytest.approx({i: losses[i] for i in (3, 4)}, abs=3e-6)
    assert FINAL.findall(again) == FINAL.findall(out) and len(FINAL.findall(out)) == 2
    same_checkpoints(tmp_path, straight, resumed, 4)
