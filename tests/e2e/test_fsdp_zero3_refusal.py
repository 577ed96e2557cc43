"""A DistributedOptimizer checkpoint of our Muon under torch FSDP2 is refused in one line naming
the flags, on every rank, before any state is loaded (patch 0091: upstream reads a torch_dcp
checkpoint's args only with the state; the load failed with "KeyError: 'model'"). The other
directions and Megatron-FSDP take the same check (tests/e2e/test_muon_args.py; docs/fsdp.md).
"""

import pytest
from test_fsdp_muon_e2e import OURS, SETUPS
from upstream_runs import launch, logged

pytestmark = [pytest.mark.e2e]

REFUSAL = (
    "RuntimeError: checkpoint was saved with --use-distributed-optimizer (--ckpt-format "
    "torch_dist); this run uses --use-torch-fsdp2 (--ckpt-format torch_dcp): such checkpoints "
    "are not converted"
)


@pytest.mark.timeout(600)
def test_distopt_checkpoint_of_ours_is_refused_under_fsdp2(tmp_path):
    save = tmp_path / "ckpt"
    flags = [*OURS, "--use-distributed-optimizer", "--save", str(save), "--save-interval", "1"]
    launch(tmp_path, "distopt", 1, *flags)
    out = launch(tmp_path, "fsdp2", 2, *OURS, *SETUPS["torch-fsdp2"], "--load", str(save), rc=1)
    assert f"[rank0]: {REFUSAL}" in out and f"[rank1]: {REFUSAL}" in out, out[-4000:]
    assert not logged(out)  # stopped in load_checkpoint: no iteration ran
