"""Run Megatron-LM main's six Muon functional-test recipes, shrunk to CPU, with their
ckpt-resume check (issues 27/30).

    .venv/bin/python tools/upstream_muon_recipes.py CHECKOUT [--ref main] [--recipe NAME ...]
        [--impl emerging|megatron_muon ...] [--keep DIR]

CHECKOUT is a Megatron-LM work tree or git directory (e.g. ``git clone --bare
https://github.com/NVIDIA/Megatron-LM``); a git directory (or a work tree with ``--ref``) is read
at ``--ref`` (default ``main``). Each recipe's ``model_config.yaml``
(``tests/functional_tests/test_cases/moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_NAME``) is read
from there at run time: nothing of upstream's enters this repository.

A recipe's MODEL_ARGS become a command line as upstream's runner builds one (``true``: the flag
alone), then ``CHANGES`` below rewrites only what a CPU cannot run or what is too large; every
other flag, and every default, stays upstream's. Upstream's ckpt-resume test type
(``run_ci_test.sh``): one run of N iterations saving at N/2 and N, then the iteration-N
checkpoint removed, ``latest_checkpointed_iteration.txt`` set to N/2, and a second run resuming
from it into its own TensorBoard folder. Upstream compares both runs against golden values; here
the resumed run's TensorBoard scalars at iterations N/2+1..N (lm loss, the MoE auxiliary loss,
grad and params norms, zeros in the grads, learning rate...: every scalar but times and memory)
must equal the uninterrupted run's bit for bit (fp32 as TensorBoard stores them).

Each recipe runs with upstream's Muon (``--muon-impl emerging``, the default) and again with ours
(``--muon-impl megatron_muon``; with ours ``--no-use-layer-wise-param-layout`` is inert: it
selects the layout of upstream's LayerWise optimizer, so ``dist_muon`` and
``dist_muon_param_layout`` are one configuration). Prints per recipe and Muon: pass/fail, the
flags changed, and for a failure the first differing iteration and scalar, or the error. Exit
status 1 when any failed.
"""

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = "tests/functional_tests/test_cases/"
PREFIX = f"{CASES}moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_"
RECIPES = (
    "muon",
    "muon_1node",
    "dist_muon",
    "dist_muon_1node",
    "dist_muon_param_layout",
    "dist_muon_param_layout_1node",
)
IMPLS = ("emerging", "megatron_muon")
ITERS = 8  # upstream: 100, saving every 50: ckpt-resume resumes at N/2
# Upstream's EP 8 (two 8-GPU nodes: expert-DP 2) and EP 4 (_1node, one node: expert-DP 2) shrink
# to EP 2 on 4 ranks (expert-DP 2, dense DP 4) and on 2 ranks (expert-DP 1, dense DP 2).
RANKS = {False: 4, True: 2}  # keyed by "_1node"
RUNNER = "<per run>"  # filled in by the runner (upstream's runner sets these too)

