"""Every flag the documentation names exists, and every command it shows parses.

The documentation: README.md, docs/*.md and bench/README.md (which README links). Read are its
code spans and code blocks:

- every ``--flag`` named must be a flag of the installed parser (upstream's
  ``add_megatron_arguments`` with our patches' flags: ``cli_config.known_flags``; a
  ``--prefix-*`` must match one), a retired name the text names as retired (``RETIRED``: gone from
  the parser, its replacement there), or a flag of the tool the text is about (``TOOL_FLAGS``:
  each with its tool; ours are checked against the tool's own argparse);
- a launch of ``pretrain_gpt.py`` (directly or through torchrun) parses with upstream's
  ``parse_args`` + ``validate_args`` at its world size, and so does a run of Megatron flags with
  values (README's "add to a Megatron-LM command line"), on top of a tiny model with our Muon
  and the DistributedOptimizer (``FRAGMENT_BASE``);
- a command of our ``bench/*.py`` and ``tools/*.py`` scripts parses with the script's own
  argparse (placeholders such as ``TAU`` given a value of their kind: ``PLACEHOLDERS``); ``make``
  commands name targets and variables of the Makefile; ``bash``/``sbatch`` run scripts that exist
  and read the variables given; ``python -m`` names an importable module.

Upstream's parser and our scripts run in test_examples' one child process (importing upstream's
megatron.training takes tens of seconds). Negative controls (``NEGATIVE``, same checks): a
made-up flag in a snippet, a bad value in a fragment, a made-up flag in a torchrun launch and in a
bench command, a made-up make target; and a good torchrun launch, so that path is exercised
although the documentation launches pretrain_gpt.py only through the examples (test_examples).
"""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest
from cli_config import known_flags
from test_examples import TINY, run_parse_child

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("docs/*.md"))]
DOCS.append("bench/README.md")

# The 0.16.1 fork's names that the migration notes name as renamed: -> upstream's name
MIGRATION = ROOT / "docs/migrating_from_0.16.1.md"
RETIRED = {
    "--muon-use-nesterov": "--muon-nesterov",
    "--muon-coefficient-set": "--muon-coefficient-type",
    "--muon-ns-steps": "--muon-num-ns-steps",
    "--muon-exchange-dtype": "--muon-distopt-exchange-dtype",
}
# Uses of 0.16.1 that the migration notes name as gone: they must not parse
RETIRED_USES = {"--tokenizer-type ByteLevelTokenizer"}
# Flags of other tools the documentation names, with the tool (ours: checked with its argparse)
TOOL_FLAGS = {
    "--standalone": "torchrun",
    "--nproc-per-node": "torchrun",
    "--nnodes": "torchrun",
    "--nodes": "sbatch",
    "--signal": "sbatch",
    "--no-deps": "pip",
    "--quick": "bench/run_all.py",
    "--jobs": "bench/convergence.py",
    "--corpora": "bench/convergence.py",
    "--out": "bench/convergence.py",
    "--reuse": "bench/convergence.py",
    "--note": "bench/convergence.py",
    "--qk-clip-lr": "bench/convergence.py",
    "--min-efficiency": "bench/projection.py",
    "--step-latency-us": "bench/projection.py",
    "--tp-link-gbps": "bench/projection.py",
    "--by-rank": "bench/projection.py",
    "--repeats": "bench/step_cost.py",  # bench_newton_schulz.py has it too
    "--gram": "bench/bench_newton_schulz.py",
    "--upper-gram": "bench/bench_newton_schulz.py",
    "--ref": "tools/upstream_muon_recipes.py",  # tools/upstream_muon_tests.py has it too
    "--without": "tools/upstream_muon_tests.py",
    "--pr": "tools/upstream_muon_tests.py",
    "--recipe": "tools/upstream_muon_recipes.py",
    "--impl": "tools/upstream_muon_recipes.py",
    "--case": "tools/upstream_recipes_sample.py",
    "--ours": "tools/upstream_muon_tests.py",
    "--print-flags": "tools/upstream_recipes_sample.py",  # tools/upstream_muon_recipes.py too
    **{  # python -m megatron.training.preprocess_data (its tokenizer flags are upstream's)
        flag: "megatron/training/preprocess_data.py"
        for flag in (
            "--input",
            "--output-prefix",
            "--workers",
            "--append-eod",
            "--json-keys",
            "--partitions",
            "--split-sentences",
            "--find-optimal-num-workers",
        )
    },
}
# Placeholders in commands of our scripts -> a value of their kind
PLACEHOLDERS = {"TAU": "5", "F": "0.9", "CHECKOUT": "/nonexistent/Megatron-LM", "...": "x"}
# What a run of Megatron flags is added to: a tiny model, our Muon in the DistributedOptimizer
FRAGMENT_BASE = (
    TINY + "--optimizer muon --muon-impl megatron_muon --use-distributed-optimizer".split()
)
# A snippet word that stands for something (an upper-case name, `...`, choices, options)
PLACEHOLDER = re.compile(r"^([A-Z][A-Z_0-9]*|\.\.\.|.*[{}\[\]|<>].*)$")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*\*?")
NON_ARGPARSE = {"tools/fork.py": ("fetch", "assemble", "check", "pristine")}  # fork.main's words

