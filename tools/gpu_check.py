"""The device check: what CPU CI cannot show, run on one lent GPU in a few minutes.

On the device machine (Python 3.12 with torch; no network), with the upstream archive carried in
``.cache/upstream`` and the pinned wheels torch's image lacks in ``.cache/wheels``
(``pip download -d .cache/wheels emerging-optimizers==0.3.0 absl-py==2.5.1 psutil==7.2.2
--no-deps``):

    python3 -m pip install --no-index --no-deps .cache/wheels/*.whl && \
        python3 tools/fork.py assemble && PYTHONPATH=build/fork python3 tools/gpu_check.py

``--device cpu`` runs the same checks here (CPU mode, gloo) to test the script itself.
Prints one line per check and exits non-zero if any fails.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_LOSS = re.compile(r"iteration\s+(\d+)/.*?lm loss: ([0-9.E+-]+)")


def check_newton_schulz(device: str) -> str:
    """NS on the device matches the CPU fp32 result (bf16: within bf16's rounding)."""
    from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz

    gen = torch.Generator().manual_seed(0)
    worst = {}
    for shape in [(1024, 1024), (1024, 4096), (4096, 1024), (8, 512, 2048)]:
        x = torch.randn(shape, generator=gen)
        ref = newton_schulz(x, precision="highest")
        for precision, tol in (("highest", 1e-4), ("medium", 3e-2)):
            got = newton_schulz(x.to(device), precision=precision).cpu()
            err = ((got - ref).norm() / ref.norm()).item()
            worst[precision] = max(worst.get(precision, 0.0), err)
            assert err < tol, f"NS {precision} {shape}: rel. error {err:.2e} >= {tol}"
    return f"NS on {device} vs CPU fp32: worst rel. error {worst}"


def check_sharded_newton_schulz(device: str) -> str:
    """The sharded NS that the ``distributed`` TP mode and gangs run, over ``k`` row or column
    shards on the device (their sums and row gathers served in this process), matches the whole
    matrix's NS there: fp32 within 1e-4, bf16 within bf16's rounding."""
    from megatron.core.optimizer.megatron_muon.newton_schulz import (
        newton_schulz,
        sharded_newton_schulz_steps,
    )

    gen = torch.Generator().manual_seed(1)
    worst = {}
    # 1024-side Grams in two blocks (``upper_gram``); the square one split, then reassociated
    cases = [((1024, 4096), 1, 4, 0), ((4096, 1024), 0, 2, 0), ((768, 768), 0, 3, 0)]
    for shape, dim, k, reassociate in cases + [((768, 768), 0, 3, 1)]:
        x = torch.randn(shape, generator=gen).to(device)
        for precision, tol in (("highest", 1e-4), ("medium", 3e-2)):
            shards = x.tensor_split(k, dim=dim)
            steps = [
                sharded_newton_schulz_steps(
                    s,
                    dim,
                    precision=precision,
                    reassociate=bool(reassociate),
                    part=None if reassociate else (p, k),
                )
                for p, s in enumerate(shards)
            ]
            got = torch.cat(_lockstep(steps), dim=dim)
            ref = newton_schulz(x, precision=precision)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            worst[precision] = max(worst.get(precision, 0.0), err)
            assert err < tol, f"sharded NS {precision} {shape} over {k}: rel. error {err:.2e}"
    return f"sharded NS on {device} vs whole: worst rel. error {worst}"


def _lockstep(steps: list, gather: bool = True) -> list:
    """Run request generators through ``newton_schulz.interleave`` (the modes' own round-robin),
    each round served in this process once all ``k`` posted it: a SUM adds the ``k`` tensors, a
    GATHER fills each one's range ``ranges[q]`` from generator ``q`` (``gather`` False: left
    unfilled, a negative control's)."""
    from megatron.core.optimizer.megatron_muon.newton_schulz import SUM, interleave

    k, turns, rounds, served = len(steps), [0] * len(steps), {}, set()

    def post(i: int, kind: str, t) -> int:
        turns[i] += 1
        rounds.setdefault(turns[i], {})[i] = (kind, t)
        return turns[i]

    def wait(r: int) -> None:
        if r in served:
            return
        posted = rounds.pop(r)  # served once; the others' waits for it return at once
        assert len(posted) == k, f"round {r}: {len(posted)} of {k} shards posted"
        kind, tensors = posted[0][0], [posted[q][1] for q in range(k)]
        if kind == SUM:
            total = torch.stack(tensors).sum(0)
            for t in tensors:
                t.copy_(total)
        elif gather:
            for q, (lo, hi) in enumerate(tensors[0].ranges):
                for pieces in tensors:
                    pieces.flat[lo:hi] = tensors[q].flat[lo:hi]
        served.add(r)

    return interleave(steps, post, wait)


def check_ns_speed(device: str) -> str:
    """Our NS vs torch.optim.Muon's on the same bf16 input (timing; reported, not asserted)."""
    from torch.optim import _muon

    from megatron.core.optimizer.megatron_muon.newton_schulz import newton_schulz

    n = 4096 if device == "cuda" else 512  # ``--device cpu`` tests the script, quickly
    x = torch.randn(n, n, device=device)
    coeffs = (3.4445, -4.7750, 2.0315)
    ours = _time(lambda: newton_schulz(x, precision="medium"), device)
    theirs = _time(lambda: _muon._zeropower_via_newtonschulz(x, coeffs, 5, 1e-7), device)
    return f"NS {n}x{n} bf16: ours {ours * 1e3:.2f} ms, torch.optim.Muon {theirs * 1e3:.2f} ms"


def check_packed_gram(device: str) -> str:
    """A gang's Gram sum moves the packed upper triangle: packing and unpacking on the device
    restore the matrix exactly; their time beside the Gram matmul's is reported, and that of the
    upper triangle in blocks (``upper_gram``, what a sharded step computes), which must match
    the whole product's within bf16's rounding."""
    from megatron.core.optimizer.megatron_muon.newton_schulz import (
        gram_blocks,
        pack_symmetric,
        unpack_symmetric,
        upper_gram,
    )

    g = 4096 if device == "cuda" else 1024  # ``--device cpu`` tests the script, quickly
    x = torch.randn(g, 2 * g, device=device, dtype=torch.bfloat16)
    gram = x @ x.mT
    for dtype in (torch.float32, torch.bfloat16):
        want = gram.triu() + gram.triu(1).mT
        got = unpack_symmetric(pack_symmetric(gram), dtype)
        assert torch.equal(got, want.to(dtype)), f"packed Gram round trip ({dtype}) differs"
    upper = upper_gram(x)
    above = tuple(torch.triu_indices(g, g, device=device))
    err = ((upper[above].float() - gram[above].float()).abs().max() / gram.abs().max()).item()
    assert err < 1e-2, f"upper_gram's triangle off the whole product's by {err:.1e} (bf16)"
    packing = _time(lambda: unpack_symmetric(pack_symmetric(gram), torch.bfloat16), device)
    matmul = _time(lambda: x @ x.mT, device)
    blocks = _time(lambda: upper_gram(x), device)  # the sharded steps' Gram (FLOPs: 9/16 here)
    return (
        f"pack + unpack {g}^2: {packing * 1e3:.2f} ms; its Gram matmul {matmul * 1e3:.2f} ms, "
        f"its upper triangle in {len(gram_blocks(g))} blocks {blocks * 1e3:.2f} ms"
    )


def _time(fn, device: str, repeats: int = 10) -> float:
    fn()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - start) / repeats