# Changes any recipe needs on CPU ranks, whatever its sizes (tools/upstream_recipes_sample.py
# shares them): flag -> (new value, why). None: dropped; True: the flag alone; a string: this
# value; RUNNER values are filled in per run.
CPU_CHANGES = {
    "--data-path": (None, "no corpus on this machine: --mock-data instead"),
    "--vocab-file": (None, "--mock-data with NullTokenizer: no BPE files"),
    "--merge-file": (None, "--mock-data with NullTokenizer: no BPE files"),
    "--data-cache-path": (RUNNER, "a temporary folder"),
    "--tensorboard-dir": (RUNNER, "a temporary folder per run"),
    "--distributed-backend": ("gloo", "CPU ranks: NCCL needs GPUs"),
    "--transformer-impl": ("local", "no Transformer Engine on CPU: megatron-core's torch layers"),
    "--log-memory-to-tensorboard": (
        None,
        "CUDA's allocator statistics: on a CPU torch.cuda.memory_stats() is empty and "
        "training_log's lookup raises KeyError",
    ),
    "--moe-grouped-gemm": (
        None,
        "CUDA only: validate_args asks the GPU's compute capability; the local spec builds "
        "SequentialMLP experts whatever the flag",
    ),
}
# Every change to a Muon recipe's MODEL_ARGS: CPU_CHANGES and these
CHANGES = {
    "--num-layers": ("2", "size: 12 layers of 512 are minutes per step on a CPU"),
    "--hidden-size": ("64", "size"),
    "--moe-ffn-hidden-size": ("128", "size (upstream: 2 x hidden)"),
    "--num-experts": ("4", "size: 2 experts per EP rank"),
    "--expert-model-parallel-size": ("2", "4 or 2 CPU ranks instead of 16 or 8 GPUs"),
    "--seq-length": ("64", "size"),
    "--max-position-embeddings": ("64", "size (= --seq-length, as upstream's)"),
    "--micro-batch-size": ("2", "size"),
    "--global-batch-size": ("16", "size: 2 (4 ranks) or 4 (2 ranks) micro-batches per step"),
    "--train-iters": (str(ITERS), "a few iterations"),
    "--save-interval": (str(ITERS // 2), "ckpt-resume saves at N/2 (upstream: 50 of 100)"),
    "--eval-iters": ("2", "size: the final validation and test of each run"),
    "--save": (RUNNER, "a temporary folder"),
    "--load": (RUNNER, "a temporary folder"),
    **CPU_CHANGES,
}
# Flags no recipe gives that any needs on CPU ranks, added: flag -> (value, why)
CPU_ADDED = {
    "--mock-data": (True, "upstream's synthetic dataset in place of the recipe's corpus"),
    "--tokenizer-type": ("NullTokenizer", "the recipe's GPT2 BPE files are absent (mock data)"),
    "--vocab-size": ("128", "NullTokenizer's vocabulary (size)"),
    "--no-persist-layer-norm": (
        True,
        "upstream's default persist_layer_norm is Apex's kernel: the local spec's torch LayerNorm "
        "refuses it",
    ),
    "--no-masked-softmax-fusion": (
        True,
        "upstream's default masked_softmax_fusion loads a CUDA extension "
        "(scaled_masked_softmax_cuda) under --bf16",
    ),
}
# Flags the Muon recipes do not give, added: CPU_ADDED and these
ADDED = {
    **CPU_ADDED,
    "--exit-interval": (str(ITERS), "upstream's runner sets it to --train-iters"),
    "--async-strategy": (
        "mcore",
        "--async-save's default backend (nvrx) needs nvidia-resiliency-ext, absent here: "
        "megatron-core's own async save",
    ),
}


def git_dir(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--absolute-git-dir"],
        capture_output=True,
        text=True,
    )
    if done.returncode:
        raise SystemExit(f"{checkout}: not a Megatron-LM checkout or git directory")
    return done.stdout.strip()


def recipe_path(name: str) -> str:
    """The model_config.yaml of a Muon recipe (``muon_1node``) or of any test case given as
    ``gpt/CASE`` or ``moe/CASE``."""
    case = f"{CASES}{name}" if "/" in name else f"{PREFIX}{name}"
    return f"{case}/model_config.yaml"


def read_recipe(checkout: Path, ref: str, name: str) -> tuple:
    """(recipe dict, commit of ``ref``) of one recipe's model_config.yaml (``recipe_path``)."""
    import yaml

    gd = git_dir(checkout)
    path = recipe_path(name)
    commit = subprocess.run(
        ["git", "--git-dir", gd, "rev-parse", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    text = subprocess.run(
        ["git", "--git-dir", gd, "show", f"{commit}:{path}"], capture_output=True, text=True
    )
    if text.returncode:
        raise SystemExit(f"{path} not at {ref}: {text.stderr.strip()}")
    return yaml.safe_load(text.stdout), commit


def upstream_argv(model_args: dict) -> list:
    """MODEL_ARGS as upstream's runner turns them into a command line (_run_training.sh:
    ``true`` gives the flag alone, an empty value nothing, anything else ``flag value``)."""
    argv = []
    for flag, value in model_args.items():
        if value is True or value == "true":
            argv.append(flag)
        elif value is False or value == "false":
            argv += [flag, "false"]  # as upstream's runner passes it (no recipe here has one)
        elif value is None or value == "":
            continue
        else:
            argv += [flag, str(value)]
    return argv


def shrink(model_args: dict, name: str, table: dict = None, added: dict = None) -> tuple:
    """(flags, changes) of a recipe on CPU by the tables ``table`` (default CHANGES) and
    ``added`` (default ADDED): ``flags`` {flag: value} in the recipe's order then ``added``'s
    (RUNNER where the run fills it in); ``changes`` [(flag, upstream's value, ours, why)]."""
    table = CHANGES if table is None else table
    added = ADDED if added is None else added
    flags, changes = {}, []
    for flag, value in model_args.items():
        if flag in table:
            new, why = table[flag]
            changes.append((flag, value, new, why))
            if new is not None:
                flags[flag] = new
        else:
            flags[flag] = value
    for flag, (value, why) in added.items():
        assert flag not in model_args, f"{name}: {flag} is the recipe's now: review its tables"
        changes.append((flag, None, value, why))
        flags[flag] = value
    return flags, changes


def command_line(flags: dict, paths: dict) -> list:
    """The argv of pretrain_gpt.py: RUNNER values from ``paths`` {flag: value}."""
    filled = {f: (paths[f] if v == RUNNER else v) for f, v in flags.items()}
    return upstream_argv(filled)


SCALARS_SKIPPED = re.compile(r"time|mem|throughput|world-size", re.I)


def scalars(tb_dir: Path) -> dict:
    """{tag: {iteration: value}} of every scalar one run wrote to TensorBoard (fp32 as stored),
    times and memory left out (they differ between runs by nature)."""
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    out = {}
    for tag in acc.Tags()["scalars"]:
        if SCALARS_SKIPPED.search(tag):
            continue
        out[tag] = {e.step: e.value for e in acc.Scalars(tag)}
    return out


def launch(work: Path, name: str, ranks: int, argv: list, env: dict, timeout: int) -> str:
    """pretrain_gpt.py under torchrun on ``ranks`` gloo CPU ranks; its console output
    (``work/NAME.log``). Raises RuntimeError with the error's lines when it fails.

    Every process of the launch carries a marker in its environment, and those left when
    torchrun ends are killed: after a failure, ranks (each in a session of its own) and their
    helpers (the checkpoint writer's queue manager ignores SIGTERM) can outlive torchrun."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}"]
    cmd += ["--standalone", str(ROOT / "pretrain_gpt.py"), *argv]
    log = work / f"{name}.log"
    marker = f"{work / name}:{os.getpid()}:{time.time()}"
    with open(log, "w") as f:
        proc = subprocess.Popen(
            cmd, cwd=work, env=dict(env, MUON_RECIPES_LAUNCH=marker), stdout=f, stderr=f
        )
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = f"timeout ({timeout} s)"
        finally:
            _kill_marked(marker)
            proc.wait()
    out = log.read_text()
    if rc != 0:
        raise RuntimeError(f"{name} run: rc {rc}\n{error_lines(out)}")
    return out


def _kill_marked(marker: str) -> None:
    """SIGKILL every process whose environment holds MUON_RECIPES_LAUNCH=marker (ours)."""
    needle = f"MUON_RECIPES_LAUNCH={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):
            pass  # gone, or not ours to read


def error_lines(out: str, keep: int = 10) -> str:
    """What a failed run says about why: the first traceback's last frames and its exception
    (else the output's last lines)."""
    lines = [re.sub(r"^\[rank\d+\]: ", "", line) for line in out.splitlines()]
    first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
    if first is None:
        return "\n".join(lines[-keep:])
    end = next(
        (i for i in range(first + 1, len(lines)) if lines[i] and not lines[i][0].isspace()),
        len(lines) - 1,
    )
    return "\n".join(lines[max(first + 1, end - keep) : end + 1])


def run_env(env_vars: dict) -> dict:
    """The ranks' environment: this one, one thread per rank, the recipe's ENV_VARS."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.update({k: str(v) for k, v in (env_vars or {}).items()})
    return env


def ckpt_resume(flags: dict, ranks: int, work: Path, env_vars: dict, timeout: int = 900) -> dict:
    """Upstream's ckpt-resume test on one shrunk recipe: returns {"ok": bool, "detail": str,
    "compared": n scalars compared, "seconds": wall time}."""
    start = time.time()
    iters = int(flags["--train-iters"])
    half = int(flags["--save-interval"])
    assert 2 * half == iters, "ckpt-resume saves at N/2"
    ckpt, load = work / "checkpoints", work / "checkpoints"
    ckpt.mkdir(parents=True)
    env = run_env(env_vars)
    paths = {
        "--save": str(ckpt),
        "--load": str(load),
        "--data-cache-path": str(work / "data_cache"),
    }
    result = {"ok": False, "detail": "", "compared": 0}
    try:
        paths["--tensorboard-dir"] = str(work / "tensorboard" / "run_1")
        launch(work, "run_1", ranks, command_line(flags, paths), env, timeout)
        final = ckpt / f"iter_{iters:07d}"
        if not (ckpt / f"iter_{half:07d}").is_dir() or not final.is_dir():
            raise RuntimeError(f"run_1 saved {sorted(p.name for p in ckpt.iterdir())}")
        shutil.rmtree(final)  # as upstream's runner: the resume starts from N/2
        (ckpt / "latest_checkpointed_iteration.txt").write_text(str(half))
        paths["--tensorboard-dir"] = str(work / "tensorboard" / "run_2")
        out2 = launch(work, "run_2", ranks, command_line(flags, paths), env, timeout)
        if f"from iteration {half}" not in out2 and f"at iteration {half}" not in out2:
            raise RuntimeError(f"run_2 did not report loading the iteration-{half} checkpoint")
        a = scalars(work / "tensorboard" / "run_1")
        b = scalars(work / "tensorboard" / "run_2")
        result.update(compare(a, b, half, iters))
    except RuntimeError as err:
        result["detail"] = str(err)
    result["seconds"] = time.time() - start
    return result


def compare(a: dict, b: dict, half: int, iters: int) -> dict:
    """The uninterrupted run's scalars ``a`` against the resumed run's ``b`` at iterations
    half+1..iters: {"ok", "detail", "compared"}."""
    steps = range(half + 1, iters + 1)
    if "lm loss" not in a or sorted(a["lm loss"]) != list(range(1, iters + 1)):
        return {"ok": False, "detail": f"run_1 logged lm loss at {sorted(a.get('lm loss', {}))}"}
    if sorted(b.get("lm loss", {})) != list(steps):
        return {"ok": False, "detail": f"run_2 logged lm loss at {sorted(b.get('lm loss', {}))}"}
    missing = sorted(set(a) - set(b))
    if missing:
        return {"ok": False, "detail": f"run_2 lacks the scalars {missing}"}
    compared = 0
    for step in steps:
        for tag in sorted(a):
            if step not in a[tag]:
                continue
            got = b[tag].get(step)
            if got is None:
                return {"ok": False, "detail": f"iteration {step}: run_2 lacks {tag!r}"}
            if got != a[tag][step]:
                return {
                    "ok": False,
                    "detail": f"first difference at iteration {step}: {tag!r} "
                    f"{got!r} resumed vs {a[tag][step]!r} uninterrupted",
                    "compared": compared,
                }
            compared += 1
    tags = sorted(t for t in a if any(s in a[t] for s in steps))
    return {
        "ok": True,
        "detail": f"{compared} values equal ({', '.join(tags)})",
        "compared": compared,
    }


def recipe_flags(checkout: Path, ref: str, name: str, impl: str) -> tuple:
    """(flags, changes, env vars, ranks, commit) of one recipe shrunk for ``impl``."""
    recipe, commit = read_recipe(checkout, ref, name)
    flags, changes = shrink(recipe["MODEL_ARGS"], name)
    if impl != "emerging":
        flags["--muon-impl"] = impl
        changes.append(("--muon-impl", None, impl, "ours (upstream's default: emerging)"))
    ranks = RANKS[name.endswith("_1node")]
    return flags, changes, recipe.get("ENV_VARS") or {}, ranks, commit


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--ref", default="main")
    parser.add_argument("--recipe", action="append", choices=RECIPES, dest="recipes")
    parser.add_argument("--impl", action="append", choices=IMPLS, dest="impls")
    parser.add_argument("--keep", type=Path, help="keep each run's logs and checkpoints here")
    parser.add_argument("--print-flags", action="store_true", help="print the command lines only")
    args = parser.parse_args(argv)
    recipes, impls = args.recipes or list(RECIPES), args.impls or list(IMPLS)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="muon_recipes_", dir=args.keep))
    rows, failed = [], 0
    shown_changes = False
    for name in recipes:
        for impl in impls:
            flags, changes, env_vars, ranks, commit = recipe_flags(
                args.checkout, args.ref, name, impl
            )
            if not shown_changes:
                print(f"{PREFIX}* at {args.ref} ({commit[:12]}); changes to MODEL_ARGS:")
                for flag, old, new, why in changes:
                    if flag == "--muon-impl":
                        continue
                    was = "(absent)" if old is None else old
                    now = "dropped" if new is None else new
                    print(f"  {flag}: {was} -> {now}  [{why}]")
                shown_changes = True
            if args.print_flags:
                paths = {f: f"<{f[2:]}>" for f, v in flags.items() if v == RUNNER}
                print(f"{name} {impl} ({ranks} ranks): {' '.join(command_line(flags, paths))}")
                continue
            work = base / f"{name}-{impl}"
            work.mkdir()
            res = ckpt_resume(flags, ranks, work, env_vars)
            failed += not res["ok"]
            verdict = "PASS" if res["ok"] else "FAIL"
            print(f"{name:30s} {impl:14s} {ranks} ranks {verdict} {res['seconds']:5.0f} s")
            print("    " + res["detail"].replace("\n", "\n    "), flush=True)
            rows.append((name, impl, verdict))
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    if rows:
        print(f"\n{len(rows) - failed}/{len(rows)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
