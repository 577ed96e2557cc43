"""--log-muon-figures (ours): what Muon costs per step, on the log line and in TensorBoard.

    muon NS time (ms)        Newton-Schulz (with the TP gathers of exact TP modes and the
                             Gram sums of a gang splitting a large matrix), per step
    muon exchange time (ms)  the DistributedOptimizer's two all-to-alls, per step (0 without)
    muon exchange bytes      bytes a rank sent plus received in the last step's all-to-alls
    muon gang bytes          bytes a rank sent plus received in the last step's gang collectives
                             (Gram sums, polynomial gathers; 0 without gangs; ring model:
                             MuonExchangePlan.sum_bytes_per_step)
    muon NS GFLOP            Newton-Schulz matmul FLOPs a rank executes per step (/1e9)

Each is the busiest rank's (max over the world). The exchange time is wall time in the
all-to-alls: it includes waiting for the slowest peer (owners finish their Newton-Schulz at
different times), so it shows load imbalance as well as the transfer. On an asynchronous device
each timer start/stop synchronizes it (per owned matrix for the NS timer): the figures cost a
little time while they are on. Times come from the ``muon-newton-schulz`` and
``muon-dp-exchange`` timers (``timers.py``; on for this flag whatever ``--timing-log-level``),
averaged over the log interval. Bytes are counted by the exchange itself from the split sizes it
handed to ``all_to_all_single`` (self-copies excluded), i.e. the exchange plan's count; FLOPs are
the plan's (``MuonExchangePlan.ns_flops_per_rank``; without DistOpt, every rank orthogonalizes
all its Muon params: ``tp_ns_cost`` per param for the TP mode).
"""

from megatron.core import parallel_state
from megatron.core.optimizer.muon_distopt import tp_ns_cost
from megatron.core.optimizer.muon_functional import EXCHANGE_TIMER, NS_TIMER
from megatron.core.optimizer.muon_optimizer import Muon

TIMERS = (NS_TIMER, EXCHANGE_TIMER)
# console name -> TensorBoard tag; timer tags follow Megatron-LM's "<timer>-time" (seconds)
TAGS = {
    "muon NS time (ms)": NS_TIMER + "-time",
    "muon exchange time (ms)": EXCHANGE_TIMER + "-time",
    "muon exchange bytes": "muon-dp-exchange-bytes",
    "muon gang bytes": "muon-dp-gang-bytes",
    "muon NS GFLOP": "muon-newton-schulz-flops",
}
FORMATS = {
    "muon NS time (ms)": "{:.2f}",
    "muon exchange time (ms)": "{:.2f}",
    "muon exchange bytes": "{:.0f}",
    "muon gang bytes": "{:.0f}",
    "muon NS GFLOP": "{:.6g}",
}
# TensorBoard gets seconds and FLOPs: console value x factor
TB_FACTORS = {"muon NS time (ms)": 1e-3, "muon exchange time (ms)": 1e-3, "muon NS GFLOP": 1e9}


def muon_optimizers(optimizer) -> list:
    """The ``Muon`` inner optimizers of Megatron's optimizer (chained or not)."""
    found = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, Muon):
            found.append(inner)
    return found


def plans(optimizer) -> list:
    """The exchange plans of Megatron's optimizer: one per DistributedOptimizer running Muon."""
    out = []
    for muon in muon_optimizers(optimizer):
        plan = getattr(muon.orthogonalizer, "plan", None)
        if plan is not None:
            out.append(plan)
    return out


def counted(optimizer) -> list:
    """[bytes the last step's exchange moved, bytes of its gang collectives, NS FLOPs per step]
    of this rank."""
    moved = gangs = flops = 0.0
    for muon in muon_optimizers(optimizer):
        orth = muon.orthogonalizer
        plan = getattr(orth, "plan", None)
        if plan is not None:  # DistOpt: owners run the NS
            moved += orth.bytes_moved
            gangs += orth.sum_bytes
            flops += plan.ns_flops_per_rank()[plan.rank]
        else:
            flops += _replicated_ns_flops(muon)
    return [moved, gangs, flops]


def _replicated_ns_flops(muon) -> float:
    """NS FLOPs of a rank that orthogonalizes all its Muon params itself (no DistOpt)."""
    specs = muon.ortho_specs()
    if not specs:
        return 0.0
    mode = muon.orthogonalizer.mode  # a TPOrthogonalizer: Megatron's Muon always has one
    total = 0.0
    for group in muon.param_groups:
        if group["use_muon"]:
            for param in group["params"]:
                info = muon.param_info[param]
                total += tp_ns_cost(info, specs[0].steps, mode, _tp_size(info))
    return total


def _tp_size(info) -> int:
    """Ranks the param is split over: (expert) TP for a TP-sharded param, else 1."""
    if getattr(info, "partition_dim", None) is None:
        return 1
    if getattr(info, "expert", False):
        return parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_world_size()


def figures(timer_ms: dict, counted_max: list) -> dict:
    """{console name: value} from the timers' per-step ms (max over ranks) and the busiest
    rank's counted [exchange bytes, gang bytes, FLOPs]."""
    return {
        "muon NS time (ms)": timer_ms.get(NS_TIMER, 0.0),
        "muon exchange time (ms)": timer_ms.get(EXCHANGE_TIMER, 0.0),
        "muon exchange bytes": counted_max[0],
        "muon gang bytes": counted_max[1],
        "muon NS GFLOP": counted_max[2] / 1e9,
    }


def tensorboard(values: dict) -> dict:
    return {TAGS[k]: v * TB_FACTORS.get(k, 1.0) for k, v in values.items()}
