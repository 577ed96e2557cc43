"""Checkpoints of megatron-muon's own training loop (base megatron-core 0.16.1) met by upstream's
loop (base 0.19.2).

Upstream's loop saves its arguments as an ``argparse.Namespace`` (``state_dict['args']``); ours on
0.16.1 saved a dict of the few it checks on load (``megatron/training/checkpointing.py``
``_saved_args`` there), with its own scheduler, RNG and rerun entries. Upstream reads that dict
with ``getattr``: its argument checks fail unnamed or pass on nothing, and the consumed samples
read back as 0. Patch ``0051-checkpoint-origin-0.16.1`` calls ``check_checkpoint_origin``
wherever upstream reads a checkpoint's args (``load_checkpoint``, ``check_checkpoint_args``,
``load_args_from_checkpoint``): such a checkpoint is refused in one line naming the version and
what to do, unless ``--finetune`` asks for its model weights only, which load unchanged (the
model's sharded keys are megatron-core's on both bases).
"""

__all__ = ["check_checkpoint_origin", "saved_by_our_0_16_1_loop"]


def saved_by_our_0_16_1_loop(checkpoint_args) -> bool:
    """Whether a checkpoint's ``args`` entry is our 0.16.1 loop's (a dict, not a Namespace)."""
    return isinstance(checkpoint_args, dict)


def check_checkpoint_origin(checkpoint_args, args, weights_only: bool = False) -> None:
    """Refuse a checkpoint of our 0.16.1 loop unless only its weights load (``weights_only``:
    the caller loads nothing else, as ``load_checkpoint`` under ``--finetune``).

    Raises:
        RuntimeError: one line naming megatron-core 0.16.1 and the two ways on.
    """
    if not saved_by_our_0_16_1_loop(checkpoint_args) or weights_only:
        return
    where = getattr(args, "load", None) or getattr(args, "pretrained_checkpoint", None)
    raise RuntimeError(
        f"checkpoint {where} was saved by megatron-muon's own training loop on megatron-core "
        "0.16.1, whose optimizer, scheduler and data state this loop (megatron-core 0.19.2) "
        "cannot resume: resume it with the 0.16.1 fork (make install; .venv's pretrain_gpt.py), "
        "or add --finetune to start from its model weights (iteration 0, a fresh optimizer)"
    )
