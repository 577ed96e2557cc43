"""megatron.core's jit_fuser compiles a fusion on its first call (patch 0020), so importing
megatron.core does not import torch's compiler stack (~2.5 s of CPU per process)."""

import subprocess
import sys

import torch

from megatron.core import jit
from megatron.core.lazy_compile import compile_on_first_call


def test_torch_compile_is_called_on_the_first_call_and_once(monkeypatch):
    made = []

    def fake_compile(fn):  # stands for torch.compile: records the call, returns a traced fn
        made.append(fn)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    monkeypatch.setattr(torch, "compile", fake_compile)

    def gelu_plus(x, y):
        return x + y

    fused = compile_on_first_call(gelu_plus)
    assert made == [] and fused.__name__ == "gelu_plus"  # decorating compiles nothing
    assert fused(1, 2) == ("compiled", 3) and fused(x=2, y=3) == ("compiled", 5)
    assert made == [gelu_plus]  # one torch.compile, reused


def test_jit_fuser_is_the_first_call_compiler():
    assert jit.jit_fuser is compile_on_first_call


def test_importing_the_gpt_stack_leaves_the_compiler_unimported():
    code = (
        "import sys, megatron.core.models.gpt, megatron.core.fusions.fused_bias_gelu; "
        "print('torch._inductor' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "False", done.stderr[-2000:]
