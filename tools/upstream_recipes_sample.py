"""Launch a sample of Megatron-LM's pretraining functional-test recipes (dense, MoE, virtual
pipeline, MTP), shrunk to 2 CPU ranks, through the fork's pretrain_gpt.py (issue 30).

    .venv/bin/python tools/upstream_recipes_sample.py CHECKOUT [--ref core_v0.19.0]
        [--case KIND ...] [--print-flags] [--keep DIR]

CHECKOUT as tools/upstream_muon_recipes.py's (whose reader, shrink and launcher this reuses):
each recipe's model_config.yaml is read from it at ``--ref``. A recipe's MODEL_ARGS become
upstream's command line, then ``CPU_CHANGES`` (CPU stand-ins, shared with the Muon tool),
``PLAIN`` (a plain run; ``RESUME`` for a ckpt-resume recipe) and the recipe's own ``SAMPLE``
entry (sizes, parallelism on 2 ranks) rewrite what a CPU cannot run or what is too large; every
other flag stays upstream's. A run passes when every iteration logs a finite lm loss (and the MTP
loss where the recipe has MTP); a ckpt-resume recipe when the run resumed at N/2 logs the
uninterrupted run's scalars bit for bit.
tests/e2e/test_upstream_recipes_sample.py holds the flags this prints, frozen.
"""

import argparse
import math
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # run as a script or loaded by path
import upstream_muon_recipes as muon  # noqa: E402