def _train(args: list, device: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.join(ROOT, "build", "fork"), env.get("PYTHONPATH")])
    )
    backend = []
    if device == "cpu":
        env["MEGATRON_CPU_MODE"] = "1"
        backend = ["--distributed-backend", "gloo"]  # upstream's default is nccl
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone"]
    proc = subprocess.run(
        cmd + [os.path.join(ROOT, "pretrain_gpt.py"), *backend, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-1500:]
    return {int(i): float(v) for i, v in _LOSS.findall(proc.stdout)}


# A small GPT on upstream's loop; --transformer-impl local and the fusions off that need TE or
# Apex: the image may lack both
TINY_GPT = (
    "--mock-data --vocab-size 1024 --tokenizer-type NullTokenizer --transformer-impl local"
    " --no-persist-layer-norm --no-gradient-accumulation-fusion --no-rope-fusion"
    " --no-masked-softmax-fusion"
    " --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 256"
    " --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16 --lr 3e-3"
    " --bf16 --log-interval 1 --eval-iters 0 --eval-interval 1000 --train-iters 20"
).split()
# Muon + DistOpt, ours and upstream's (its LayerWise optimizer)
SETUPS = {
    "ours": ["--optimizer", "muon", "--muon-impl", "megatron_muon", "--use-distributed-optimizer"],
    "layerwise": ["--optimizer", "muon", "--use-distributed-optimizer"],
}


def check_training_resume(device: str) -> str:
    """pretrain_gpt.py on upstream's loop, bf16, nccl: ours and LayerWise Muon + DistOpt; the
    loss falls; a resume from the middle checkpoint repeats the uninterrupted losses exactly."""
    lines = []
    for name, flags in SETUPS.items():
        save = tempfile.mkdtemp()
        full = _train(TINY_GPT + flags + ["--save", save, "--save-interval", "10"], device)
        assert full[20] < full[1], f"{name}: loss did not fall: {full[1]} -> {full[20]}"
        with open(os.path.join(save, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("10")  # resume from the middle checkpoint
        resumed = _train(TINY_GPT + flags + ["--load", save], device)
        # upstream's second line after a start shows the mean of that start's first two
        # iterations (tests/e2e/upstream_runs.step_losses): undone, to the 7 digits printed
        resumed[12] = 2 * resumed[12] - resumed[11]
        assert abs(resumed[12] - full[12]) <= 2e-6 * abs(full[12]), (name, full, resumed)
        assert all(resumed[i] == full[i] for i in (11, *range(13, 21))), (name, full, resumed)
        lines.append(f"{name} loss {full[1]:.3f} -> {full[20]:.3f}, resume exact")
    return f"pretrain_gpt.py on {device}: " + "; ".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    device = parser.parse_args().device
    if device == "cpu":
        from megatron.training import cpu_mode

        cpu_mode.enable()
    failed = 0
    checks = (
        check_newton_schulz,
        check_sharded_newton_schulz,
        check_ns_speed,
        check_packed_gram,
        check_training_resume,
    )
    for check in checks:
        try:
            print(f"PASS {check.__name__}: {check(device)}", flush=True)
        except Exception as err:  # report every check, then fail
            failed += 1
            print(f"FAIL {check.__name__}: {type(err).__name__}: {err}"[:4000], flush=True)
    print(f"{len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
