"""Megatron-LM flags that this training stack knows but does not run yet, each with the reason.
Giving one is an error that says so (never a silent no-op); ``arguments.py`` consults this table
for flags that are not in its own. Moving a flag from here into the parser's table is how it
gets implemented.
"""

_TIMERS = "Megatron-LM's timers are not implemented here (the log line's elapsed time per "
_TIMERS += "iteration, tokens per second and --log-throughput are the timings reported)"
_CKPT = "not implemented in this stack's checkpointing yet (synchronous saves; torch_dist "
_CKPT += "with dp_reshardable DistOpt state; the format is taken from --ckpt-format)"
_MEMORY = "memory management flags are not implemented in this training loop yet"
_TOKENIZER = "only ByteLevelTokenizer, GPT2BPETokenizer, HuggingFaceTokenizer and NullTokenizer "
_TOKENIZER += "are implemented (sentencepiece and tiktoken tokenizers are not)"

REFUSED = {
    "--log-timers-to-tensorboard": _TIMERS,
    "--timing-log-level": _TIMERS,
    "--timing-log-option": _TIMERS,
    "--log-memory-to-tensorboard": "device memory figures are not implemented in the log yet",
    "--use-checkpoint-args": _CKPT,
    "--auto-detect-ckpt-format": _CKPT,
    "--dist-ckpt-strictness": _CKPT,
    "--ckpt-fully-parallel-save": _CKPT,
    "--ckpt-fully-parallel-load": _CKPT,
    "--async-save": _CKPT,
    "--dist-ckpt-optim-fully-reshardable": _CKPT,
    "--ckpt-assume-constant-structure": _CKPT,
    "--manual-gc": _MEMORY,
    "--manual-gc-interval": _MEMORY,
    "--empty-unused-memory-level": _MEMORY,
    "--deterministic-mode": "not implemented: this stack does not set deterministic algorithms "
    "(torch.use_deterministic_algorithms, NCCL_ALGO) for its ranks yet",
    "--per-split-data-args-path": "not implemented: give --train-data-path, --valid-data-path "
    "and --test-data-path on the command line instead",
    "--tiktoken-pattern": _TOKENIZER,
    "--tiktoken-num-special-tokens": _TOKENIZER,
    "--tiktoken-special-tokens": _TOKENIZER,
}


def reason(flag: str):
    """Why ``flag`` is refused, or None when it is not in the table."""
    return REFUSED.get(flag)
