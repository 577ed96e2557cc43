#!/usr/bin/env python3
"""Export our megatron.core changes as a ``git format-patch`` series for upstream Megatron-LM.

    python tools/make_pr.py [OUT]     # default OUT: build/pr (also `make pr`)

Megatron-LM itself cannot be cloned here (no network but package registries), so the series is
built on a git repository initialized from the pristine megatron-core 0.16.1 archive's
``megatron/`` tree: the same paths as in Megatron-LM at tag core_v0.16.1. Each commit adds our
files (with the NVIDIA header that upstream's copyright check expects, added here) and applies
our patches, in review order; ``OUT/*.patch`` apply to a Megatron-LM checkout with ``git am``.
The training stack (``megatron/training``), the CPU shim and our benchmarks stay out: they are
this project's, not megatron.core's. Only the standard library and git are used.
"""

import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = "# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.\n\n"
AUTHOR = ["-c", "user.name=megatron-muon", "-c", "user.email=megatron-muon@users.noreply"]
OPT = "megatron/core/optimizer/"

# (subject, body, our files, our patches), in the order a reviewer reads them
SERIES = [
    (
        "distrib_optimizer: the DistOpt shard layout in one module",
        "distopt_layout.py: where DDP's buckets and DistOpt's shards put each model param, and\n"
        "the model-space names checkpoints use; read by the Adam checkpoint repairs, the Muon\n"
        "DistOpt exchange and the declared-state checkpoints alike.",
        [OPT + "distopt_layout.py"],
        [],
    ),
    (
        "distrib_optimizer: torch Adam DistOpt checkpoints resume (upstream's format)",
        "Without TE/Apex no DistOpt checkpoint of torch's Adam/AdamW resumes in 0.16.1: a fresh\n"
        "optimizer's state_dict asserts, loading copies the per-param step (KeyError, or the\n"
        "loader's own step), all params share one step tensor after load_state_dict, and\n"
        "fully_reshardable saves shifted state with several buckets (NVIDIA/Megatron-LM#5077).\n"
        "The format is unchanged: checkpoints of plain 0.16.1 load, and resume exactly.",
        [OPT + "distopt_adam_checkpoint.py"],
        ["0009-distopt-torch-adam-checkpoint-repairs.patch"],
    ),
    (
        "optimizer: Muon config vocabularies and defaults in one module",
        "muon_config.py holds the Muon vocabularies, the defaults OptimizerConfig's muon_* fields\n"
        "take (upstream's unchanged; new fields off) and their validation, run where Muon is\n"
        "built rather than in every OptimizerConfig.__post_init__.",
        [OPT + "muon_config.py"],
        ["0001-optimizer-config-muon.patch"],
    ),
    (
        "optimizer: Muon without emerging_optimizers (Newton-Schulz, functional step, Muon)",
        "Pure Newton-Schulz (simple, quintic, polar_express coefficients), the three stages of a\n"
        "Muon step with one Q/K/V split and one scale rule, and a plain torch optimizer holding\n"
        "Muon and AdamW param groups.",
        [OPT + "newton_schulz.py", OPT + "muon_functional.py", OPT + "muon_optimizer.py"],
        [],
    ),
    (
        "optimizer: Muon in get_megatron_optimizer, tensor parallel and DistOpt-ready",
        "TP orthogonalizers (blockwise, duplicated, distributed), the DistOpt exchange, the\n"
        "factory hooks and TensorParallelMuon; muon.py keeps upstream's public names.\n"
        "layer_wise_distributed_optimizer=True is deprecated in favour of the DistOpt path.",
        [
            OPT + "muon_tp.py",
            OPT + "muon_split.py",
            OPT + "muon_placement.py",
            OPT + "muon_plan.py",
            OPT + "muon_distopt.py",
            OPT + "muon_megatron.py",
            OPT + "muon.py",
        ],
        ["0002-optimizer-factory-muon.patch"],
    ),
    (
        "distrib_optimizer: hand Muon its shard layout (ZeRO-1 Muon)",
        "The DistributedOptimizer accepts an inner optimizer that declares its state and gives\n"
        "it the shard layout, so Muon orthogonalizes whole matrices exactly.",
        [],
        ["0010-distopt-muon-shard-layout.patch"],
    ),
    (
        "distrib_optimizer: checkpoints for optimizers that declare their state",
        "torch and torch_dist (fully_reshardable, dp_reshardable) DistOpt checkpoints use the\n"
        "state keys the optimizer declares; param groups are told apart by use_muon, and groups\n"
        "of one identity (--decoupled-lr's and the default) load in order.",
        [OPT + "muon_checkpoint.py", OPT + "muon_checkpoint_sharded.py"],
        [
            "0011-distopt-declared-state-checkpoint.patch",
            "0012-param-group-identity-use-muon.patch",
        ],
    ),
    (
        "distrib_optimizer: param groups of one identity are matched in order on load",
        "--decoupled-lr's group has the default group's identity (is_decoupled_lr stays False),\n"
        "so a map from identity to group kept the last: a DistOpt resume gave the default group\n"
        "the decoupled lr bounds. The k-th saved group of an identity now loads into the k-th\n"
        "current one (group_matching.match_groups; Muon's DistOpt loader too; the plain\n"
        "optimizer's reorder does the same in patch 0012, where that map is patched anyway).",
        [OPT + "group_matching.py"],
        ["0016-distopt-param-groups-matched-in-order.patch"],
    ),
    (
        "transformer: QK-clip (MuonClip) without Transformer Engine",
        "Local attention records per-head max attention logits; clip_qk scales query/key rows\n"
        "after the optimizer step, on model params, fp32 main params and DistOpt shards.",
        [
            OPT + "qk_clip.py",
            "megatron/core/transformer/max_attention_logit.py",
            "megatron/core/transformer/qk_clip_config.py",
        ],
        ["0013-transformer-config-qk-clip-checks.patch", "0014-local-attention-max-logit.patch"],
    ),
    (
        "transformer: zero-centered gamma (apply-layernorm-1p) for the local torch norms",
        "WrappedTorchNorm asserted layernorm_zero_centered_gamma off; it now returns LayerNorm /\n"
        "RMSNorm modules whose weight is gamma (scale 1 + gamma, gamma initialized to 0), as TE\n"
        "and Apex store it.",
        ["megatron/core/transformer/zero_centered_norm.py"],
        ["0015-local-norm-zero-centered-gamma.patch"],
    ),
    (
        "moe: router without Transformer Engine",
        "The MoE router's fused path is guarded so the local spec runs without TE.",
        [],
        ["0003-moe-router-without-te.patch"],
    ),
    (
        "jit: torch.compile a fusion on its first call",
        "jit_fuser defers torch.compile to the first call: what is compiled, and when, is\n"
        "unchanged, but importing megatron.core no longer imports torch._inductor (~2.5 s of CPU\n"
        "per process, for fusions a run may never call).",
        ["megatron/core/lazy_compile.py"],
        ["0020-jit-compile-on-first-call.patch"],
    ),
    (
        "optimizer: one loss scale for the dense and the expert optimizer (fp16 with EP)",
        "With expert parallelism the dense and the expert optimizer each have a grad scaler and\n"
        "each updated it with its own inf/NaN check; the loss is scaled by the first one's.\n"
        "An inf only in expert grads backed off the expert scaler alone, and later expert grads\n"
        "were unscaled by the wrong factor. ChainedOptimizer.prepare_grads now updates every\n"
        "scaler with the chain's verdict (chained_grad_scaler.py).",
        [OPT + "chained_grad_scaler.py"],
        ["0021-chained-optimizer-one-loss-scale.patch"],
    ),
    (
        "moe: an expert's weighted bias is added out of place",
        "Experts with biases outside expert parallelism crashed at the first forward: at TP=1\n"
        "the row-parallel reduce returns its input as is, and MLP.forward added the routing-\n"
        "weighted bias to that view in place, which autograd forbids.",
        [],
        ["0022-moe-expert-bias-out-of-place.patch"],
    ),
    (
        "rerun_state_machine: report_stats logs its figures instead of raising",
        "--rerun-mode report_stats (REPORT_DETERMINISM_STATS) read caller.filename and\n"
        "caller.lineno, which a Caller (message, rank) lacks: the first report raised an\n"
        "AttributeError on rank 0 alone, after the other ranks had left the gather. The report\n"
        "names each check by its message.",
        [],
        ["0023-rerun-report-stats-caller.patch"],
    ),
    (
        "tests, docs: Muon unit tests and an API guide page",
        "Single-process unit tests (GPU or CPU) and docs/source/api-guide/muon.md.",
        ["tests/unit_tests/test_muon_core.py", "docs/source/api-guide/muon.md"],
        [],
    ),
]
SOURCES = {"docs/source/api-guide/muon.md": ROOT / "docs" / "muon.md"}


