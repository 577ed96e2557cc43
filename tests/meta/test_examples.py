"""Each example script builds its launch command in dry-run mode; the pretrain_gpt.py flags in it
parse with upstream's parser (base megatron-core 0.19.2: Megatron-LM's ``parse_args`` and
``validate_args``, our Muon's flags added by patch 0030) at the world size the launcher would
start, and run our Muon (``--muon-impl megatron_muon``) with the seed's recipe. The CPU quick
start's and pretrain_gpt.py's docstring launch also fit the built-in corpus: upstream's tokenizer
of their flags has the corpus's eod and ids, and megatron-core's GPT datasets of every split they
read hold documents.

Upstream's parser runs in one child process for every case (importing upstream's
megatron.training takes tens of seconds), and each test reads its case's outcome
(``run_parse_child``; tests/meta/test_docs.py runs the documentation's commands through it too,
our bench and tools scripts' with their own argparse: a case with ``tool``).

Negative controls (checked by hand): ``--muon-use-nesterov`` (0.16.1's spelling) in an example
fails its parse (unknown flag); dropping ``--muon-nesterov`` from cpu_quickstart.sh fails
test_make_demo_runs_the_seed_recipe; ``--vocab-size 256`` fails the corpus check (eod 255).
"""

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest

from megatron.training import corpus
from megatron.training.muon_recipe import SEED_RECIPE, SEED_RECIPE_FLAGS

pytestmark = [pytest.mark.timeout(900)]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# script, environment, expected launcher words, world size
EXAMPLES = [
    ("examples/cpu_quickstart.sh", {}, ["--standalone", "--use-distributed-optimizer"], 4),
    ("examples/cpu_quickstart.sh", {"DISTOPT": "0"}, ["--nproc-per-node", "4"], 4),
    ("examples/train_single_node.sh", {"GPUS": "8"}, ["--nproc-per-node", "8", "--standalone"], 8),
    (
        "examples/slurm_multinode.sbatch",
        {"SLURM_NNODES": "2", "SLURM_JOB_ID": "42", "DATA_PATH": "/data/x"},
        ["srun", "--nnodes", "--rdzv-backend", "c10d", "--rdzv-id", "42"],
        16,
    ),
]
TINY = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16"
    " --max-position-embeddings 16 --micro-batch-size 1 --train-iters 1 --lr 1e-3 --mock-data"
    " --tokenizer-type NullTokenizer --vocab-size 128 --transformer-impl local"
).split()
PLACEHOLDER = "<stdlib corpus prefix>"  # the scripts' --data-path in dry-run mode
ARGS = (  # the args attributes each case reports
    "optimizer muon_impl tokenizer_type vocab_size world_size data_parallel_size num_workers"
    " use_distributed_optimizer transformer_impl distributed_backend"
).split()

