"""``torch.compile`` applied on a function's first call instead of at decoration.

``megatron.core.jit.jit_fuser`` decorates a few dozen fusions at import time. ``torch.compile``
compiles lazily anyway, but it resolves its backend when it decorates, which imports
``torch._inductor`` and ``torch._dynamo``: about 2.5 s of CPU per process (measured on torch
2.13), twice the cost of importing torch, paid by every rank even when no fused function runs.
Deferring the ``torch.compile`` call to the first call keeps what is compiled and when it is
compiled (its first call) unchanged and moves that import to the first process that needs it.
"""

import functools

import torch


def compile_on_first_call(fn):
    """Decorator: ``torch.compile(fn)`` made on the first call, then reused for every call."""
    compiled = None

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return wrapper
