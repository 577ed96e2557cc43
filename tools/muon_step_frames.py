#!/usr/bin/env python3
"""Python stack depth of one DistOpt Muon step (DP 2 gloo ranks, TP 1, no gangs).

    .venv/bin/python tools/muon_step_frames.py

Trains one step of the tests' tiny GPT (``--muon-impl megatron_muon``, byte-level DistOpt
layout: the exchange runs), then profiles the second ``optimizer.step()`` with
``sys.setprofile`` and prints, per rank, the deepest frame of ours (``megatron_muon/``,
``optimizer/muon.py``, ``repairs/``) counted from ``optimizer.step()`` (= 1), its chain of
functions, and the deepest frame of any Python code (torch and Megatron included).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

OURS = ("/megatron_muon/", "/optimizer/muon.py", "/optimizer/repairs/")


def _depth_below(frame, top) -> list:
    """The frames from ``top`` (exclusive) down to ``frame``, outermost first."""
    chain = []
    while frame is not None and frame is not top:
        chain.append(frame)
        frame = frame.f_back
    return chain[::-1] if frame is top else []


def _profiled(step, optimizer, holder: dict):
    """``step(optimizer)`` under a profiler keeping the deepest chains (into ``holder``)."""
    top = sys._getframe()
    deepest = {"ours": [], "any": []}

    def profile(frame, event, arg):
        if event != "call":
            return
        chain = _depth_below(frame, top)
        if len(chain) > len(deepest["any"]):
            deepest["any"] = chain
        if any(p in frame.f_code.co_filename for p in OURS) and len(chain) > len(deepest["ours"]):
            deepest["ours"] = chain

    sys.setprofile(profile)
    try:
        return step(optimizer)
    finally:
        sys.setprofile(None)
        for key, chain in deepest.items():
            holder[key] = [f"{Path(f.f_code.co_filename).name}:{f.f_code.co_name}" for f in chain]


def rank_run() -> dict:
    from tiny_gpt import TinyGPT, build_model, build_optimizer, global_batches, train_step

    from megatron.training.muon_recipe import SEED_RECIPE

    spec = TinyGPT()
    model = build_model(spec, distopt=True)
    optimizer = build_optimizer(
        spec, model, optimizer="muon", use_distributed_optimizer=True, **SEED_RECIPE
    )
    first, second = global_batches(spec, 2)
    train_step(spec, model, optimizer, first)
    step, holder = type(optimizer).step, {}
    optimizer.step = lambda: _profiled(step, optimizer, holder)
    train_step(spec, model, optimizer, second)
    return holder


def main() -> None:
    import conftest  # noqa: F401  CPU mode and threads, as the tests run
    from harness import run_distributed

    for rank, got in enumerate(run_distributed(rank_run, 2)):
        ours = got["ours"]
        print(f"rank {rank}: deepest frame of ours {len(ours)} below optimizer.step()")
        print("  " + " -> ".join(ours))
        print(f"  deepest Python frame {len(got['any'])}: ... {' -> '.join(got['any'][-4:])}")


if __name__ == "__main__":
    main()
