"""A non-finite loss through upstream's rerun state machine (megatron/core/rerun_state_machine.py,
``--rerun-mode validate_results``, upstream's default) on upstream's own training loop (base
megatron-core 0.19.2), with upstream's error injection (``--error-injection-rate 1``: every
validated result is rejected, the first at iteration 2; iteration 1 is never validated). The
result checked is the loss gpt_entry.loss_func sends through ``validate_result`` (NaN, then Inf)
with ``fatal=True``, as upstream's pretrain_gpt.py. Launches: upstream_runs.py.

What 0.19.2 does (should_checkpoint_and_exit), and what is checked:
- the rejected result is not reproduced by the re-run in place (``transient_error``): "Possible
  transient error", every rank exits 17 (EXIT_CODE_FAILED_ON_RESULT_VALIDATION), nothing saved;
- it is reproduced (``persistent_error``): a checkpoint of the last good iteration (1) is saved
  and every rank exits 16 (EXIT_CODE_RESUME_TO_DISAMBIGUATE), to re-run the step on another GPU;
  resumed on the same node and device, every rank exits 16 again and saves nothing.

A real NaN, not injected: our Muon under the DistributedOptimizer at ``--lr 1e30`` overflows the
second forward pass. The re-run reproduces it (a persistent error): the checkpoint of iteration
1 holds finite weights and optimizer state (the NaN step never reached them; only the rerun
machine's record of the result is NaN), and every rank exits 16.
"""

import pytest
import torch
from upstream_runs import checkpoint, launch, logged, rank_exits

pytestmark = [
    pytest.mark.e2e,
]

ITERS = 6


def _injected(kind: str) -> list:
    return ["--error-injection-rate", "1", "--error-injection-type", kind]


@pytest.mark.timeout(900)
def test_a_transient_error_exits_17_without_a_checkpoint(tmp_path):
    save = tmp_path / "ckpt"
    flags = [*_injected("transient_error"), "--save", str(save), "--save-interval", "1000"]
    out = launch(tmp_path, "transient", ITERS, *flags, rc=1)  # torchrun: a rank failed
    assert rank_exits(tmp_path, "transient") == {0: 17, 1: 17}, out[-4000:]
    assert "Possible transient error" in out
    assert sorted(logged(out)) == [1]  # iteration 2 never completes
    assert not (save / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.timeout(900)
def test_a_persistent_error_saves_and_exits_16_then_16_again_on_the_same_device(tmp_path):
    save = tmp_path / "ckpt"
    flags = [*_injected("persistent_error"), "--save", str(save), "--save-interval", "1000"]
    out = launch(tmp_path, "persistent", ITERS, *flags, rc=1)
    assert rank_exits(tmp_path, "persistent") == {0: 16, 1: 16}, out[-4000:]
    assert "unexpected result is reproducible within the tolerance" in out
    assert sorted(logged(out)) == [1]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    saved = sorted(p.name for p in save.iterdir())

    again = launch(tmp_path, "again", ITERS, *flags, "--load", str(save), rc=1)
    assert rank_exits(tmp_path, "again") == {0: 16, 1: 16}, again[-4000:]
    assert "Got rescheduled on the same GPU" in again
    assert logged(again) == {}
    assert sorted(p.name for p in save.iterdir()) == saved


def _tensors(entry, path=""):
    if isinstance(entry, torch.Tensor):
        yield path, entry
    elif isinstance(entry, dict):
        for key, value in entry.items():
            yield from _tensors(value, f"{path}/{key}")
    elif isinstance(entry, (list, tuple)):
        for i, value in enumerate(entry):
            yield from _tensors(value, f"{path}/{i}")


@pytest.mark.timeout(900)
def test_a_real_nan_of_our_muon_saves_the_last_good_iteration_and_exits_16(tmp_path):
    save = tmp_path / "ckpt"
    ours = "--optimizer muon --muon-impl megatron_muon --use-distributed-optimizer".split()
    flags = [*ours, "--lr", "1e30", "--save", str(save), "--save-interval", "1000"]
    out = launch(tmp_path, "nan", ITERS, *flags, rc=1)
    assert rank_exits(tmp_path, "nan") == {0: 16, 1: 16}, out[-4000:]
    assert "Unexpected result nan" in out and "found NaN in local forward loss" in out
    assert "unexpected result is reproducible within the tolerance (nan = nan)" in out
    assert sorted(logged(out)) == [1]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "1"
    saved = dict(_tensors(checkpoint(save / "iter_0000001", tmp_path / "scratch.pt")))
    nonfinite = {p for p, t in saved.items() if t.is_floating_point() and not t.isfinite().all()}
    assert nonfinite and all(p.startswith("/rerun_state_machine_state/") for p in nonfinite)
    assert any("exp_avg" in p or "momentum" in p for p in saved), sorted(saved)[:40]