def _fork():
    spec = importlib.util.spec_from_file_location("fork_for_pr", ROOT / "tools" / "fork.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _git(repo: Path, *args: str) -> str:
    cmd = ["git", *AUTHOR, *args]
    done = subprocess.run(cmd, cwd=repo, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)} failed in {repo}:\n{done.stderr}")
    return done.stdout


def init_pristine(repo: Path) -> None:
    """A git repository holding the pristine archive's megatron/ tree, one commit."""
    _fork().extract(repo)
    _git(repo, "init", "-q", "-b", "core_v0.16.1")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "megatron-core 0.16.1 (pristine archive, megatron/)")


def _write_ours(repo: Path, rel: str) -> None:
    source = SOURCES.get(rel, ROOT / rel)
    text = source.read_text()
    if rel.endswith(".py") and not text.startswith("# Copyright"):
        text = HEADER + text
    dest = repo / rel
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(text)


def build_series(out: Path) -> list[Path]:
    """Write the series into ``out`` (emptied first); return the patch files in order."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "megatron-lm"
        init_pristine(repo)
        for subject, body, files, patches in SERIES:
            for rel in files:
                _write_ours(repo, rel)
            for name in patches:
                _git(repo, "apply", "--whitespace=nowarn", str(ROOT / "patches" / name))
            _git(repo, "add", "-A")
            _git(repo, "commit", "-q", "-m", f"{subject}\n\n{body}")
        _git(repo, "format-patch", "-q", "-o", str(out), "HEAD~" + str(len(SERIES)))
    return sorted(out.glob("*.patch"))


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else ROOT / "build" / "pr"
    written = build_series(out)
    print(f"{len(written)} patches for Megatron-LM core_v0.16.1 in {out} (apply with git am)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
