"""PROJECTION (not a measurement): Muon's overhead per step under DistOpt at scale.

    .venv/bin/python bench/projection.py                 # markdown table, default assumptions
    .venv/bin/python bench/projection.py --mfu 0.3 --exchange-bytes 2

Counted, like the optimizer counts them: the Muon matrices of Llama-style GPTs (per layer: fused
QKV split per Q/K/V block, attention proj, SwiGLU fc1 [gate; up], fc2), Newton-Schulz FLOPs per
matrix = steps * (4 s^2 l + 2 s^3), s = min(m, n), l = max(m, n) (per Q/K/V block), and owners
from ``muon_distopt.assign_owners`` on ``muon_distopt.ns_cost`` (the same greedy and costs the
optimizer uses), so the busiest rank's NS work is max(~total / dp, its largest matrices) as it
would be.

Per GPU and step, with M the Muon momentum bytes of one TP rank (Muon params / tp * itemsize):
* model:    6 N tokens / (gpus * peak * mfu)
* ours:     NS = busiest owner's FLOPs / (peak * mfu) (duplicated TP mode: the owner's TP ranks
            each run the whole matrix); exchange = 2 all-to-alls, each moving per direction
            max(own shard M / dp, owned matrices' bytes) -> 2 * that / link
* baseline: NS = every matrix on every rank; exchange = all-gather of M: M (dp-1)/dp per
            direction / link.
Full-duplex links, no overlap of Muon with anything (an upper bound on the visible overhead),
no latency terms, TP traffic (NVLink, duplicated mode's gather of owned matrices) left out.
"""

import argparse

from megatron.core.optimizer.muon_distopt import assign_owners, ns_cost
from megatron.core.optimizer.muon_functional import MuonParamInfo

# name: (layers, hidden, ffn, heads, kv heads, vocab, tp); Llama 3.2 1B, Llama 3 8B / 70B shapes.
MODELS = {
    "1B": (16, 2048, 8192, 32, 8, 128256, 1),
    "8B": (32, 4096, 14336, 32, 8, 128256, 1),
    "70B": (80, 8192, 28672, 64, 8, 128256, 8),
}
DPS = (8, 64, 256, 1024)
NS_STEPS = 5


def muon_matrices(layers, hidden, ffn, heads, kv, vocab, tp) -> list[MuonParamInfo]:
    """The Muon matrices (global shapes, rows = outputs) of the whole model."""
    head_dim = hidden // heads
    qkv = MuonParamInfo(
        ((heads + 2 * kv) * head_dim, hidden), (heads // kv * head_dim, head_dim, head_dim)
    )
    layer = [
        qkv,
        MuonParamInfo((hidden, hidden)),
        MuonParamInfo((2 * ffn, hidden)),
        MuonParamInfo((hidden, ffn)),
    ]
    return layer * layers


def total_params(layers, hidden, ffn, heads, kv, vocab, tp) -> int:
    matrices = sum(
        m.shape[0] * m.shape[1] for m in muon_matrices(layers, hidden, ffn, heads, kv, vocab, tp)
    )
    return matrices + 2 * vocab * hidden  # untied embedding and output layer (AdamW)


def project(model: str, dp: int, a) -> dict:
    cfg = MODELS[model]
    tp = cfg[-1]
    infos = muon_matrices(*cfg)
    costs = [ns_cost(i, NS_STEPS) for i in infos]
    nbytes = [i.shape[0] * i.shape[1] * a.exchange_bytes / tp for i in infos]
    owners = assign_owners(costs, dp)  # as the optimizer does
    flops, owned = [0.0] * dp, [0.0] * dp
    for owner, c, b in zip(owners, costs, nbytes):
        flops[owner] += c
        owned[owner] += b
    rate = a.peak_tflops * 1e12 * a.mfu
    link = a.link_gbps / 8 * 1e9
    shard = sum(nbytes) / dp
    gpus = dp * tp
    return {
        "model": model,
        "params": total_params(*cfg),
        "tp": tp,
        "dp": dp,
        "gpus": gpus,
        "step": 6 * total_params(*cfg) * a.tokens / (gpus * rate),
        "ns": max(flops) / rate,
        "comm": 2 * max(shard, max(owned)) / link,
        "base_ns": sum(costs) / rate,
        "base_comm": sum(nbytes) * (dp - 1) / dp / link,
    }


def markdown(rows: list[dict]) -> str:
    head = (
        "| model | TP x DP (GPUs) | model step | ours: NS + exchange | ours overhead "
        "| gather-everything: NS + all-gather | baseline overhead |\n"
        "|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        ours = r["ns"] + r["comm"]
        base = r["base_ns"] + r["base_comm"]
        lines.append(
            f"| {r['model']} ({r['params'] / 1e9:.1f}B) | {r['tp']} x {r['dp']} ({r['gpus']}) "
            f"| {_ms(r['step'])} | {_ms(r['ns'])} + {_ms(r['comm'])} | {ours / r['step']:.1%} "
            f"| {_ms(r['base_ns'])} + {_ms(r['base_comm'])} | {base / r['step']:.1%} |"
        )
    return "\n".join(lines)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms" if seconds >= 0.01 else f"{seconds * 1e3:.1f} ms"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tflops", type=float, default=990.0, help="H100 bf16 dense")
    parser.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak")
    parser.add_argument("--link-gbps", type=float, default=400.0, help="per GPU, per direction")
    parser.add_argument("--tokens", type=int, default=4 * 1024 * 1024, help="global batch")
    parser.add_argument("--exchange-bytes", type=int, default=4, help="4 fp32 (default), 2 bf16")
    parser.add_argument("--dps", type=int, nargs="+", default=list(DPS))
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    a = parse_args(argv)
    rows = [project(m, dp, a) for m in MODELS for dp in a.dps]
    print(
        f"PROJECTION: {a.peak_tflops:g} TFLOP/s x {a.mfu:g} achieved (model and NS), "
        f"{a.link_gbps:g} Gb/s links, {a.tokens:,} tokens/step, exchange {a.exchange_bytes} B/elt, "
        f"{NS_STEPS} NS steps, no overlap"
    )
    print(markdown(rows))
    return rows


if __name__ == "__main__":
    main()
