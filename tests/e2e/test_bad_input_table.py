"""Bad input as a new user gives it, as one table: each row is an input and the one-line message
it must produce (CLI, tools/preprocess_data.py, the optimizer API, gloo ranks, real launches).

Kinds:
- ``cli``: ``pretrain_gpt.main(argv)`` in this process; every such error comes before any
  process group (``initialize`` is replaced by a tripwire), so a row takes milliseconds.
- ``prep``: ``tools/preprocess_data.py``'s ``main`` in this process.
- ``api``: a call that must raise; the row names the exception and the message.
- ``ranks``: a function on forked gloo ranks (bounded timeout); every rank must return the
  error it raised (none may hang in a collective or exit without it).
- ``launch``: the real CLI in subprocesses (torchrun for several ranks), bounded by a timeout.

    .venv/bin/python -m pytest tests/e2e/test_bad_input_table.py -q
"""

import contextlib
import importlib.util
import io
import math
import os
import shutil
import struct
import sys

import pytest
import torch
from harness import run_distributed

from .cli import ROOT, TINY, run


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return sys.modules[name]


pretrain_gpt = _load("pretrain_gpt", "pretrain_gpt.py")
preprocess_data = _load("preprocess_data", "tools/preprocess_data.py")

MOCK = ["--mock-data", "--vocab-size", "64"]
BASE = [a for a in TINY if a not in MOCK] + ["--train-iters", "2"]  # no data source yet


# ------------------------------------------------------------------------ data files


def _write_dataset(prefix: str, docs=((1, 2, 3), (4, 5))) -> None:
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=numpy_uint16())
    for doc in docs:
        builder.add_document(list(doc), [len(doc)])
    builder.finalize(prefix + ".idx")


def numpy_uint16():
    import numpy

    return numpy.uint16


def _truncate(path: str, keep: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(keep)


def data(kind: str):
    """A setup(tmp) that writes the prefix ``{tmp}/d`` broken in one way."""

    def setup(tmp):
        prefix = os.path.join(tmp, "d")
        if kind == "empty":
            _write_dataset(prefix, docs=())
            return
        _write_dataset(prefix)
        if kind == "bad_header":
            with open(prefix + ".idx", "r+b") as f:
                f.write(b"NOTANIDX!")
        elif kind == "short_idx":
            _truncate(prefix + ".idx", 40)
        elif kind == "short_bin":
            _truncate(prefix + ".bin", 4)
        elif kind == "no_bin":
            os.remove(prefix + ".bin")
        elif kind == "bad_version":
            with open(prefix + ".idx", "r+b") as f:
                f.seek(9)
                f.write(struct.pack("<Q", 7))

    return setup


def tokenizer_file(kind: str):
    """A setup(tmp): a good dataset {tmp}/d and a tokenizer file {tmp}/tok of ``kind``."""

    def setup(tmp):
        from tests.tokenizer_files import write_tiktoken_ranks

        data("ok")(tmp)
        path = os.path.join(tmp, "tok")
        if kind == "ranks":
            write_tiktoken_ranks(path)
        else:
            with open(path, "wb") as f:
                f.write(b"not a sentencepiece model")

    return setup


def a_file_named(name: str):
    def setup(tmp):
        with open(os.path.join(tmp, name), "w") as f:
            f.write("x")

    return setup


# ------------------------------------------------------------------------ runners


def run_cli(tmp, extra, setup=None, monkeypatch=None):
    if setup:
        setup(tmp)
    argv = [a.replace("{tmp}", str(tmp)) for a in BASE + extra.split()]

    def tripwire(args):
        raise AssertionError("reached initialize(): the error was not found up front")

    monkeypatch.setattr(pretrain_gpt, "initialize", tripwire)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = pretrain_gpt.main(argv)
    return code, err.getvalue()


def run_prep(tmp, content, extra="", setup=None):
    """``content``: bytes of the --input file (None: no file is written)."""
    if setup:
        setup(tmp)
    path = os.path.join(tmp, "in.jsonl")
    if content is not None:
        with open(path, "wb") as f:
            f.write(content)
    argv = ["--input", path, "--output-prefix", os.path.join(tmp, "out", "c")]
    argv += ["--tokenizer-type", "ByteLevelTokenizer"] + extra.replace("{tmp}", str(tmp)).split()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = preprocess_data.main(argv)
        except SystemExit as exit:  # argparse
            code = exit.code
    if code != 0:
        out = os.path.join(tmp, "out")
        assert not os.path.isdir(out) or not os.listdir(out), "files left behind"
    return code, err.getvalue()


def run_api(tmp, fn):
    try:
        fn(tmp)
    except Exception as err:  # noqa: BLE001 - the row names the class it expects
        return None, f"{type(err).__name__}: {err}"
    return None, "no error raised"


def _catching(fn, *args):
    """Rank body: the message of the exception ``fn`` raised here (or a note that it did not)."""
    try:
        fn(*args)
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "no error raised"


def run_ranks(tmp, fn, world, tp=1):
    """Every rank must raise (and report) within the timeout: none left in a collective."""
    messages = run_distributed(_catching, world, tp=tp, args=(fn, str(tmp)), timeout=120)
    assert len(messages) == world
    for rank, message in enumerate(messages):
        assert messages[0].split(":")[0] == message.split(":")[0], (rank, messages)
    return None, "\n".join(messages)


# ------------------------------------------------------------------------ API bodies


def muon(**kw):
    from megatron.core.optimizer.muon import Muon

    return lambda tmp: Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kw)


