"""The seed's Muon recipe: one set of settings, not a default.

Upstream's defaults stay upstream's (``megatron/core/optimizer/muon_config.py``); the recipe the
seed trained with, and that our demo, benchmarks and exactness tests use, is spelled out here
once, as ``OptimizerConfig`` fields and as the equivalent ``pretrain_gpt.py`` flags (a test
checks that the flags parse to the fields):

* ``muon_matched_adamw_rms=0.2``: update scale 0.2 sqrt(max(m, n)), so AdamW's lr and weight
  decay carry over (Moonlight);
* ``muon_use_nesterov=True``, ``muon_momentum=0.95``;
* ``muon_coefficient_type='simple'``: Keller Jordan's Newton-Schulz coefficients;
* ``muon_tp_mode='duplicated'``: exact under tensor parallelism (the same numbers as TP=1).
"""

SEED_RECIPE = {
    "muon_matched_adamw_rms": 0.2,
    "muon_use_nesterov": True,
    "muon_momentum": 0.95,
    "muon_coefficient_type": "simple",
    "muon_tp_mode": "duplicated",
}

SEED_RECIPE_FLAGS = [
    "--muon-matched-adamw-rms", "0.2",
    "--muon-use-nesterov",
    "--muon-momentum", "0.95",
    "--muon-coefficient-type", "simple",
    "--muon-tp-mode", "duplicated",
]  # fmt: skip
