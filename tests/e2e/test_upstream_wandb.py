"""Weights & Biases through upstream's own training loop (base megatron-core 0.19.2), offline:
pretrain_gpt.py with upstream's ``--wandb-project/--wandb-exp-name/--wandb-save-dir`` on 2 gloo
CPU ranks and our Muon in upstream's DistributedOptimizer, then the run W&B wrote, read back.

What upstream does (global_vars._set_wandb_writer, training.training_log): the last rank
(``world_size - 1``) alone imports wandb and calls ``wandb.init(dir=--wandb-save-dir,
config=vars(args))``; training_log logs each iteration's ``lm loss`` (this iteration's, not the
console's interval mean) and the learning rate, but only inside its TensorBoard block: without
``--tensorboard-dir`` a W&B run gets the config and no metrics at all (upstream's design; checked
by hand: the run's history then holds no ``lm loss``). So the test gives both.

Offline (``WANDB_MODE=offline``), wandb 0.31.0 writes ``wandb/offline-run-*/run-*.wandb`` (its
files/ then holds requirements.txt only, no summary or config file): a LevelDB-style log of
protobuf records that this version ships no Python reader for. ``_records`` reads it, each chunk's
CRC checked, into wandb's own ``wandb_internal_pb2.Record``.

Nothing is sent: ``WANDB_MODE=offline``, no system-metrics sampler (``WANDB_X_DISABLE_STATS``),
no console capture, and wandb's config, cache and data folders under the test's tmp_path.

Negative controls (checked by hand): without ``WANDB_MODE=offline`` (no API key, W&B's address
pointed at a closed local port) the last rank's wandb.init raises "UsageError: No API key
configured. Use `wandb login` to log in." and the launch fails with rc 1; with the
``wandb_writer.log({key: loss_dict[key]}, iteration)`` of training_log removed, the history holds
no ``lm loss`` and the step comparison fails (``{}`` against the console's four).

    .venv/bin/python -m pytest -q tests/e2e/test_upstream_wandb.py
"""

import json
import os
import struct
import subprocess
import zlib

import pytest
from upstream_runs import RANKS, command, launch, step_losses

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(300),
]

OURS = "--optimizer muon --muon-impl megatron_muon --use-distributed-optimizer".split()
ITERS = 4
# Offline, no system-metrics sampler, no console capture (the config, cache and data folders go
# under tmp_path in the test): nothing is sent and nothing outside tmp_path is written.
OFFLINE = {"WANDB_MODE": "offline", "WANDB_X_DISABLE_STATS": "true", "WANDB_CONSOLE": "off"}

_BLOCK, _HEADER = 32768, 7  # the log's block size and each chunk's header (crc32, length, type)
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def _records(path):
    """The protobuf records of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<HB", data[4:7]) == (0xBEE1, 0), data[:7]
    pos, record = _HEADER, b""
    while pos < len(data):
        left = _BLOCK - pos % _BLOCK
        crc, length, kind = struct.unpack("<IHB", data[pos : pos + _HEADER])
        if left < _HEADER or kind == 0:  # a block's zero padding
            pos += left
            continue
        chunk = data[pos + _HEADER : pos + _HEADER + length]
        assert crc == zlib.crc32(chunk, zlib.crc32(bytes([kind]))), f"bad chunk at {pos}"
        assert kind in (_FULL, _FIRST, _MIDDLE, _LAST), kind
        pos += _HEADER + length
        record += chunk
        if kind in (_FULL, _LAST):
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            record = b""
            yield parsed


def _run(folder) -> tuple:
    """(config, {step: {key: value}}, run name, project) of the one offline run in ``folder``."""
    (path,) = folder.glob("wandb/offline-run-*/run-*.wandb")
    config, history, run = {}, {}, None
    for record in _records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({i.key: json.loads(i.value_json) for i in run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            items = record.history.item  # a key is ``key`` or, for some, ``nested_key``
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
            history.setdefault(record.history.step.num, {}).update(items)
    assert run is not None, "no run record"
    return config, history, run.display_name, run.project


def test_wandb_offline_logs_the_console_losses(tmp_path, monkeypatch):
    """The run's history has one ``lm loss`` per iteration, each this iteration's loss as the
    console prints it (7 significant digits: iteration 2's console line is the mean of 1 and 2,
    undone by step_losses, so its digits carry twice the rounding), and its config is the run's
    arguments: our Muon's ``muon_impl``, the optimizer, the world size."""
    for key, value in OFFLINE.items():
        monkeypatch.setenv(key, value)
    for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(key, str(tmp_path / key.lower()))
    saved = tmp_path / "wandb_runs"
    flags = [*OURS, "--tensorboard-dir", str(tmp_path / "tb")]
    flags += ["--wandb-project", "muon-e2e", "--wandb-exp-name", "ours-distopt"]
    out = launch(tmp_path, "wandb", ITERS, *flags, "--wandb-save-dir", str(saved))

    config, history, name, project = _run(saved)
    assert (name, project) == ("ours-distopt", "muon-e2e")
    assert config["muon_impl"] == "megatron_muon" and config["optimizer"] == "muon"
    assert config["use_distributed_optimizer"] is True and config["world_size"] == RANKS
    assert config["slurm_job_name"] == "N/A"  # the loop's config.update after setup
    losses = {step: items["lm loss"] for step, items in history.items() if "lm loss" in items}
    console = step_losses(out)
    assert sorted(losses) == sorted(console) == list(range(1, ITERS + 1)), (losses, console)
    # printed as %E with 6 decimals (~4.8: rounding 5e-7); iteration 2 is 2*mean - first (1.5e-6)
    assert losses == pytest.approx(console, abs=2e-6, rel=0)
    assert all("learning-rate" in history[i] for i in losses)


def test_without_wandb_the_run_names_the_package(tmp_path):
    """With wandb not importable (``sys.modules['wandb'] = None``, through a sitecustomize), the
    run stops before any process group with one line on the console and exit status 2. One rank:
    it is also upstream's last rank, the one that imports wandb (with 2, torchrun's teardown after
    rank 0's exit races the last rank's import). Negative control (checked by hand): with the check
    after parse_and_validate_args (where it was), that rank dies in upstream's
    set_global_variables, "ModuleNotFoundError: import of wandb halted", exit status 1."""
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    cmd, env = command(tmp_path, "no_wandb", 2, *OURS, "--wandb-project", "p")
    cmd = ["--nproc-per-node=1" if c.startswith("--nproc-per-node") else c for c in cmd]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hide), env.get("PYTHONPATH")]))
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    out = done.stdout + done.stderr
    (tmp_path / "no_wandb.log").write_text(out)
    line = "pretrain_gpt.py: error: needs the package wandb: --wandb-project logs to Weights"
    assert done.returncode != 0 and out.count(line) == 1, out[-4000:]
    assert "wandb halted" not in out and "ModuleNotFoundError" not in out, out[-4000:]
    assert (tmp_path / "no_wandb.hits" / "exit.0").read_text() == "2"
