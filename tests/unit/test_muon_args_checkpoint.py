"""Patch 0092: for our Muon under FSDP2 (``--ckpt-format torch_dcp``) ``load_checkpoint`` reads
the checkpoint's args before its state, as upstream does for torch_dist and fsdp_dtensor, so a
Megatron-FSDP checkpoint of ours is refused in one line naming the flags before anything loads
(before: an AttributeError inside DCP once the load began). A real DCP checkpoint on disk (its
tracker file, ``iter_0000001/.metadata``), written and read in this process (no process group)."""

import argparse
import inspect

import pytest
import torch.distributed.checkpoint as dcp

from megatron.training import arguments, checkpointing
from megatron.training.muon_args import check_muon_impl_before_load

OURS = ["--optimizer", "muon", "--muon-impl", "megatron_muon"]


def _args(*flags):
    return arguments.add_megatron_arguments(argparse.ArgumentParser()).parse_args([*flags])


def _save(load_dir, saved_args):
    """What a save of ``saved_args``' run leaves that the rank0 read opens."""
    (load_dir / "latest_checkpointed_iteration.txt").write_text("1")
    dcp.save({"args": saved_args, "iteration": 1}, checkpoint_id=str(load_dir / "iter_0000001"))


@pytest.fixture(scope="module")
def load_dir(tmp_path_factory):
    """A checkpoint of our Muon under Megatron-FSDP (fsdp_dtensor: DCP on disk)."""
    path = tmp_path_factory.mktemp("megatron_fsdp_ckpt")
    _save(path, _args(*OURS, "--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"))
    return path


FSDP2 = ["--use-torch-fsdp2", "--ckpt-format", "torch_dcp"]


def _check(load_dir, args):
    """As load_checkpoint calls it (patch 0092): the reader is upstream's rank-0 read."""

    def read():
        return checkpointing._load_base_checkpoint(str(load_dir), args, rank0=True)[0]

    check_muon_impl_before_load(args, read)


def test_a_megatron_fsdp_checkpoint_is_refused_under_fsdp2_naming_the_flags(load_dir):
    with pytest.raises(
        RuntimeError, match="saved with --use-megatron-fsdp.*uses --use-torch-fsdp2"
    ):
        _check(load_dir, _args(*OURS, *FSDP2))


def test_an_fsdp2_checkpoint_of_ours_loads_and_other_runs_read_nothing(load_dir, tmp_path):
    _save(tmp_path, _args(*OURS, *FSDP2))
    _check(tmp_path, _args(*OURS, *FSDP2))  # the same flags: no error
    # negative control of the read: upstream's Muon, or --no-load-optim, is not refused
    # upstream's Muon reads nothing (had it read the checkpoint, --muon-impl would differ)
    check_muon_impl_before_load(_args("--optimizer", "muon", *FSDP2), lambda: pytest.fail("read"))
    _check(load_dir, _args(*OURS, *FSDP2, "--no-load-optim"))  # the model only: not refused


def test_load_checkpoint_checks_before_it_loads():
    source = inspect.getsource(checkpointing.load_checkpoint)
    call = source.index("check_muon_impl_before_load(")
    assert call < source.index("if args.auto_detect_ckpt_format")