def adamw_group(**kw):
    from megatron.core.optimizer.muon import Muon

    group = {"params": [torch.nn.Parameter(torch.zeros(4))], "use_muon": False, **kw}
    return lambda tmp: Muon([group])


def tp_muon(*shape):
    from megatron.core.optimizer.muon import TensorParallelMuon

    return lambda tmp: TensorParallelMuon([torch.nn.Parameter(torch.zeros(*shape))])


def parse_blend(text):
    from megatron.training.datasets import parse_data_path

    return lambda tmp: parse_data_path(text)


def check_prefix(kind):
    from megatron.training.data_check import check_indexed_prefix

    def body(tmp):
        data(kind)(tmp)
        check_indexed_prefix(os.path.join(tmp, "d"))

    return body


def writable_as_nobody(tmp):
    """A read-only --save folder for a non-root user: checked in a child that drops to uid
    65534 (as root, permissions would not apply)."""
    import tempfile

    from megatron.training.data_check import check_writable

    top = tempfile.mkdtemp(dir=tmp_root())  # reachable by uid 65534, unlike pytest's tmp_path
    os.chmod(top, 0o755)
    folder = os.path.join(top, "ro")
    os.makedirs(folder, mode=0o555)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            if os.getuid() == 0:
                os.setuid(65534)
            check_writable(os.path.join(folder, "save"), "--save")
            message = b"no error raised"
        except Exception as err:  # noqa: BLE001
            message = f"{type(err).__name__}: {err}".encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    shutil.rmtree(top)
    with os.fdopen(read, "rb") as f:
        raise RuntimeError(f.read().decode())


def tmp_root() -> str:
    import tempfile

    return tempfile.gettempdir()


# ------------------------------------------------------------------------ rank bodies


def _distopt(optimizer="muon"):
    from tiny_gpt import TinyGPT, build_model, build_optimizer

    spec = TinyGPT()
    model = build_model(spec, distopt=True, bucket_size=6000)
    opt = build_optimizer(spec, model, use_distributed_optimizer=True, optimizer=optimizer)
    return list(getattr(opt, "chained_optimizers", [opt]))[0]


def upstream_param_state(tmp):
    """DP rank 0 holds a parameter-state dict as plain upstream 0.16.1 writes it."""
    distopt = _distopt()
    state = None
    if distopt.data_parallel_group.rank() == 0:
        state = {"buckets_coalesced": True, "per_bucket_numel": [[1]], 0: {torch.float32: []}}
    distopt.load_parameter_state_from_dp_zero(state)


