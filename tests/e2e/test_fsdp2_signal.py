"""SIGTERM with ``--exit-signal-handler`` saves our Muon under torch FSDP2 (``torch_dcp``), with
Megatron-LM's default ``--num-workers 2``: test_upstream_signals.py's signalled run, flags of
test_fsdp_muon_e2e.py (whose Megatron-FSDP case this mirrors)."""

import pytest
from test_fsdp_muon_e2e import OURS, SETUPS
from test_upstream_signals import SIGNALLED_AFTER, _signalled_run
from upstream_runs import logged, rank_exits

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(600)
def test_sigterm_saves_our_muon_under_torch_fsdp2(tmp_path):
    """Every rank saves the iteration it reached (torch_dcp, Muon's momentum in it) and exits 0."""
    save = tmp_path / "ckpt"
    _, out = _signalled_run(tmp_path, save, *OURS, *SETUPS["torch-fsdp2"])
    reached = max(logged(out))
    assert SIGNALLED_AFTER <= reached and "exiting program after receiving SIGTERM" in out
    assert (save / "latest_checkpointed_iteration.txt").read_text() == str(reached)
    assert rank_exits(tmp_path, "signalled") == {0: 0, 1: 0}, out[-4000:]
    saved = save / f"iter_{reached:07d}"
    assert (saved / ".metadata").exists() and b"momentum_buffer" in (
        saved / ".metadata"
    ).read_bytes()
