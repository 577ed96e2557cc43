"""Our Muon through upstream's command line (base megatron-core 0.19.2): patches
0030-training-args-megatron-muon and 0031-checkpoint-args-muon-impl, which call
megatron/training/muon_args.py from upstream's arguments.py and checkpointing.py.

Upstream's parse_args/validate_args run in one child process for every case (importing
upstream's megatron.training takes tens of seconds; this process's megatron.training is the
repository's own, which would shadow it), and each test reads its case's outcome: the args,
the OptimizerConfig upstream's get_megatron_optimizer_config builds from them, or the error.
"""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


pytestmark = [
    pytest.mark.timeout(900),  # the child's imports, once, count toward the first test
]

TINY = (
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-layers 2 --hidden-size 64"
    " --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2"
    " --lr 1e-3 --train-iters 10 --transformer-impl local"
).split()
MUON = ["--optimizer", "muon"]
OURS = MUON + ["--muon-impl", "megatron_muon"]
DISTOPT = ["--use-distributed-optimizer"]
KNOBS = {  # flag: (value given, the OptimizerConfig field and the value it must hold)
    "--muon-matched-adamw-rms": ("0.2", "muon_matched_adamw_rms", 0.2),
    "--muon-ns-form": ("auto", "muon_ns_form", "auto"),
    "--muon-distopt-exchange-dtype": ("bf16", "muon_distopt_exchange_dtype", "bf16"),
    "--muon-plan-tflops": ("123.5", "muon_plan_tflops", 123.5),
    "--muon-plan-dp-link-gbps": ("inf", "muon_plan_dp_link_gbps", math.inf),
    "--muon-plan-nvlink-gbps": ("900", "muon_plan_nvlink_gbps", 900.0),
    "--muon-plan-nvlink-domain": ("8", "muon_plan_nvlink_domain", 8),
    "--muon-plan-min-efficiency": ("0.5", "muon_plan_min_efficiency", 0.5),
}
ALL_KNOBS = [item for flag, (value, *_) in KNOBS.items() for item in (flag, value)]