NEGATIVE = {
    "flag": "`--muon-made-up-flag`",
    "fragment": "`--optimizer muon --muon-tp-mode sideways`",
    "launch": "```bash\ntorchrun --nproc-per-node 2 pretrain_gpt.py --not-a-megatron-flag 1\n```",
    "tool": "`.venv/bin/python bench/convergence.py --made-up-bench-flag`",
    "make": "`make no-such-target`",
}
GOOD_LAUNCH = (
    "```bash\ntorchrun --nproc-per-node 2 pretrain_gpt.py " + " ".join(FRAGMENT_BASE) + "\n```"
)


def snippets(text: str) -> list:
    """The code blocks' and code spans' texts, in order (blocks first; a span wrapped over lines
    is one line)."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return blocks + [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", prose, re.S)]


def commands(snippet: str) -> list:
    """The commands of a snippet: its lines (backslash continuations joined, comments dropped),
    each split at ``&&``, as word lists."""
    text = re.sub(r"\\\n", " ", snippet)
    found = []
    for line in text.splitlines():
        line = re.sub(r"\s#.*$", "", line).strip()
        for part in line.split("&&"):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            if words:
                found.append(words)
    return found


def flag_problems(names: set) -> list:
    """The named flags that are none of: upstream's or ours, a retired name, a tool's."""
    known = known_flags()
    problems = []
    for name in sorted(names):
        if name.endswith("*"):
            ok = any(flag.startswith(name[:-1]) for flag in known)
        else:
            ok = name in known or name in RETIRED or name in TOOL_FLAGS
        if not ok:
            problems.append(name)
    return problems


def classify(words: list):
    """(kind, details) of one command, or None where it is not one the test checks."""
    if "pretrain_gpt.py" in words and len(words) > 1:  # a launch, not the file's name
        argv = words[words.index("pretrain_gpt.py") + 1 :]
        size = 1
        for flag in ("--nproc-per-node", "--nnodes"):
            if flag in words[: words.index("pretrain_gpt.py")]:
                size *= int(words[words.index(flag) + 1])
        return "launch", (argv, size)
    if words[0] in ("python", "python3") and words[1:2] == ["-m"] and len(words) > 2:
        return "module", words[2]
    if words[0] == "make":
        return "make", words[1:]
    if words[0] in ("bash", "sbatch") or re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        env = [w.split("=")[0] for w in words if re.fullmatch(r"[A-Z_]+=\S*", w)]
        rest = [w for w in words if not re.fullmatch(r"[A-Z_]+=\S*", w)]
        scripts = [w for w in rest if w.startswith("examples/")]
        return ("script", (scripts[0], env)) if scripts else None
    script = words[1] if words[0].endswith("python") and len(words) > 1 else words[0]
    ran = words[0].endswith("python") or len(words) > 1  # not only the file's name
    if ran and re.fullmatch(r"(\S+/)?(bench|tools)/\w+\.py|\w+\.py", script):
        index = words.index(script)
        name = Path(script).name
        path = next((d + "/" + name for d in ("bench", "tools") if (ROOT / d / name).exists()), "")
        argv = [PLACEHOLDERS.get(w, w) for w in words[index + 1 :]]
        if "--" in argv:  # what follows goes to pytest (tools/upstream_muon_tests.py)
            argv = argv[: argv.index("--")]
        return "tool", (path or script, argv)
    if words[0].startswith("--") and " ".join(words) in RETIRED_USES:
        return "retired", words
    if words[0].startswith("--"):
        if len(words) > 1 and not any(PLACEHOLDER.match(w) for w in words):
            if all(w in known_flags() for w in words if w.startswith("--")):
                return "fragment", words
    return None


def collect(texts: dict) -> dict:
    """{doc: {"flags": set, "commands": [(kind, details)]}} of {doc: its text}."""
    found = {}
    for doc, text in texts.items():
        flags, cmds = set(), []
        for snippet in snippets(text):
            flags |= set(FLAG.findall(snippet))
            for words in commands(snippet):
                kind = classify(words)
                if kind:
                    cmds.append(kind)
        found[doc] = {"flags": flags, "commands": cmds}
    return found


def _makefile():
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", text, re.M))
    variables = set(re.findall(r"\$\((\w+)\)", text))
    return targets, variables


def local_problems(kind: str, details) -> list:
    """Problems of the commands checked without the child process."""
    if kind == "make":
        targets, variables = _makefile()
        words = details or ["install"]  # make's first target
        bad = [w for w in words if "=" not in w and w not in targets]
        bad += [w for w in words if "=" in w and w.split("=")[0] not in variables]
        return [f"make: {w}" for w in bad]
    if kind == "script":
        script, env = details
        if not (ROOT / script).exists():
            return [f"no such script: {script}"]
        text = (ROOT / script).read_text()
        return [f"{script} reads no {v}" for v in env if v not in text]
    if kind == "module":
        return [] if importlib.util.find_spec(details) else [f"no module {details}"]
    if kind == "tool":
        path, argv = details
        if path in NON_ARGPARSE:
            text = (ROOT / path).read_text()
            words = NON_ARGPARSE[path]
            return [] if argv[0] in words and all(f'"{w}"' in text for w in words) else [path]
        if not (ROOT / path).exists():
            return [f"no such script: {path}"]
        if "argparse" not in (ROOT / path).read_text():
            return [f"{path}: no argparse to check it with"]
    return []


def child_cases(found: dict) -> dict:
    """The child process's cases: launches and fragments (upstream's parser), tool commands
    (their argparse), and each of our tools once with --help (its option strings)."""
    cases = {}
    for doc, info in found.items():
        for i, (kind, details) in enumerate(info["commands"]):
            name = f"{doc}#{i}"
            if kind == "launch":
                argv, size = details
                cases[name] = {"argv": argv, "world_size": size}
            elif kind in ("fragment", "retired"):
                cases[name] = {"argv": FRAGMENT_BASE + details, "world_size": 1}
            elif kind == "tool" and details[0] not in NON_ARGPARSE:
                if not local_problems(kind, details):  # a script of ours with argparse: only
                    cases[name] = {"tool": str(ROOT / details[0]), "argv": details[1]}
    for tool in sorted(set(TOOL_FLAGS.values())):
        if tool.endswith(".py"):
            # its options only: argv is not parsed (a required positional would exit)
            cases[f"options:{tool}"] = {"tool": str(ROOT / tool), "argv": [], "options_only": True}
    return cases


def _texts() -> dict:
    return {doc: (ROOT / doc).read_text() for doc in DOCS}


@pytest.fixture(scope="module")
def outcome(tmp_path_factory):
    found = collect({**_texts(), **{f"negative:{k}": v for k, v in NEGATIVE.items()}})
    found.update(collect({"good-launch": GOOD_LAUNCH}))
    tmp = tmp_path_factory.mktemp("docs")
    return found, run_parse_child(tmp, child_cases(found))


def _errors(results: dict, doc: str, info: dict) -> list:
    errors = []
    for i, (kind, details) in enumerate(info["commands"]):
        result = results.get(f"{doc}#{i}", {})
        errors += [f"{kind} {details}: {p}" for p in local_problems(kind, details)]
        ran = kind in ("launch", "fragment", "retired") or (
            kind == "tool" and details[0] not in NON_ARGPARSE
        )
        if ran and not result:
            errors.append(f"{kind} {details}: not run")
        elif kind == "retired" and "error" not in result:
            errors.append(f"retired {details}: parses")
        elif kind != "retired" and "error" in result:
            errors.append(f"{kind} {details}: {result['error']}\n{result['message'][-1500:]}")
    return errors


@pytest.mark.parametrize("doc", DOCS)
def test_every_flag_the_doc_names_exists(doc):
    (info,) = collect({doc: _texts()[doc]}).values()
    assert flag_problems(info["flags"]) == [], doc


@pytest.mark.parametrize("doc", DOCS)
def test_every_command_the_doc_shows_parses(outcome, doc):
    found, results = outcome
    assert _errors(results, doc, found[doc]) == []


def test_the_docs_commands_are_found():
    """The kinds of command the documentation shows are all seen (so none is skipped unseen)."""
    found = collect(_texts()).values()
    kinds = {kind for info in found for kind, _ in info["commands"]}
    assert kinds >= {"make", "script", "module", "tool", "fragment"}, kinds
    assert sum(len(info["flags"]) for info in found) > 100


def test_retired_names_are_gone_and_their_replacements_exist():
    assert not set(RETIRED) & known_flags()
    assert set(RETIRED.values()) <= known_flags()
    notes = " ".join(MIGRATION.read_text().split())
    assert all(f"`{old}` is `{new}`" in notes for old, new in RETIRED.items())


def test_tool_flags_are_the_tools(outcome):
    """Each allowed flag of one of our scripts is an option of that script's argparse."""
    _, results = outcome
    for flag, tool in TOOL_FLAGS.items():
        if tool.endswith(".py"):
            assert flag in results[f"options:{tool}"]["options"], (flag, tool)


@pytest.mark.parametrize("kind", sorted(NEGATIVE))
def test_negative_controls_fail(outcome, kind):
    found, results = outcome
    info = found[f"negative:{kind}"]
    problems = flag_problems(info["flags"]) + _errors(results, f"negative:{kind}", info)
    token, message = WHY[kind]
    assert problems and all(token in p for p in problems), problems
    assert any(message in p for p in problems), problems


WHY = {  # each negative control's made-up word, and the failure that names it
    "flag": ("--muon-made-up-flag", "--muon-made-up-flag"),
    "fragment": ("sideways", "invalid choice: 'sideways'"),
    "launch": ("--not-a-megatron-flag", "unrecognized arguments: --not-a-megatron-flag"),
    "tool": ("--made-up-bench-flag", "unrecognized arguments: --made-up-bench-flag"),
    "make": ("no-such-target", "make: no-such-target"),
}


def test_a_good_launch_parses(outcome):
    found, results = outcome
    assert [kind for kind, _ in found["good-launch"]["commands"]] == ["launch"]
    assert flag_problems(found["good-launch"]["flags"]) == []
    assert _errors(results, "good-launch", found["good-launch"]) == []