REF = "core_v0.19.0"
RANKS = 2
ITERS = 4
RUNNER = muon.RUNNER
SIZE = {  # every recipe's sizes: flag -> (value, why)
    "--num-layers": ("2", "size: 12 or 16 layers are minutes per step on a CPU"),
    "--hidden-size": ("64", "size"),
    "--ffn-hidden-size": ("128", "size (2 x hidden)"),
    "--num-attention-heads": ("4", "size"),
    "--seq-length": ("64", "size"),
    "--max-position-embeddings": ("64", "size (= --seq-length, as upstream's)"),
    "--micro-batch-size": ("2", "size"),
    "--global-batch-size": ("8", "size: 4 micro-batches per step (DP 1)"),
    "--train-iters": (str(ITERS), "a few iterations"),
    "--exit-interval": (str(ITERS), "upstream's runner sets it to --train-iters"),
    "--eval-iters": ("1", "size: the final validation and test"),
}
PLAIN = {  # a plain run that trains: no checkpoint (suite time), so no save worker
    "--save": (None, "plain run: no checkpoint"),
    "--load": (None, "plain run: no checkpoint"),
    "--save-interval": (None, "plain run: no checkpoint"),
    "--async-save": (None, "plain run: no checkpoint"),
    "--use-persistent-ckpt-worker": (None, "plain run: no checkpoint"),
}
# A ckpt-resume recipe (upstream's TEST_TYPE) keeps its checkpoint flags and runs upstream's
# ckpt-resume test (tools/upstream_muon_recipes.py's ckpt_resume): N iterations saving at N/2,
# then a run resumed from N/2 whose scalars must equal the first run's bit for bit
RESUME = {
    "--save": (RUNNER, "a temporary folder"),
    "--load": (RUNNER, "a temporary folder"),
    "--save-interval": (str(ITERS // 2), "ckpt-resume saves at N/2 (upstream: 50 of 100)"),
}
TWO_RANKS = "2 CPU ranks (world size 2) instead of {}"
# Upstream's defaults a CPU cannot run, set where a recipe leaves them: flag -> (value, why)
CPU_DEFAULTS = {
    "--distributed-backend": ("gloo", "CPU ranks: the default NCCL needs GPUs"),
    "--no-gradient-accumulation-fusion": (
        True,
        "the default gradient_accumulation_fusion needs Apex's CUDA extension "
        "(fused_weight_gradient_mlp_cuda)",
    ),
}
# Per recipe of the sample (kind -> test case, its own changes)
SAMPLE = {
    "dense": (
        "gpt/gpt3_mcore_tp1_pp2",
        {"--num-layers": ("2", "size: one layer per pipeline stage")},
    ),
    "moe": (
        "moe/gpt3_moe_mcore_te_ep8_resume_torch_dist_dist_optimizer_1node",
        {
            "--expert-model-parallel-size": ("2", TWO_RANKS.format("EP 4")),
            "--num-experts": ("4", "size: 2 experts per EP rank"),
            "--moe-ffn-hidden-size": ("128", "size (upstream: 2 x hidden)"),
        },
    ),
    "vpp": (
        "gpt/gpt3_mcore_te_tp1_pp4_vp1_1node",
        {
            "--pipeline-model-parallel-size": ("2", TWO_RANKS.format("PP 4")),
            "--num-layers": ("4", "size: 2 virtual stages of 1 layer per pipeline rank"),
        },
    ),
    "mtp": (
        "moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_memory_speed",
        {
            "--pipeline-model-parallel-size": (
                "1",
                "TP 2 (with the recipe's sequence parallelism) and EP 2 fill the 2 ranks (PP: "
                "the vpp recipe)",
            ),
            "--num-virtual-stages-per-pipeline-rank": (None, "no pipeline (PP 1)"),
            "--expert-model-parallel-size": (
                "2",
                TWO_RANKS.format("16 GPUs (EP 4): TP 2 x EP 2, ETP 1 as the recipe's"),
            ),
            "--num-experts": ("4", "size: 2 experts per EP rank"),
            "--moe-layer-freq": ("([0]*1+[1]*1)", "2 layers: the dense first one, then MoE"),
            "--moe-ffn-hidden-size": ("64", "size"),
            "--moe-shared-expert-intermediate-size": ("64", "size"),
            "--moe-router-topk": ("2", "size: 4 experts"),
            "--moe-router-num-groups": ("2", "4 experts in 2 groups"),
            "--moe-router-group-topk": ("1", "top-2 within 1 group of 2 experts"),
            "--moe-permute-fusion": (None, "Transformer Engine's fused permute: CUDA only"),
            "--kv-channels": ("16", "size"),
            "--q-lora-rank": ("32", "size"),
            "--kv-lora-rank": ("16", "size"),
            "--qk-head-dim": ("16", "size"),
            "--qk-pos-emb-head-dim": ("8", "size"),
            "--v-head-dim": ("16", "size"),
            "--make-vocab-size-divisible-by": ("64", "size: 3232 pads 128 tokens to 6464 at TP 2"),
        },
    ),
}
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+|nan|inf) \|", re.I)
MTP_LOSS = re.compile(r"iteration\s+(\d+)/.*?\| mtp_1 loss: ([0-9.E+-]+|nan|inf) \|", re.I)


def resumes(recipe: dict) -> bool:
    """Whether upstream tests this recipe by ckpt-resume (else one plain run)."""
    return recipe.get("TEST_TYPE") == "ckpt-resume"


def tables(kind: str, model_args: dict, resume: bool = False) -> tuple:
    """(changes, added) of one recipe of SAMPLE for muon.shrink: an added flag the recipe
    already gives becomes a change. ``resume``: its checkpoint flags stay (``RESUME``)."""
    table = {**muon.CPU_CHANGES, **SIZE, **(RESUME if resume else PLAIN), **SAMPLE[kind][1]}
    extra = {**muon.CPU_ADDED, **CPU_DEFAULTS}
    added = {f: v for f, v in extra.items() if f not in model_args}
    table.update({f: v for f, v in extra.items() if f in model_args and f not in table})
    return table, added


def recipe_flags(checkout: Path, ref: str, kind: str) -> tuple:
    """(flags, changes, env vars, commit) of one recipe of SAMPLE shrunk to 2 CPU ranks."""
    recipe, commit = muon.read_recipe(checkout, ref, SAMPLE[kind][0])
    table, added = tables(kind, recipe["MODEL_ARGS"], resumes(recipe))
    flags, changes = muon.shrink(recipe["MODEL_ARGS"], kind, table, added)
    return flags, changes, recipe.get("ENV_VARS") or {}, commit


def trained(out: str, iters: int, mtp: bool) -> str:
    """Why a run's console output does not show it trained ('' when it does): each iteration's
    lm loss (and MTP loss) logged and finite."""
    for name, pattern, wanted in (("lm loss", LOSS, True), ("mtp_1 loss", MTP_LOSS, mtp)):
        if not wanted:
            continue
        got = {int(i): float(v) for i, v in pattern.findall(out)}
        if sorted(got) != list(range(1, iters + 1)):
            return f"{name} logged at iterations {sorted(got)}, not 1..{iters}"
        if not all(math.isfinite(v) for v in got.values()):
            return f"{name} not finite: {got}"
    return ""


def check(flags: dict, env_vars: dict, work: Path, timeout: int = 480) -> tuple:
    """Upstream's test of one shrunk recipe on 2 CPU ranks: (why it failed or '', seconds).
    A recipe with ``--save`` (a ckpt-resume one) runs upstream's ckpt-resume test, which must
    compare every scalar of the resumed iterations; any other one run that must train."""
    if "--save" not in flags:
        out, seconds = run(flags, env_vars, work, timeout)
        return trained(out, int(flags["--train-iters"]), "--mtp-num-layers" in flags), seconds
    result = muon.ckpt_resume(flags, RANKS, work, env_vars, timeout)
    return ("" if result["ok"] and result["compared"] else result["detail"]), result["seconds"]


def run(flags: dict, env_vars: dict, work: Path, timeout: int = 480) -> tuple:
    """Launch one shrunk recipe on 2 CPU ranks: (console output, seconds)."""
    env = muon.run_env(env_vars)
    paths = {"--data-cache-path": str(work / "data_cache"), "--tensorboard-dir": str(work / "tb")}
    start = time.time()
    out = muon.launch(work, "run", RANKS, muon.command_line(flags, paths), env, timeout)
    return out, time.time() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path)
    parser.add_argument("--ref", default=REF)
    parser.add_argument("--case", action="append", choices=SAMPLE, dest="cases")
    parser.add_argument("--keep", type=Path, help="keep each run's log here")
    parser.add_argument("--print-flags", action="store_true", help="print the flags only")
    args = parser.parse_args(argv)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="recipes_sample_", dir=args.keep))
    failed = 0
    for kind in args.cases or list(SAMPLE):
        flags, changes, env_vars, commit = recipe_flags(args.checkout, args.ref, kind)
        print(f"{kind}: {muon.recipe_path(SAMPLE[kind][0])} at {args.ref} ({commit[:12]})")
        for flag, old, new, why in changes:
            was = "(absent)" if old is None else old
            print(f"  {flag}: {was} -> {'dropped' if new is None else new}  [{why}]")
        if args.print_flags:
            print(f"  FLAGS = {flags!r}\n  ENV_VARS = {env_vars!r}")
            continue
        work = base / kind
        work.mkdir()
        try:
            why, seconds = check(flags, env_vars, work)
        except RuntimeError as err:
            why, seconds = str(err), float("nan")
        failed += bool(why)
        print(f"  {'FAIL' if why else 'PASS'} {seconds:.0f} s {why}", flush=True)
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