# name: argv after the program name
CASES = {
    "adam": [],
    "emerging": MUON,
    "emerging-distopt": MUON + DISTOPT,
    "emerging-dist-muon": ["--optimizer", "dist_muon"],
    "emerging-given": MUON + ["--muon-impl", "emerging"],
    "ours": OURS,
    "ours-distopt": OURS + DISTOPT,
    "ours-distopt-knobs": OURS + DISTOPT + ALL_KNOBS,
    "ours-dist-muon": ["--optimizer", "dist_muon", "--muon-impl", "megatron_muon"],
    "ours-upstream-muon-flags": OURS
    + ["--muon-momentum", "0.8", "--muon-nesterov", "--muon-tp-mode", "duplicated"]
    + ["--muon-coefficient-type", "simple", "--muon-num-ns-steps", "6"],
    "bad-impl": MUON + ["--muon-impl", "mine"],
    "bad-ns-form": OURS + ["--muon-ns-form", "gram"],  # 'gram' is newton_schulz's, not a flag's
    "ns-form-without-impl": MUON + ["--muon-ns-form", "auto"],
    "ours-ns-form-without-distopt": OURS + ["--muon-ns-form", "auto"],
    "bad-exchange-dtype": OURS + DISTOPT + ["--muon-distopt-exchange-dtype", "fp16"],
    "bad-plan-tflops": OURS + DISTOPT + ["--muon-plan-tflops", "0"],
    "bad-plan-domain": OURS + DISTOPT + ["--muon-plan-nvlink-domain", "0"],
    "bad-plan-efficiency": OURS + DISTOPT + ["--muon-plan-min-efficiency", "1.5"],
    "bad-rms": OURS + ["--muon-matched-adamw-rms", "-1"],
    "nan-rms": OURS + ["--muon-matched-adamw-rms", "nan"],
    "bad-gbps": OURS + DISTOPT + ["--muon-plan-nvlink-gbps", "nan"],
    "rms-and-scale-mode": OURS
    + ["--muon-matched-adamw-rms", "0.2"]
    + ["--muon-scale-mode", "unit_rms_norm"],
    "ours-coefficient-unknown": OURS + ["--muon-coefficient-type", "nonsense"],
    "ours-scalar-lion": OURS + ["--muon-scalar-optimizer", "lion"],
    "ours-precision-aware": OURS + DISTOPT + ["--use-precision-aware-optimizer"],
    "knob-without-impl": MUON + ["--muon-matched-adamw-rms", "0.2"],
    "knob-at-default-without-impl": MUON + DISTOPT + ["--muon-distopt-exchange-dtype", "fp32"],
    "knobs-with-emerging-given": MUON + ["--muon-impl", "emerging", "--muon-plan-tflops", "9"],
    "ours-with-adam": ["--muon-impl", "megatron_muon"],
    "ours-distopt-knob-without-distopt": OURS + ["--muon-plan-tflops", "100"],
    "ours-megatron-fsdp": OURS + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
    "ours-torch-fsdp2": OURS
    + ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]
    + [
        "--no-gradient-accumulation-fusion",
        "--muon-distopt-exchange-dtype",
        "bf16",
    ],  # FSDP2 runs the same exchange
    "ours-torch-fsdp2-saves-torch-dist": OURS
    + ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]
    + ["--no-gradient-accumulation-fusion", "--save", "ck", "--save-interval", "2"],
    "ours-tp-owner": OURS + DISTOPT + ["--muon-tp-mode", "owner"],  # patch 0091
    "emerging-tp-owner": MUON + ["--muon-tp-mode", "owner"],
    "emerging-megatron-fsdp": MUON + ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"],
    "emerging-torch-fsdp2": MUON
    + ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"]
    + ["--no-gradient-accumulation-fusion"],
}
# checkpoint cases: (this run's case, the saved args: None is this run's own; else
# {attribute: value} over them, a None value deleting it), flags added to this run
CHECKPOINTS = {
    "emerging-loads-ours": ("emerging-distopt", {"muon_impl": "megatron_muon"}),
    "ours-loads-emerging": ("ours-distopt", {"muon_impl": "emerging"}),
    "ours-loads-upstreams": ("ours-distopt", {"muon_impl": None}),  # saved before our flags
    "ours-loads-ours": ("ours-distopt", {}),
    "emerging-loads-emerging": ("emerging-distopt", {}),
    "ours-loads-adam": ("ours-distopt", {"optimizer": "adam", "muon_impl": "emerging"}),
    "ours-no-load-optim-loads-emerging": ("ours-no-load-optim", {"muon_impl": "emerging"}),
    # our Muon across the DistributedOptimizer and ZeRO-3 (docs/fsdp.md, "Checkpoints")
    "ours-megatron-fsdp-loads-distopt": (
        "ours-megatron-fsdp",
        {"use_megatron_fsdp": False, "ckpt_format": "torch_dist"},
    ),
    "ours-torch-fsdp2-loads-distopt": (
        "ours-torch-fsdp2",
        {"use_torch_fsdp2": False, "use_distributed_optimizer": True, "ckpt_format": "torch_dist"},
    ),
    "ours-distopt-loads-megatron-fsdp": (
        "ours-distopt",
        {"use_megatron_fsdp": True, "ckpt_format": "fsdp_dtensor"},
    ),
    "ours-distopt-loads-torch-fsdp2": (
        "ours-distopt",
        {"use_torch_fsdp2": True, "use_distributed_optimizer": False, "ckpt_format": "torch_dcp"},
    ),
    "ours-megatron-fsdp-loads-torch-fsdp2": (
        "ours-megatron-fsdp",
        {"use_megatron_fsdp": False, "use_torch_fsdp2": True, "ckpt_format": "torch_dcp"},
    ),
    "ours-megatron-fsdp-loads-ours": ("ours-megatron-fsdp", {}),
    "ours-torch-fsdp2-loads-ours": ("ours-torch-fsdp2", {}),
}
CASES["ours-no-load-optim"] = OURS + DISTOPT + ["--no-load-optim"]

