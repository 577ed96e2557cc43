"""Newton-Schulz speed: ours vs torch.optim.Muon's vs the bare-matmul floor, side by side.

    .venv/bin/python bench/bench_newton_schulz.py            # GPT shapes, fp32 and bf16
    .venv/bin/python bench/bench_newton_schulz.py --quick    # shapes / 4, a few seconds
    .venv/bin/python bench/bench_newton_schulz.py --gram     # Gram form: 8B FLOP table, timing
    .venv/bin/python bench/bench_newton_schulz.py --upper-gram  # a sharded step's Gram: blocks

``torch``: ``torch.optim._muon._zeropower_via_newtonschulz``, which only takes 2-D input and
always computes in bf16. So its bf16 rows call it as is (looped over a batch, as a caller of it
must), and its fp32 rows run the same op sequence transcribed with the bf16 cast left out.
``floor``: only the 3 matmuls per step that NS needs (X X^T, A A, B X), same shapes and dtype,
into preallocated outputs: what NS would cost with free elementwise work. Median of repeats
(``--stat min`` on a machine shared with other jobs).
"""

import argparse
import functools
import statistics
import time

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS
from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns

from megatron.core.optimizer.megatron_muon.functional import MuonParamInfo
from megatron.core.optimizer.megatron_muon.newton_schulz import (
    gram_blocks,
    newton_schulz,
    upper_gram,
    upper_gram_flops,
    uses_gram,
)
from megatron.core.optimizer.megatron_muon.planner.plan import ns_cost

STEPS = 5
ABC = (DEFAULT_A, DEFAULT_B, DEFAULT_C)
SHAPES = [(1024, 1024), (1024, 4096), (4096, 1024), (8, 512, 2048)]
# Our precision names (upstream's) and the dtype of their matmuls.
DTYPES = {"highest": torch.float32, "medium": torch.bfloat16}


