"""Run pretrain_gpt.py in this process and record, in order, the training steps, the garbage
collections (generation, whether automatic collection was on) and the device cache releases.

    python tests/e2e/memory_probe.py EVENTS.json pretrain_gpt.py FLAGS...

The CPU allocator has no ``empty_cache``; the probe gives ``torch.cpu`` one that only records,
so that the calls made for --empty-unused-memory-level are seen on a CPU run."""

import gc
import json
import runpy
import sys

import torch

import megatron.training.training as training

EVENTS = []


def _on_gc(phase, info):
    if phase == "start":
        EVENTS.append(["gc", info["generation"], gc.isenabled()])


def _step(*args, **kwargs):
    EVENTS.append(["step"])
    return _train_step(*args, **kwargs)


def main():
    out, script, *flags = sys.argv[1:]
    gc.callbacks.append(_on_gc)
    torch.cpu.empty_cache = lambda: EVENTS.append(["empty_cache"])
    sys.argv = [script, *flags]
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        EVENTS.append(["exit", gc.isenabled()])
        with open(out, "w") as f:
            json.dump(EVENTS, f)


_train_step, training.train_step = training.train_step, _step

if __name__ == "__main__":
    main()