DRIVER = textwrap.dedent(
    """
    import argparse, contextlib, dataclasses, io, json, os, runpy, sys, traceback
    from megatron.training import arguments, cpu_loop, global_vars, training

    cpu_loop.install()  # a CPU has no GPU architecture for validate_args to read with TP > 1
    cases, keys, out = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]

    def plain(value):
        return value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)

    def splits(args):
        \"\"\"Per split: (samples the loop asks for, documents megatron-core's GPT dataset holds
        or None when it built none), with the tokenizer upstream's setup builds.\"\"\"
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset
        from megatron.training import gpt_entry

        global_vars.set_args(args)
        tokenizer = global_vars.rebuild_tokenizer(args)
        samples = training.get_train_valid_test_num_samples()
        config = gpt_entry.dataset_config(args)
        built = BlendedMegatronDatasetBuilder(GPTDataset, samples, lambda: True, config).build()
        docs = [None if ds is None else len(ds.indices) for ds in built]
        return {"eod": tokenizer.eod, "vocab_size": tokenizer.vocab_size,
                "samples": list(samples), "documents": docs}

    class Parsed(BaseException):
        \"\"\"Raised where a tool's main parses its command line: nothing of it runs.\"\"\"

    def tool(case):
        \"\"\"A script of ours run as __main__ up to its argparse parse_args, which parses the
        case's argv with the parser the script built: its option strings, or the error.\"\"\"
        Parser, found = argparse.ArgumentParser, []
        parse, parse_known = Parser.parse_args, Parser.parse_known_args

        def grab(parser, args=None, namespace=None):
            found.append(parser)
            raise Parsed

        Parser.parse_args = Parser.parse_known_args = grab
        sys.argv = [case["tool"], *case["argv"]]
        try:
            runpy.run_path(case["tool"], run_name="__main__")
        except Parsed:
            pass
        finally:
            Parser.parse_args, Parser.parse_known_args = parse, parse_known
        if not found:
            return {"error": "no argparse", "message": case["tool"] + " parsed nothing"}
        if not case.get("options_only"):
            parse(found[0], case["argv"])
        return {"options": sorted(found[0]._option_string_actions)}

    results = {}
    for name, case in cases.items():
        if "tool" in case:
            err = io.StringIO()
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                    results[name] = tool(case)
            except SystemExit as exc:
                results[name] = {"error": f"SystemExit {exc.code}", "message": err.getvalue()}
            except Exception as exc:
                results[name] = {"error": type(exc).__name__, "message": traceback.format_exc()}
            continue
        os.environ.update(WORLD_SIZE=str(case["world_size"]), RANK="0", LOCAL_RANK="0")
        sys.argv = ["pretrain_gpt.py", *case["argv"]]
        err = io.StringIO()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                args = arguments.parse_args()
                arguments.validate_args(args, {})
                config, _ = training.get_megatron_optimizer_config(args)
                result = {
                    "args": {k: plain(getattr(args, k)) for k in keys},
                    "config": {f.name: plain(getattr(config, f.name))
                               for f in dataclasses.fields(config)},
                }
                if case.get("cache"):
                    args.data_cache_path = case["cache"]  # the indices, not the shared cache
                    result["corpus"] = splits(args)
            results[name] = result
        except SystemExit as exc:  # argparse: the message is on stderr
            results[name] = {"error": f"SystemExit {exc.code}", "message": err.getvalue()}
        except Exception as exc:
            results[name] = {"error": type(exc).__name__, "message": traceback.format_exc()}
    with open(out, "w") as f:
        json.dump(results, f)
    """
)


def dry_run(script: str, env: dict) -> list:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full_env.update(env, DRY_RUN="1")
    out = subprocess.run(
        ["bash", os.path.join(ROOT, script)],
        env=full_env,
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    return shlex.split(out)


def flags_of(words: list) -> list:
    return words[words.index("pretrain_gpt.py") + 1 :]


def _docstring_launch() -> tuple[int, list]:
    """(ranks, pretrain_gpt.py's flags) of the launch line in pretrain_gpt.py's docstring (one
    line there: its source continues it with backslashes), the placeholder in place of its
    ``$(... megatron.training.corpus)``."""
    doc = ast.get_docstring(ast.parse(open(os.path.join(ROOT, "pretrain_gpt.py")).read()))
    after = doc.split("Launch", 1)[1].splitlines()
    command = next(line for line in after if "--nproc-per-node" in line)
    command = re.sub(r"\$\(\S+ -m megatron\.training\.corpus\)", shlex.quote(PLACEHOLDER), command)
    words = shlex.split(command)
    ranks = int(words[words.index("--nproc-per-node") + 1])
    return ranks, flags_of(words)


def _cases(cache: str) -> dict:
    prefix = corpus.build_corpus()  # what the scripts build on first use (cached)
    cases = {}
    for i, (script, env, _, world_size) in enumerate(EXAMPLES):
        cases[f"example{i}"] = {"argv": flags_of(dry_run(script, env)), "world_size": world_size}
    cases["recipe"] = {"argv": TINY + ["--optimizer", "muon"] + SEED_RECIPE_FLAGS, "world_size": 1}
    demo = [prefix if w == PLACEHOLDER else w for w in flags_of(dry_run(EXAMPLES[0][0], {}))]
    cases["demo-corpus"] = {"argv": demo, "world_size": 4, "cache": cache}
    ranks, flags = _docstring_launch()
    flags = [prefix if w == PLACEHOLDER else w for w in flags]
    cases["docstring-corpus"] = {"argv": flags, "world_size": ranks, "cache": cache}
    return cases


def run_parse_child(tmp, cases: dict, keys=ARGS) -> dict:
    """{case name: outcome} of upstream's parse_args + validate_args (``argv``, ``world_size``,
    optional ``cache``) or of our script's argparse (``tool``: its path, ``argv``), all in one
    child process started in the folder ``tmp``."""
    (tmp / "driver.py").write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    cmd = [sys.executable, "driver.py", json.dumps(cases), json.dumps(keys), "out.json"]
    done = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=840)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((tmp / "out.json").read_text())


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("examples")
    return run_parse_child(tmp, _cases(str(tmp / "cache")))


