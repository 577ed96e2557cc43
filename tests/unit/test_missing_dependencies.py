"""cpu_loop.missing_dependencies: the packages upstream's loop imports only for some flags,
named before a run starts (gpt_entry prints ``pretrain_gpt.py: error: needs the package ...``).

Which packages are importable is faked (``importlib.util.find_spec`` monkeypatched), so each case
runs whether or not the optional extras are installed. Negative control: without the wandb clause
in missing_dependencies, the --wandb-project cases find nothing and fail.
"""

import argparse
import importlib.util

import pytest

from megatron.training import cpu_loop


def _args(**flags):
    """Upstream's defaults for the flags missing_dependencies reads, with ``flags`` given."""
    values = dict(save=None, ckpt_format="torch_dist", wandb_project=None)
    return argparse.Namespace(**{**values, **flags})


@pytest.fixture
def absent(monkeypatch):
    """The set of packages find_spec reports absent; psutil and wandb are otherwise found."""
    gone = set()
    real = importlib.util.find_spec

    def find_spec(name, *rest):
        if name in gone:
            return None
        return object() if name in ("psutil", "wandb") else real(name, *rest)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    return gone


def test_wandb_is_needed_only_for_wandb_project(absent):
    absent.add("wandb")
    assert cpu_loop.missing_dependencies(_args()) == []
    assert cpu_loop.missing_dependencies(_args(wandb_project="")) == []  # upstream: falsy = off
    (missing,) = cpu_loop.missing_dependencies(_args(wandb_project="p"))
    assert missing[0] == "wandb" and "--wandb-project" in missing[1]
    assert "requirements/wandb.txt" in missing[1]


def test_an_installed_wandb_is_not_missing(absent):
    absent.add("psutil")  # only the one absent package is named
    assert cpu_loop.missing_dependencies(_args(wandb_project="p")) == []


def test_both_missing_are_named_in_order(absent):
    absent.update({"psutil", "wandb"})
    flags = _args(save="/ckpt", wandb_project="p")
    assert [name for name, _ in cpu_loop.missing_dependencies(flags)] == ["psutil", "wandb"]
    # psutil only for a torch_dist save
    torch_format = _args(save="/ckpt", ckpt_format="torch", wandb_project="p")
    assert [name for name, _ in cpu_loop.missing_dependencies(torch_format)] == ["wandb"]


def test_the_entry_reads_the_flags_before_upstreams_parse(monkeypatch, capsys):
    """gpt_entry checks before parse_and_validate_args (whose set_global_variables imports wandb
    on the last rank), on upstream's parser alone: silent, and None on a command line that
    upstream's own parse will then refuse (or answer: --help)."""
    from megatron.training import gpt_entry

    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--wandb-project", "p", "--save", "/c"])
    flags = gpt_entry._flags()
    assert (flags.wandb_project, flags.save, flags.ckpt_format) == ("p", "/c", "torch_dist")
    for bad in (["--lr", "abc"], ["--optimizer", "nope"], ["--help"], ["-h"]):
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", "--wandb-project", "p", *bad])
        assert gpt_entry._flags() is None, bad
    assert capsys.readouterr() == ("", "")
