"""--use-checkpoint-args: the model's shape read from the checkpoint in --load, as Megatron-LM's
``load_args_from_checkpoint`` does, before the arguments are validated.

Upstream's rule per argument: an unforced one is taken from the checkpoint only where the command
line left it unset (None); a forced one replaces the command line's value. Either way a line
says what was taken. A value given on the command line that differs from an unforced one in the
checkpoint is then refused at load by the shape check, naming the flag. The parallel layout
(TP/PP sizes) stays the command line's (upstream takes it only with
--use-mp-args-from-checkpoint-args, which is refused here).
"""

import glob
import os

import torch

from .arguments import ArgumentsError

# (args dest, forced), in upstream's order; our checkpoints record every one (checkpointing.py).
FROM_CHECKPOINT = (
    ("num_layers", False),
    ("hidden_size", False),
    ("ffn_hidden_size", False),
    ("seq_length", False),
    ("num_attention_heads", False),
    ("num_query_groups", True),
    ("group_query_attention", True),
    ("kv_channels", False),
    ("max_position_embeddings", False),
    ("position_embedding_type", True),
    ("rotary_base", True),
    ("rotary_percent", True),
    ("rotary_interleaved", True),
    ("add_bias_linear", True),
    ("add_qkv_bias", True),
    ("squared_relu", True),
    ("swiglu", True),
    ("untie_embeddings_and_output_weights", True),
    ("layernorm_zero_centered_gamma", True),  # --apply-layernorm-1p
    ("normalization", True),
    ("apply_query_key_layer_scaling", True),
    ("attention_dropout", True),
    ("hidden_dropout", True),
    ("qk_layernorm", True),
    ("num_experts", True),
    ("moe_layer_freq", True),
    ("moe_ffn_hidden_size", True),
    ("moe_router_topk", True),
    ("moe_token_dispatcher_type", True),
    ("moe_router_pre_softmax", True),
    ("moe_shared_expert_intermediate_size", True),
    ("tokenizer_type", True),
    ("vocab_size", False),  # upstream restores padded_vocab_size, which is derived from it here
)


def _say(line: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # before process groups exist
        print(line, flush=True)


def saved_args(load: str):
    """(folder, the args dict recorded in --load's latest checkpoint), or (None, None)."""
    from . import checkpointing

    iteration = checkpointing.read_tracker(load)
    if iteration is None:
        return None, None
    folder = checkpointing.checkpoint_dir(load, iteration)
    if checkpointing.saved_format(folder) == "torch_dist":
        from megatron.core import dist_checkpointing

        common = dist_checkpointing.load_common_state_dict(folder)
    else:  # every model-parallel rank's file records the same args: read the first
        files = sorted(glob.glob(os.path.join(folder, "mp_rank_*", "model_optim_rng.pt")))
        if not files:
            raise ArgumentsError(f"--use-checkpoint-args: {folder} holds no checkpoint files")
        common = torch.load(files[0], map_location="cpu", weights_only=False)
    return folder, common.get("args", {})


def apply(args) -> None:
    """Fill ``args`` from the checkpoint in --load (before validation)."""
    if not args.load:
        raise ArgumentsError("--use-checkpoint-args needs --load (the checkpoint to read)")
    try:
        folder, saved = saved_args(args.load)
    except ArgumentsError:
        raise
    except Exception as err:  # unreadable: say which checkpoint and why, before any group exists
        raise ArgumentsError(f"--use-checkpoint-args: cannot read {args.load}: {err}") from err
    if folder is None:
        _say(" > --use-checkpoint-args: no checkpoint in --load; using the command line's values")
        return
    for dest, forced in FROM_CHECKPOINT:
        if not forced and getattr(args, dest, None) is not None:
            continue
        value = saved.get(dest)
        if value is None:
            _say(f" > --use-checkpoint-args: {folder} does not record {dest}")
            continue
        setattr(args, dest, value)
        _say(f" > setting {dest} to {value!r} from checkpoint")