def _ok(outcome, name) -> dict:
    result = outcome[name]
    assert "error" not in result, f"{name}: {result['error']}\n{result['message'][-3000:]}"
    return result


def _recipe(config: dict) -> dict:
    return {name: config[name] for name in SEED_RECIPE}


@pytest.mark.parametrize("case", range(len(EXAMPLES)))
def test_example_command_parses(outcome, case):
    script, env, launcher, world_size = EXAMPLES[case]
    words = dry_run(script, env)
    entry = words.index("pretrain_gpt.py")
    for word in launcher:
        assert word in words
    args = _ok(outcome, f"example{case}")["args"]
    assert (args["optimizer"], args["muon_impl"]) == ("muon", "megatron_muon")
    assert args["world_size"] == world_size
    assert "--num-workers" not in words[entry:]  # upstream's default (2 workers) kept
    # GPU scripts stay generic: nothing forces CPU ranks
    if "cpu_quickstart" not in script:
        assert args["distributed_backend"] == "nccl" and "--bf16" in words


def test_header_states_the_command():
    for script, *_ in EXAMPLES:
        header = open(os.path.join(ROOT, script)).read().split("set -euo")[0]
        assert "DRY_RUN=1 bash " + script in header


def test_recipe_flags_set_the_recipe_fields(outcome):
    assert _recipe(_ok(outcome, "recipe")["config"]) == SEED_RECIPE


@pytest.mark.parametrize("case", range(len(EXAMPLES)))
def test_examples_run_the_seed_recipe(outcome, case):
    """Every example (``make demo`` first) runs our Muon with the seed's recipe."""
    assert _recipe(_ok(outcome, f"example{case}")["config"]) == SEED_RECIPE


def test_make_demo_runs_the_seed_recipe(outcome):
    args = _ok(outcome, "example0")["args"]
    assert args["use_distributed_optimizer"] and args["data_parallel_size"] == 2
    assert args["num_workers"] == 2
    assert _recipe(_ok(outcome, "example0")["config"]) == SEED_RECIPE


@pytest.mark.parametrize("name", ["demo-corpus", "docstring-corpus"])
def test_launch_fits_the_builtin_corpus(outcome, name):
    """The tokenizer of the flags reads the corpus's ids as they are (bytes 0..255, eod 256 =
    ``corpus.BYTE_EOD``), and the training and validation splits hold documents of the built-in
    corpus, as many as ``corpus.split_ranges`` cuts: upstream's loop runs without evaluating when
    the validation split is empty (``do_valid`` False), silently. The test split may be empty
    (--split 98,2,0): upstream then skips its test evaluation."""
    found = _ok(outcome, name)["corpus"]
    assert found["eod"] == corpus.BYTE_EOD and found["vocab_size"] == corpus.BYTE_EOD + 1, found
    train, valid, _ = found["documents"]
    assert train and valid and all(found["samples"][:2]), found
    n_docs = sum(1 for _ in corpus.stdlib_documents())
    cuts = [end - begin for begin, end in corpus.split_ranges("98,2,0", n_docs)]
    assert [d or 0 for d in found["documents"]] == cuts, found