def malformed_param_state(tmp):
    from megatron.core.optimizer.muon_checkpoint import FORMAT

    distopt = _distopt()
    state = None
    if distopt.data_parallel_group.rank() == 0:  # a param without its "scalars": a KeyError
        state = {"format": FORMAT, "params": {"x": {"param": torch.zeros(1)}}, "shapes": {}}
    distopt.load_parameter_state_from_dp_zero(state)


def nan_grad_on_tp_rank_1(tmp):
    from megatron.core import parallel_state
    from megatron.core.optimizer.muon import TensorParallelMuon

    weight = torch.nn.Parameter(torch.ones(4, 8))
    weight.tensor_model_parallel, weight.partition_dim = True, 0
    optimizer = TensorParallelMuon([weight], mode="duplicated")
    weight.grad = torch.ones_like(weight)
    if parallel_state.get_tensor_model_parallel_rank() == 1:
        weight.grad[0, 0] = math.nan
    optimizer.step()


def nan_loss_on_rank_1(tmp):
    from megatron.training.failures import check_finite

    rank = torch.distributed.get_rank()
    outputs = [{"lm loss": torch.tensor([math.nan if rank == 1 else 1.0, 4.0])}]
    check_finite(outputs, [torch.zeros(3)], 7, torch.device("cpu"))


# ------------------------------------------------------------------------ launches


def launch_nan(tmp):
    """--lr 1e4 diverges: exit 1 naming the iteration; the last good checkpoint stays latest.
    With --rerun-mode disabled (the default's re-run: tests/e2e/test_rerun.py)."""
    save = os.path.join(tmp, "save")
    flags = ["--lr", "1e4", "--train-iters", 8, "--save", save, "--save-interval", 2]
    proc = run(TINY + flags + ["--rerun-mode", "disabled"])
    latest = open(os.path.join(save, "latest_checkpointed_iteration.txt")).read()
    nan_at = int(proc.stderr.split("at iteration ")[1].split(":")[0])
    assert int(latest) < nan_at and int(latest) % 2 == 0, (latest, nan_at)
    assert not any(n.startswith(f"iter_{nan_at:07d}") for n in os.listdir(save))
    return proc.returncode, proc.stderr


def launch_truncated_tp_rank_1(tmp):
    """Only TP rank 1's checkpoint file is truncated: rank 1 says why, rank 0 names rank 1."""
    save = os.path.join(tmp, "save")
    tp2 = TINY + ["--tensor-model-parallel-size", 2, "--ckpt-format", "torch"]
    saved = run(tp2 + ["--train-iters", 2, "--save", save], nproc=2, timeout=180)
    assert saved.returncode == 0, saved.stderr[-3000:]
    _truncate(os.path.join(save, "iter_0000002", "mp_rank_01", "model_optim_rng.pt"), 1000)
    # torchrun's own way of stopping the other rank is part of what users see: the real one
    resume = ["--train-iters", 4, "--load", save, "--use-checkpoint-opt_param-scheduler"]
    proc = run(tp2 + resume, nproc=2, timeout=120, torchrun=True)
    assert "rank 1: checkpoint error: checkpoint" in proc.stderr, proc.stderr[-3000:]
    assert "Connection closed by peer" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode, proc.stderr


# ------------------------------------------------------------------------ the table

D = "--data-path {tmp}/d"
MUON = "--optimizer muon --use-distributed-optimizer"