DRIVER = textwrap.dedent(
    """
    import argparse, contextlib, copy, dataclasses, inspect, io, json, math, sys, traceback
    from megatron.training import arguments, checkpointing, cpu_loop, global_vars, training

    cpu_loop.install()  # as pretrain_gpt.py: validate_args asks the GPU's architecture (FSDP)

    cases, checkpoints, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]

    def plain(value):
        if isinstance(value, (bool, int, str)) or value is None:
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else str(value)
        return repr(value)

    results, parsed = {}, {}
    for name, argv in cases.items():
        sys.argv = ["pretrain_gpt.py", *argv]
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                args = arguments.parse_args(extra_args_provider=None, ignore_unknown_args=False)
                arguments.validate_args(args, {})
                config, _ = training.get_megatron_optimizer_config(args)
        except SystemExit as exc:  # argparse: the message is on stderr
            results[name] = {"error": "SystemExit", "code": exc.code, "message": err.getvalue()}
            continue
        except Exception as exc:
            where = traceback.format_exc(limit=-1)  # an unnamed assertion: where it is
            results[name] = {"error": type(exc).__name__, "message": str(exc), "where": where}
            continue
        parsed[name] = args
        results[name] = {
            "args": {k: plain(v) for k, v in vars(args).items() if not k.startswith("__")},
            "config": {f.name: plain(getattr(config, f.name)) for f in dataclasses.fields(config)},
        }

    checkpointing.set_checkpoint_version(3.0)
    for name, (run, changes) in checkpoints.items():
        if run not in parsed:
            results[name] = {"error": "RunCaseFailed", "message": json.dumps(results[run])}
            continue
        args = parsed[run]
        saved = copy.copy(args)
        for key, value in changes.items():
            if value is None:
                delattr(saved, key)
            else:
                setattr(saved, key, value)
        global_vars.set_args(args)
        try:
            checkpointing.check_checkpoint_args(saved)
            results[name] = {"ok": True}
        except Exception as exc:
            results[name] = {"error": type(exc).__name__, "message": str(exc)}

    load = inspect.getsource(checkpointing.load_checkpoint)
    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    # --help's section of our group (upstream 0.19.2's whole --help raises: the help of
    # --moe-paged-stash-buffer-size-factor-cuda has a bare '%')
    group = next(g for g in parser._action_groups if g.title == "megatron-muon")
    formatter = parser._get_formatter()
    formatter.start_section(group.title)
    formatter.add_text(group.description)
    formatter.add_arguments(group._group_actions)
    formatter.end_section()
    from megatron.core.optimizer import OptimizerConfig

    results["_meta"] = {
        "defaults": {f.name: plain(f.default) for f in dataclasses.fields(OptimizerConfig)},
        "help": formatter.format_help(),
        "load_checkpoint_checks_early": "check_checkpoint_muon_impl(ckpt_args, args)" in load,
    }
    with open(out, "w") as f:
        json.dump(results, f)
    """
)


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_args")
    (tmp / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", WORLD_SIZE="1", RANK="0")
    cases = {name: TINY + argv for name, argv in CASES.items()}
    cmd = [sys.executable, "driver.py", json.dumps(cases), json.dumps(CHECKPOINTS), "out.json"]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


def _ok(outcome, name):
    result = outcome[name]
    assert "error" not in result, f"{name}: {result}"
    return result["args"], result["config"]


def _error(outcome, name, *words):
    result = outcome[name]
    assert "error" in result, f"{name} was accepted: {result.get('config')}"
    for word in words:
        assert word in result["message"], f"{name}: {word!r} not in {result['message']!r}"
    return result["message"]


def test_the_child_ran_upstreams_patched_arguments(outcome):
    assert outcome["_meta"]["load_checkpoint_checks_early"]


def test_emerging_is_the_default_and_upstreams_meaning_is_unchanged(outcome):
    for name in ("adam", "emerging", "emerging-given"):
        args, config = _ok(outcome, name)
        assert args["muon_impl"] == config["muon_impl"] == "emerging"
    for name in ("emerging-distopt", "emerging-dist-muon"):  # upstream's LayerWise rewrite
        args, config = _ok(outcome, name)
        assert (args["optimizer"], args["muon_impl"]) == ("muon", "emerging")
        assert args["use_layer_wise_distributed_optimizer"] is True
        assert args["use_distributed_optimizer"] is False
        assert config["use_layer_wise_distributed_optimizer"] is True
        assert config["use_distributed_optimizer"] is False
    _, config = _ok(outcome, "emerging")
    assert config["use_layer_wise_distributed_optimizer"] is False


def test_our_defaults_are_optimizer_configs(outcome):
    defaults = outcome["_meta"]["defaults"]  # upstream's OptimizerConfig, patch 0001's fields
    assert defaults["muon_impl"] == "emerging"
    for name in ("ours", "adam"):
        args, config = _ok(outcome, name)
        for _, field, _ in KNOBS.values():
            assert args[field] == config[field] == defaults[field], (name, field)
    assert "_megatron_muon_given" not in args  # parse-time bookkeeping, not saved


def test_ours_with_distopt_is_not_rewritten_to_layer_wise(outcome):
    for name in ("ours-distopt", "ours-distopt-knobs", "ours-dist-muon"):
        args, config = _ok(outcome, name)
        assert (config["optimizer"], config["muon_impl"]) == ("muon", "megatron_muon"), name
        assert config["use_distributed_optimizer"] is True, name
        assert config["use_layer_wise_distributed_optimizer"] is False, name
        assert args["use_layer_wise_distributed_optimizer"] is False, name
    _, config = _ok(outcome, "ours")
    assert config["use_distributed_optimizer"] is False
    _, config = _ok(outcome, "ours-ns-form-without-distopt")  # not a DistOpt-only knob
    assert config["muon_ns_form"] == "auto" and config["use_distributed_optimizer"] is False
    assert config["use_layer_wise_distributed_optimizer"] is False


def test_each_knob_reaches_optimizer_config(outcome):
    _, config = _ok(outcome, "ours-distopt-knobs")
    for flag, (_, field, expected) in KNOBS.items():
        got = config[field]
        assert (float(got) if expected == math.inf else got) == expected, flag
    _, config = _ok(outcome, "ours-upstream-muon-flags")  # upstream's flags reach ours too
    assert config["muon_momentum"] == 0.8 and config["muon_nesterov"] is True
    assert config["muon_tp_mode"] == "duplicated" and config["muon_num_ns_steps"] == 6
    assert config["muon_coefficient_type"] == "simple"


def test_bad_values_are_refused_naming_the_flag(outcome):
    message = _error(outcome, "bad-impl", "--muon-impl", "emerging", "megatron_muon")
    assert outcome["bad-impl"]["error"] == "SystemExit"
    assert "mine" in message
    _error(outcome, "bad-ns-form", "--muon-ns-form", "standard", "auto")
    _error(outcome, "bad-exchange-dtype", "--muon-distopt-exchange-dtype", "fp16", "fp32", "bf16")
    _error(outcome, "bad-plan-tflops", "--muon-plan-tflops", "(0, 1e+06]")
    _error(outcome, "bad-plan-domain", "--muon-plan-nvlink-domain", ">= 1")
    _error(outcome, "bad-plan-efficiency", "--muon-plan-min-efficiency", "(0, 1]")
    _error(outcome, "bad-rms", "--muon-matched-adamw-rms", "> 0")
    _error(outcome, "nan-rms", "--muon-matched-adamw-rms", "finite")
    _error(outcome, "bad-gbps", "--muon-plan-nvlink-gbps", "inf: a free link")
    _error(outcome, "rms-and-scale-mode", "--muon-matched-adamw-rms", "--muon-scale-mode")
    _error(outcome, "ours-coefficient-unknown", "--muon-coefficient-type", "nonsense", "quintic")
    _error(outcome, "ours-scalar-lion", "--muon-scalar-optimizer lion", "adam")
    _error(outcome, "ours-precision-aware", "--use-precision-aware-optimizer")


def test_tp_mode_owner_is_ours_only(outcome):
    """Patch 0091: upstream's --muon-tp-mode admits 'owner' (ours), refused with its Muon."""
    _, config = _ok(outcome, "ours-tp-owner")
    assert config["muon_tp_mode"] == "owner"
    _error(outcome, "emerging-tp-owner", "--muon-tp-mode owner", "--muon-impl megatron_muon")


def test_our_knobs_need_muon_impl_megatron_muon(outcome):
    for name, flag in (
        ("knob-without-impl", "--muon-matched-adamw-rms"),
        ("knob-at-default-without-impl", "--muon-distopt-exchange-dtype"),  # at its default
        ("knobs-with-emerging-given", "--muon-plan-tflops"),
        ("ns-form-without-impl", "--muon-ns-form"),
    ):
        _error(outcome, name, flag, "--muon-impl megatron_muon")
    _error(outcome, "ours-with-adam", "--muon-impl megatron_muon", "--optimizer muon", "'adam'")
    _error(
        outcome,
        "ours-distopt-knob-without-distopt",
        "--muon-plan-tflops",
        "--use-distributed-optimizer",
    )


def test_a_checkpoint_of_the_other_muon_is_refused_naming_the_flag(outcome):
    for name, saved, run in (
        ("emerging-loads-ours", "megatron_muon", "emerging"),
        ("ours-loads-emerging", "emerging", "megatron_muon"),
        ("ours-loads-upstreams", "emerging", "megatron_muon"),
    ):
        message = _error(outcome, name, f"checkpoint was saved with --muon-impl {saved}; ")
        assert f"this run uses {run}: " in message and "\n" not in message
        assert outcome[name]["error"] == "RuntimeError"
    for name in (
        "ours-loads-ours",
        "emerging-loads-emerging",
        "ours-loads-adam",
        "ours-no-load-optim-loads-emerging",  # the model only: either Muon trains it
    ):
        assert outcome[name] == {"ok": True}, name


def test_our_muon_across_distopt_and_zero3_is_refused_naming_the_flags(outcome):
    """A DistOpt checkpoint of our Muon under Megatron-FSDP or FSDP2, the reverse, or one
    ZeRO-3 wrapper's under the other: one line naming both wrappers' flags (each such load
    failed unnamed once it began: docs/fsdp.md)."""
    for name, saved, run in (
        ("ours-megatron-fsdp-loads-distopt", "--use-distributed-optimizer", "--use-megatron-fsdp"),
        ("ours-torch-fsdp2-loads-distopt", "--use-distributed-optimizer", "--use-torch-fsdp2"),
        ("ours-distopt-loads-megatron-fsdp", "--use-megatron-fsdp", "--use-distributed-optimizer"),
        ("ours-distopt-loads-torch-fsdp2", "--use-torch-fsdp2", "--use-distributed-optimizer"),
        ("ours-megatron-fsdp-loads-torch-fsdp2", "--use-torch-fsdp2", "--use-megatron-fsdp"),
    ):
        message = _error(outcome, name, f"checkpoint was saved with {saved} (--ckpt-format ")
        assert f"this run uses {run} (--ckpt-format " in message and "\n" not in message
        assert outcome[name]["error"] == "RuntimeError"
    for name in ("ours-megatron-fsdp-loads-ours", "ours-torch-fsdp2-loads-ours"):
        assert outcome[name] == {"ok": True}, name


def test_help_shows_our_flags_with_their_defaults(outcome):
    text = " ".join(outcome["_meta"]["help"].split())
    assert "megatron-muon:" in text
    assert "--muon-impl {emerging,megatron_muon}" in text and "Default: emerging." in text
    for flag in KNOBS:
        assert flag in text, flag
    assert "Default: fp32." in text and "Default: None." in text


@pytest.mark.e2e
def test_a_real_torch_dist_checkpoint_of_ours_is_refused_by_emerging(tmp_path):
    """pretrain_gpt.py on upstream's loop, one gloo/GPU rank: our Muon (DistOpt) saves after 2
    steps; upstream's Muon resuming it stops in load_checkpoint, before the optimizer loads."""
    import torch

    gpu = torch.cuda.is_available()
    flags = TINY + ["--global-batch-size", "8", "--log-interval", "1", "--eval-interval", "1000"]
    flags += ["--eval-iters", "1", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion"]
    flags += ["--distributed-backend", "nccl" if gpu else "gloo", "--lr-decay-iters", "4"]
    flags += ["--save", "ck", "--load", "ck", "--save-interval", "2", "--optimizer", "muon"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone"]
    cmd += [str(ROOT / "pretrain_gpt.py"), *flags]
    # torch.compile off, as every e2e launch but the recipes' (upstream_runs.launch_env says why
    # and where the compiled path stays tested): each launch's _warmup_jit_function builds the
    # fused kernels with inductor first (a cold compile; with inductor's on-disk cache warm the
    # two measured within noise)
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")

    def launch(*more):
        done = subprocess.run(
            cmd + list(more), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=480
        )
        return done.returncode, done.stdout + done.stderr

    rc, out = launch("--muon-impl", "megatron_muon", *DISTOPT, "--train-iters", "2")
    assert rc == 0 and (tmp_path / "ck/latest_checkpointed_iteration.txt").exists(), out[-3000:]
    rc, out = launch()  # upstream's Muon, replicated
    assert rc != 0
    assert (
        "RuntimeError: checkpoint was saved with --muon-impl megatron_muon; this run uses "
        "emerging: " in out
    ), out[-3000:]


def test_ours_runs_under_fsdp_and_upstreams_muon_keeps_its_refusal(outcome):
    """Patch 0090 and muon_args.py: our Muon under --use-megatron-fsdp (which forces the
    DistributedOptimizer) and --use-torch-fsdp2 (its exchange knobs admitted); upstream's Muon
    refused there with upstream's own messages."""
    args, config = _ok(outcome, "ours-megatron-fsdp")
    assert args["use_megatron_fsdp"] and config["use_distributed_optimizer"]
    assert config["muon_impl"] == "megatron_muon"
    args, config = _ok(outcome, "ours-torch-fsdp2")
    assert args["use_torch_fsdp2"] and config["muon_distopt_exchange_dtype"] == "bf16"
    _error(outcome, "emerging-megatron-fsdp", "Megatron-FSDP does not support the muon optimizer")
    _error(outcome, "ours-torch-fsdp2-saves-torch-dist", "--ckpt-format torch_dcp", "--save")
    _error(outcome, "emerging-torch-fsdp2", "Emerging optimizer does not support Torch-FSDP2")
