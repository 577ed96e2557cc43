"""PROJECTION (not a measurement): the least Newton-Schulz time any exact Muon could take per
step, in bench/projection.py's machine model, against the model step.

    .venv/bin/python bench/projection_floor.py

Two bounds, the larger is the floor:

* work: every NS block's FLOPs once, spread evenly over all GPUs at peak * mfu: the standard
  steps with each symmetric product (the Gram ``X X^T`` and ``G G``) computed as its triangle
  alone, ``k (3 g^2 l + g^3)`` for a ``g x l`` block (``least_flops``). Every exact schedule here
  runs more: one process ``k (4 g^2 l + 2 g^3)``, a split's members their Grams' upper triangles
  in blocks (``newton_schulz.upper_gram``, over half of each) and all of ``G G``;
* the slowest NS block (a matrix, or one Q, K or V block of a fused QKV weight: each is
  orthogonalized alone): split over ``k`` GPUs (any ``k`` up to the GPU count), each runs ``1 / k``
  of its FLOPs, and every NS step sums the block's Gram (``g x g``, ``g`` its short side) over the
  ``k`` (the sum every exact split here runs: ``functional.orthogonalize_sharded_steps``; no split
  avoids it, since each member's block contributes to every Gram element), its packed upper
  triangle at its cheapest, hierarchical: inside the node over NVLink the ``m`` members exchange
  their partials in the NS dtype (each is one GPU's NS-dtype matmul result, exact in it) and get
  the sums back in it (their consumer rounds to it): ``2 (m - 1) / m`` of the NS-dtype bytes;
  across the ``n`` nodes each GPU's ``1 / m`` slice, a sum of partials no longer exact in the NS
  dtype, is reduce-scattered in fp32 and gathered back in the NS dtype over its own link:
  ``(n - 1) / n`` of it at ``4 + ns`` bytes per element (the gangs' Gram sums: planner/gangs.py;
  before session 29 the floor took one fp32 all-reduce on both levels). A gathered block
  (``newton_schulz.gathers``) is the split over one GPU. Latency, the norm, the polynomial's
  gather, the exchange and padding are left out, so the floor is below what any schedule of ours
  (or LayerWise's) takes.
"""

import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import projection  # noqa: E402
from projection import MODELS, NS_STEPS, model_params  # noqa: E402

from megatron.core.optimizer.megatron_muon.functional import qkv_blocks  # noqa: E402
from megatron.core.optimizer.megatron_muon.newton_schulz import packed_size  # noqa: E402


def split_seconds(block: tuple[int, int], k: int, a) -> float:
    """The least time of one NS block's NS split over ``k`` GPUs: its FLOPs / k and, where
    ``k > 1``, one Gram sum per step, hierarchical over nodes (module docstring).

    Args:
        block: the block's (rows, cols): a matrix, or one Q, K or V block of a fused QKV weight.
        k: GPUs sharing it.
        a: ``projection.parse_args``' namespace (rates, links, GPUs per node).

    Returns:
        Seconds.
    """
    rate = a.peak_tflops * 1e12 * a.mfu
    gram, ns = packed_size(min(block)), a.ns_bytes
    m, n = min(k, a.gpus_per_node), -(-k // a.gpus_per_node)
    per_step = 2 * (m - 1) / m * gram * ns / (a.tp_link_gbps / 8 * 1e9)
    per_step += (n - 1) / n * gram / m * (4 + ns) / (a.link_gbps / 8 * 1e9)
    return least_flops(block) / k / rate + NS_STEPS * per_step


def least_flops(block: tuple[int, int]) -> float:
    """The fewest matmul FLOPs of the standard steps on a block (module docstring): per step
    half of the Gram, half of ``G G`` and all of ``p(G) X``, ``3 g^2 l + g^3``.

    Args:
        block: the block's (rows, cols).

    Returns:
        FLOPs over ``NS_STEPS`` steps.
    """
    g, lines = min(block), max(block)
    return float(NS_STEPS * (3 * g * g * lines + g**3))


def floor_row(model: str, dp: int, a) -> dict:
    """One row: the work bound, the slowest matrix's best split, the floor and its share of the
    model step (projection.py's ``6 N tokens / (gpus * peak * mfu)``).

    Args:
        model: a key of ``projection.MODELS``.
        dp: the data-parallel size.
        a: ``projection.parse_args``' namespace.

    Returns:
        The row's figures, seconds and a fraction.
    """
    cfg = MODELS[model]
    tp = cfg[-1]
    params = model_params(*cfg)
    every = [info for _, _, info in params if info is not None]
    blocks = {b for info in every for b in qkv_blocks(info)}  # Q, K and V apart: NS runs each alone
    gpus, rate = dp * tp, a.peak_tflops * 1e12 * a.mfu
    work = sum(least_flops(b) for info in every for b in qkv_blocks(info)) / gpus / rate
    splits = {b: min((split_seconds(b, k, a), k) for k in range(1, gpus + 1)) for b in blocks}
    shape, (slowest, k) = max(splits.items(), key=lambda item: item[1][0])
    total = sum(math.prod(s) * (tp if len(s) == 2 else 1) for _, s, _ in params)
    step = 6 * total * a.tokens / (gpus * rate)
    floor = max(work, slowest)
    return dict(
        model=model, tp=tp, dp=dp, work=work, shape=shape, k=k, slowest=slowest, floor=floor,
        step=step, share=floor / step,
    )  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    """projection.py's flags (the machine, the models, the DP sizes); its TP mode is not read."""
    return projection.parse_args(argv)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rows = [floor_row(m, dp, a) for m in a.models for dp in a.dps]
    print(
        f"PROJECTION (a lower bound): {a.peak_tflops:g} TFLOP/s x {a.mfu:g}, NVLink "
        f"{a.tp_link_gbps:g} Gb/s inside {a.gpus_per_node}-GPU nodes, {a.link_gbps:g} Gb/s "
        f"between, {a.tokens:,} tokens/step, {NS_STEPS} NS steps, Gram sums: "
        f"partials in {a.ns_bytes} B in a node, fp32 across nodes, back in {a.ns_bytes} B"
    )
    print(
        "| model | TP x DP (GPUs) | model step | work bound | slowest NS block: best split "
        "| floor | floor / step |\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['model']} | {r['tp']} x {r['dp']} ({r['tp'] * r['dp']}) "
            f"| {r['step'] * 1e3:.0f} ms | {r['work'] * 1e3:.1f} ms "
            f"| {r['shape'][0]} x {r['shape'][1]} over {r['k']} GPUs: {r['slowest'] * 1e3:.1f} ms "
            f"| {r['floor'] * 1e3:.1f} ms | {100 * r['share']:.2f}% |"
        )
    return rows


if __name__ == "__main__":
    main()