CASES = [  # (id, kind, input, exit code (None: an exception), expected message)
    # -- command line: values
    ("lr_zero", "cli", "--mock-data --lr 0", 2, "--lr must be > 0, got 0.0"),
    ("lr_inf", "cli", "--mock-data --lr inf", 2, "--lr must be a finite number, got inf"),
    ("lr_nan", "cli", "--mock-data --lr nan", 2, "--lr must be a finite number, got nan"),
    ("wd_nan", "cli", "--mock-data --weight-decay nan", 2, "--weight-decay must be a finite"),
    ("beta_inf", "cli", "--mock-data --adam-beta2 inf", 2, "--adam-beta2 must be a finite"),
    (
        "muon_rms_inf",
        "cli",
        f"--mock-data {MUON} --muon-matched-adamw-rms inf",
        2,
        "--muon-matched-adamw-rms must be a finite number, got inf",
    ),
    ("layers_zero", "cli", "--mock-data --num-layers 0", 2, "--num-layers must be >= 1, got 0"),
    # -- model flags megatron-core 0.16.1 never reads (a different model, silently)
    (
        "post_layernorm_residual",
        "cli",
        "--mock-data --apply-residual-connection-post-layernorm",
        2,
        "--apply-residual-connection-post-layernorm is not supported here",
    ),
    (
        "no_position_embedding_learned",
        "cli",
        "--mock-data --no-position-embedding",
        2,
        "--no-position-embedding is deprecated",
    ),
    (  # its figures are TensorBoard scalars: without a writer it would do nothing
        "moe_per_layer_logging",
        "cli",
        "--mock-data --num-experts 2 --moe-per-layer-logging",
        2,
        "--moe-per-layer-logging configures TensorBoard output: it needs --tensorboard-dir",
    ),
    # -- upstream's other checkpoint formats (were written as torch, logged as the one asked)
    ("ckpt_dcp", "cli", "--mock-data --ckpt-format torch_dcp", 2, "--ckpt-format torch_dcp is"),
    ("ckpt_fsdp", "cli", "--mock-data --ckpt-format fsdp_dtensor", 2, "--ckpt-format fsdp_dtensor"),
    # -- --split (megatron-core divided by a zero sum, or asserted, after start-up)
    ("split_zero", "cli", "--mock-data --split 0,0,0", 2, "--split '0,0,0' must be"),
    ("split_words", "cli", "--mock-data --split abc", 2, "--split 'abc' must be"),
    ("split_four", "cli", "--mock-data --split 98,2,0,5", 2, "--split '98,2,0,5' must be"),
    (
        "split_with_per_split_paths",
        "cli",
        "--train-data-path {tmp}/d --valid-data-path {tmp}/d --split 98,2,0",
        2,
        "--split divides --data-path's documents",
    ),
    # -- the seed and the lr schedule's lengths (megatron-core asserts on them after start-up)
    ("seed_zero", "cli", "--mock-data --seed 0", 2, "--seed must be >= 1, got 0"),
    ("seed_too_large", "cli", "--mock-data --seed 4294967296", 2, "--seed must be <= 4294967295"),
    ("decay_zero", "cli", "--mock-data --lr-decay-iters 0", 2, "--lr-decay-iters must be >= 1"),
    (
        "warmup_negative",
        "cli",
        "--mock-data --lr-warmup-iters -1",
        2,
        "--lr-warmup-iters must be >= 0",
    ),
    (
        "warmup_past_decay",
        "cli",
        "--mock-data --lr-warmup-iters 2",
        2,
        "--lr-warmup-iters gives a warm-up of 2 iterations, not shorter than the lr decay "
        "(--train-iters: 2 iterations)",
    ),
    (
        "warmup_fraction_whole_decay",
        "cli",
        "--mock-data --lr-warmup-fraction 1",
        2,
        "--lr-warmup-fraction gives a warm-up of 2 iterations, not shorter than the lr decay",
    ),
    (
        "muon_flag_with_adam",
        "cli",
        "--mock-data --muon-momentum 0.9",
        2,
        "--muon-momentum configure Muon, but --optimizer is 'adam'",
    ),
    (
        "exchange_dtype_without_distopt",
        "cli",
        "--mock-data --optimizer muon --muon-exchange-dtype bf16",
        2,
        "--muon-exchange-dtype configure the DistributedOptimizer's Muon exchange and plan: add "
        "--use-distributed-optimizer",
    ),
    (
        "cpu_offload_is_not_optimizer",
        "cli",
        "--mock-data --optimizer-cpu-offload",
        2,
        "--optimizer-cpu-offload is not supported here: CPU offloading (activations, parameters",
    ),
    ("typo", "cli", "--mock-data --hidden-sise 8", 2, "did you mean --hidden-size"),
    # -- command line: data
    ("no_data", "cli", "", 2, "no data: give --data-path PREFIX [PREFIX ...] (or --train-data"),
    ("mock_and_data", "cli", f"--mock-data {D}", 2, "--mock-data and --data-path (or"),
    ("blend_odd", "cli", "--data-path 0.5 {tmp}/d 0.5", 1, "weights and prefixes must alternate"),
    ("blend_negative", "cli", "--data-path -1 {tmp}/d", 1, "every weight must be finite and > 0"),
    ("blend_nan", "cli", "--data-path nan {tmp}/d", 1, "every weight must be finite and > 0"),
    ("blend_inf", "cli", "--data-path inf {tmp}/d", 1, "every weight must be finite and > 0"),
    ("prefix_missing", "cli", D, 1, "/d.idx does not exist (write .bin/.idx with tools/"),
    ("bin_missing", "cli", (D, data("no_bin")), 1, "/d.bin does not exist"),
    ("idx_bad_header", "cli", (D, data("bad_header")), 1, "not a Megatron index file"),
    ("idx_bad_version", "cli", (D, data("bad_version")), 1, "unsupported index version 7"),
    ("idx_truncated", "cli", (D, data("short_idx")), 1, "/d.idx: truncated (40 bytes"),
    ("bin_truncated", "cli", (D, data("short_bin")), 1, "/d.bin: truncated (4 bytes"),
    ("dataset_empty", "cli", (D, data("empty")), 1, "the dataset is empty (no documents"),
    ("blend_second_missing", "cli", (f"{D} {{tmp}}/e", data("ok")), 1, "/e.idx does not exist"),
    # -- command line: tokenizer files (read before any process group)
    (
        "tiktoken_too_few_ranks",
        "cli",
        (
            f"{D} --tokenizer-type TikTokenizer --tokenizer-model {{tmp}}/tok "
            "--tiktoken-pattern v2",
            tokenizer_file("ranks"),
        ),
        1,
        "has 266 ranks, but --vocab-size (131072) - --tiktoken-num-special-tokens (1000) = 130072",
    ),
    (
        "sentencepiece_not_a_model",
        "cli",
        (
            f"{D} --tokenizer-type Llama2Tokenizer --tokenizer-model {{tmp}}/tok",
            tokenizer_file("junk"),
        ),
        1,
        "is not a sentencepiece model",
    ),
    # -- command line: output
    (
        "save_under_a_file",
        "cli",
        ("--mock-data --save {tmp}/f/save", a_file_named("f")),
        1,
        "/f is a file, not a directory",
    ),
    # -- tools/preprocess_data.py
    ("prep_empty", "prep", b"", 1, "has no documents (empty or blank lines only)"),
    ("prep_blank_lines", "prep", b"\n  \n\n", 1, "has no documents"),
    (
        "prep_bad_utf8",
        "prep",
        b'{"text": "ok"}\n{"text": "\xff\xfe"}\n',
        1,
        "line 2 is not valid UTF-8 (invalid start byte at byte 10 of the line)",
    ),
    ("prep_bad_json", "prep", b'{"text": "a"}\n{"text": \n', 1, "line 2 is not valid JSON"),
    ("prep_no_key", "prep", b'{"body": "a"}\n', 1, "line 1 has no key 'text'"),
    ("prep_not_string", "prep", b'{"text": 3}\n', 1, "'text' is int, expected a string"),
    ("prep_missing_input", "prep", None, 2, "in.jsonl' does not exist or is not a file"),
    (
        "prep_output_under_a_file",
        "prep",
        (b'{"text": "a"}\n', "--output-prefix {tmp}/f/c", a_file_named("f")),
        1,
        "--output-prefix",
    ),
    # -- optimizer API
    ("api_lr_inf", "api", muon(lr=math.inf), None, "lr must be a finite number >= 0, got inf"),
    ("api_lr_str", "api", muon(lr="0.1"), None, "lr must be a finite number >= 0, got '0.1'"),
    ("api_lr_none", "api", muon(lr=None), None, "lr must be a finite number >= 0, got None"),
    ("api_wd_negative", "api", muon(weight_decay=-1.0), None, "weight_decay must be a finite"),
    ("api_momentum_nan", "api", muon(momentum=math.nan), None, "momentum must be a finite"),
    (
        "api_rms_inf",
        "api",
        muon(matched_adamw_rms=math.inf),
        None,
        "matched_adamw_rms must be a finite number > 0 (or None), got inf",
    ),
    ("api_ns_steps_float", "api", muon(ns_steps=2.5), None, "ns_steps must be an int >= 1"),
    ("api_scale_str", "api", muon(extra_scale_factor="2"), None, "extra_scale_factor must be a"),
    ("api_betas_none", "api", adamw_group(betas=(0.9, None)), None, "betas must be in [0, 1)"),
    ("api_eps_inf", "api", adamw_group(eps=math.inf), None, "eps must be a finite number >= 0"),
    ("api_tp_muon_3d", "api", tp_muon(2, 3, 4), None, "only takes 2-D parameters, got shape (2,"),
    ("api_tp_muon_1d", "api", tp_muon(5), None, "ValueError: Muon only takes 2-D parameters"),
    ("api_blend_str", "api", parse_blend("1 a b"), None, "weights and prefixes must alternate"),
    ("api_idx_header", "api", check_prefix("bad_header"), None, "DataError: "),
    ("api_save_read_only", "api", writable_as_nobody, None, "/ro/save cannot be created in"),
    # -- gloo ranks: one rank's error raised on every rank, nobody left in a collective
    (
        "ranks_upstream_param_state_file",
        "ranks",
        (upstream_param_state, 2),
        None,
        "was not written by a DistributedOptimizer whose optimizer declares its state",
    ),
    (
        "ranks_malformed_param_state_file",
        "ranks",
        (malformed_param_state, 2),
        None,
        "the parameter state file is malformed (KeyError",
    ),
    (
        "ranks_tp_muon_nan_on_tp_rank_1",
        "ranks",
        (nan_grad_on_tp_rank_1, 2, 2),
        None,
        "FloatingPointError: non-finite gradient",
    ),
    (
        "ranks_nan_loss_on_rank_1",
        "ranks",
        (nan_loss_on_rank_1, 2),
        None,
        "TrainingError: NaN or inf in the loss at iteration 7",
    ),
    # -- real launches
    ("launch_nan_loss", "launch", launch_nan, 1, "error: NaN or inf in the loss"),
    (
        "launch_tp_rank_1_truncated",
        "launch",
        launch_truncated_tp_rank_1,
        1,
        "pretrain_gpt.py: rank 0: stopping: rank 1 failed: checkpoint error:",
    ),
]


def _run(case, tmp, monkeypatch):
    _, kind, given, _, _ = case
    if kind == "cli":
        extra, setup = given if isinstance(given, tuple) else (given, None)
        return run_cli(tmp, extra, setup, monkeypatch)
    if kind == "prep":
        content, extra, setup = given if isinstance(given, tuple) else (given, "", None)
        return run_prep(tmp, content, extra, setup)
    if kind == "api":
        return run_api(tmp, given)
    if kind == "ranks":
        return run_ranks(tmp, *given)
    return given(tmp)


def test_the_table_is_large_and_covers_every_kind():
    assert len(CASES) >= 40
    assert {kind for _, kind, *_ in CASES} == {"cli", "prep", "api", "ranks", "launch"}
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_its_one_line_message(case, tmp_path, monkeypatch):
    code, text = _run(case, tmp_path, monkeypatch)
    expected_code, message = case[3], case[4]
    assert code == expected_code, text[-3000:]
    assert message in text, text[-3000:]
    if case[1] in ("cli", "prep"):
        lines = [line for line in text.splitlines() if message in line]
        assert len(lines) == 1 and "Traceback" not in text, text[-3000:]
    if case[1] == "ranks":  # every rank raised the same error
        assert all(message in line for line in text.splitlines()), text