def torch_ops_fp32(grad: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's NS op for op, minus its ``grad.bfloat16()``."""
    a, b, c = ABC
    x = grad.T if grad.size(0) > grad.size(1) else grad
    x = x / x.norm().clamp(min=EPS)
    for _ in range(STEPS):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


def torch_reference(x: torch.Tensor, precision: str) -> torch.Tensor:
    fn = (lambda g: torch_ns(g, ABC, STEPS, EPS)) if precision == "medium" else torch_ops_fp32
    return fn(x) if x.ndim == 2 else torch.stack([fn(m) for m in x])


def make_floor(x: torch.Tensor, precision: str):
    """A closure running just the NS matmuls on preallocated buffers of the working dtype."""
    m, n = sorted(x.shape[-2:])
    batch = x.shape[:-2]
    dtype = DTYPES[precision]
    xs = torch.randn(*batch, m, n).to(dtype)
    gram, poly, out = (torch.empty(*batch, m, k, dtype=dtype) for k in (m, m, n))

    def run():
        for _ in range(STEPS):
            torch.matmul(xs, xs.mT, out=gram)
            torch.matmul(gram, gram, out=poly)
            torch.matmul(poly, xs, out=out)

    return run


def bench_row(shape, precision, repeats, warmup, stat):
    """Seconds per implementation (median or min of repeats). Implementations interleave within
    each repeat, so load from other processes on a shared machine hits all of them alike."""
    x = torch.randn(shape)
    fns = {
        "ours": lambda: newton_schulz(x, STEPS, "simple", precision),
        "torch": lambda: torch_reference(x, precision),
        "floor": make_floor(x, precision),
    }
    times = {name: [] for name in fns}
    for i in range(warmup + repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i >= warmup:
                times[name].append(time.perf_counter() - start)
    reduce = statistics.median if stat == "median" else min
    return {name: reduce(t) for name, t in times.items()}


# Llama-3-8B's Muon matrices of one layer (hidden 4096, SwiGLU ffn 14336, GQA 32/8 heads of 128):
# the fused QKV weight (8 groups of Q 512, K 128, V 128 rows) as functional.py splits it.
LLAMA_8B = {
    "qkv": MuonParamInfo((6144, 4096), qkv_split=(512, 128, 128)),
    "proj": MuonParamInfo((4096, 4096)),
    "fc1": MuonParamInfo((2 * 14336, 4096)),
    "fc2": MuonParamInfo((4096, 14336)),
}
# The blocks Newton-Schulz sees (Q, K, V of QKV), for timing.
LLAMA_8B_BLOCKS = {
    "Q": (4096, 4096),
    "K": (1024, 4096),
    "V": (1024, 4096),
    "proj": (4096, 4096),
    "fc1": (28672, 4096),
    "fc2": (4096, 14336),
}


def gram_table(scale: int, repeats: int, precision: str) -> None:
    """Counted NS FLOPs of an 8B layer, standard vs ``form='auto'`` (``plan.ns_cost``, what
    the DistOpt planner counts), and CPU time of one orthogonalization per block at 1/scale."""
    print(f"Newton-Schulz FLOPs per Muon step, one Llama-3-8B layer, {STEPS} steps (counted)")
    print(f"{'matrix':>6} {'shape':>11} {'standard GF':>12} {'auto GF':>9} {'auto/std':>8}")
    total = [0.0, 0.0]
    for name, info in LLAMA_8B.items():
        std, auto = ns_cost(info, STEPS), ns_cost(info, STEPS, "auto")
        total = [total[0] + std, total[1] + auto]
        shape = "x".join(map(str, info.shape))
        print(f"{name:>6} {shape:>11} {std / 1e9:12.1f} {auto / 1e9:9.1f} {auto / std:8.3f}")
    print(f"{'layer':>6} {'':>11} {total[0] / 1e9:12.1f} {total[1] / 1e9:9.1f}", end=" ")
    print(f"{total[1] / total[0]:8.3f}")
    print(
        f"\nCPU time of one orthogonalization, blocks / {scale}, {precision}, "
        f"{torch.get_num_threads()} thread(s), median of {repeats} (interleaved)"
    )
    print(f"{'block':>6} {'shape':>10} {'form':>8} {'standard ms':>12} {'auto ms':>9} {'ratio':>6}")
    for name, (m, n) in LLAMA_8B_BLOCKS.items():
        x = torch.randn(m // scale, n // scale)
        fns = {f: functools.partial(newton_schulz, x, STEPS, "quintic", precision, form=f)
               for f in ("standard", "auto")}  # fmt: skip
        std, auto = _interleaved_ms(fns, repeats)
        form = "gram" if uses_gram(*x.shape, STEPS, "auto") else "standard"
        shape = f"{x.shape[0]}x{x.shape[1]}"
        print(f"{name:>6} {shape:>10} {form:>8} {std:12.1f} {auto:9.1f} {auto / std:6.2f}")


def _interleaved_ms(fns: dict, repeats: int) -> list[float]:
    """Median milliseconds of each of ``fns``, run in turn ``repeats`` times after one warm-up
    round (interleaved, so a slow spell of a shared machine hits them alike)."""
    times = {k: [] for k in fns}
    for i in range(repeats + 1):
        for k, fn in fns.items():
            start = time.perf_counter()
            fn()
            if i:
                times[k].append(time.perf_counter() - start)
    return [statistics.median(times[k]) * 1e3 for k in fns]


# (g, l): a sharded step's Gram side and lines; 70B fc1's TP shard is (8192, 7168)
UPPER_SHAPES = [(2048, 4096), (4096, 2048), (4096, 512)]


def upper_gram_table(repeats: int, precision: str) -> None:
    """CPU time of a sharded step's Gram, the upper triangle in blocks (``upper_gram``) against
    the whole product, interleaved, beside the counted FLOP ratio."""
    print(
        f"Gram W W^T of a g x l shard, {precision}, {torch.get_num_threads()} thread(s), "
        f"median of {repeats} (interleaved)"
    )
    print(f"{'g x l':>11} {'blocks':>6} {'whole ms':>9} {'upper ms':>9} {'time':>6} {'FLOPs':>6}")
    for g, lines in UPPER_SHAPES:
        w = torch.randn(g, lines).to(DTYPES[precision])
        fns = {
            "whole": functools.partial(torch.mm, w, w.mT),
            "upper": functools.partial(upper_gram, w),
        }
        whole, upper = _interleaved_ms(fns, repeats)
        flops = upper_gram_flops(g, lines) / (2 * g * g * lines)
        print(
            f"{f'{g}x{lines}':>11} {len(gram_blocks(g)):6d} {whole:9.1f} {upper:9.1f} "
            f"{upper / whole:6.2f} {flops:6.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shapes divided by 4")
    # One thread by default: on a small shared machine, multi-threaded BLAS stalls on barriers
    # whenever another process takes a core, which swamps the differences measured here.
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    # min estimates the uncontended time: use it when other processes share the cores.
    parser.add_argument("--stat", choices=["median", "min"], default="median")
    parser.add_argument("--precisions", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    parser.add_argument(
        "--gram", action="store_true", help="the Gram form: 8B FLOP table and CPU timing"
    )
    parser.add_argument("--gram-scale", type=int, default=8, help="--gram: time blocks / this")
    parser.add_argument(
        "--upper-gram", action="store_true", help="a sharded step's Gram: upper blocks vs whole"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.upper_gram:
        for precision in args.precisions:
            upper_gram_table(args.repeats, precision)
        return
    if args.gram:
        for precision in args.precisions:
            gram_table(args.gram_scale, args.repeats, precision)
        return
    shapes = [s[:-2] + (s[-2] // 4, s[-1] // 4) for s in SHAPES] if args.quick else SHAPES
    print(
        f"Newton-Schulz, {STEPS} steps, torch {torch.__version__}, {args.threads} thread(s), "
        f"{args.stat} of {args.repeats}"
    )
    header = f"{'shape':>14} {'prec':>5} {'ours ms':>9} {'torch ms':>9} {'floor ms':>9}"
    print(header + f" {'ours/torch':>10} {'ours/floor':>10}")
    for precision in args.precisions:
        for shape in shapes:
            t = bench_row(shape, precision, args.repeats, args.warmup, args.stat)
            name = "x".join(map(str, shape))
            ms = " ".join(f"{t[k] * 1e3:9.1f}" for k in ("ours", "torch", "floor"))
            ratios = f"{t['ours'] / t['torch']:10.2f} {t['ours'] / t['floor']:10.2f}"
            print(f"{name:>14} {precision:>5} {ms} {ratios}", flush=True)


if __name__ == "__main__":
    main()
