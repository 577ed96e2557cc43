"""MoE auxiliary-loss figures of --num-experts runs, as Megatron-LM's training_log reports them
through megatron-core's ``track_moe_metrics``: ``load_balancing_loss``,
``seq_load_balancing_loss``, ``global_load_balancing_loss`` (per --moe-router-load-balancing-type)
and ``z_loss`` (--moe-z-loss-coeff), each divided by its coefficient.

Each router adds its per-micro-batch loss to megatron-core's layer-wise tracker during training
forwards. Per loss: the layers summed over the pipeline stages, then over the loss's reduce group
(averaged over the data-parallel ranks where that group lacks them) and averaged over its average
group, scaled by 1 / micro-batches and averaged over the MoE layers (MTP layers included).
megatron-core's own reduction averages with ``ReduceOp.AVG``, which gloo lacks: here a SUM over
the group's size. Every rank joins (zeros on a stage without MoE layers); the tracker is zeroed
before each step, so evaluations in between add nothing.

With --moe-per-layer-logging also each layer's figure, as megatron-core's ``track_moe_metrics``
writes it: ``moe/<name>_layer_<i>`` = that layer's reduced loss / micro-batches, for every layer
of the tracker (decoder layers, then MTP's; 0 on a dense layer), kept for TensorBoard
(``per_layer_figures``, written every step as upstream writes them).
"""

import torch
from megatron.core.transformer.moe.moe_utils import (
    clear_aux_losses_tracker,
    get_moe_layer_wise_logging_tracker,
)

from megatron.core import parallel_state

from .flops import moe_layer_count


def track_names(args) -> list:
    """Megatron-LM's names for the losses its flags turn on (its containment test included:
    ``seq_aux_loss`` also names ``load_balancing_loss``, which stays 0 and is left out)."""
    kinds = args.moe_router_load_balancing_type
    names = [
        name
        for kind, name in (
            ("aux_loss", "load_balancing_loss"),
            ("seq_aux_loss", "seq_load_balancing_loss"),
            ("global_aux_loss", "global_load_balancing_loss"),
        )
        if kind in kinds
    ]
    return names + (["z_loss"] if args.moe_z_loss_coeff is not None else [])


_PER_LAYER: dict = {}  # the last step's --moe-per-layer-logging figures


def start_step() -> None:
    """Zero the tracker: the next step's forwards alone fill it."""
    clear_aux_losses_tracker()
    _PER_LAYER.clear()


def per_layer_figures() -> dict:
    """{``moe/<name>_layer_<i>``: value} of the step just run ({} without the flag)."""
    return dict(_PER_LAYER)


def moe_losses(args, num_microbatches: int, device) -> dict:
    """{name: value} of the step just run, for the losses that are on; {} without experts."""
    if args.num_experts is None:
        return {}
    layers = args.num_layers + (args.mtp_num_layers or 0)
    tracker = get_moe_layer_wise_logging_tracker()
    out = {}
    for name in track_names(args):
        entry = tracker.setdefault(name, {})
        if "values" not in entry:  # no MoE layer here: join the reductions with zeros
            entry.update(values=torch.zeros(layers, device=device), reduce_group=None)
        reduced = _reduced(entry)
        total = reduced.sum().item() / (num_microbatches * _moe_layers(args))
        if total > 0.0:  # Megatron-LM prints a loss only where it is positive
            out[name] = total
        if args.moe_per_layer_logging:
            _PER_LAYER.update(_layer_figures(name, reduced / num_microbatches))
    clear_aux_losses_tracker()
    return out


def _layer_figures(name: str, values: torch.Tensor) -> dict:
    return {f"moe/{name}_layer_{i}": v for i, v in enumerate(values.tolist())}


def _reduced(entry: dict) -> torch.Tensor:
    values = entry["values"].detach().clone()
    torch.distributed.all_reduce(values, group=parallel_state.get_pipeline_model_parallel_group())
    if entry.get("reduce_group") is not None:
        torch.distributed.all_reduce(values, group=entry["reduce_group"])
        if not entry.get("reduce_group_has_dp", False):
            _average(values, parallel_state.get_data_parallel_group())
    if entry.get("avg_group") is not None:
        _average(values, entry["avg_group"])
    return values


def _average(values: torch.Tensor, group) -> None:
    torch.distributed.all_reduce(values, group=group)
    values /= torch.distributed.get_world_size(group)


def _moe_layers(args) -> int:
    """MoE layers of the decoder (--moe-layer-freq) plus MTP's."""
    return moe_layer_count(args.num_layers, args.moe_layer_freq) + (args.mtp_num_layers or 0)
