"""The seed's Muon recipe: one set of settings, not a default.

Upstream's defaults stay upstream's (``megatron/core/optimizer/config.py``); the recipe the
seed trained with, and that our demo, benchmarks and exactness tests use, is spelled out here
once, as ``OptimizerConfig`` fields of the installed base, and as the ``pretrain_gpt.py`` flags
that set them (a test checks that the flags parse to the fields):

* ``muon_matched_adamw_rms=0.2``: update scale 0.2 sqrt(max(m, n)), so AdamW's lr and weight
  decay carry over (Moonlight);
* Nesterov (``muon_nesterov``), ``muon_momentum=0.95``;
* ``muon_coefficient_type='simple'``: Keller Jordan's Newton-Schulz coefficients;
* ``muon_tp_mode='duplicated'``: exact under tensor parallelism (the same numbers as TP=1);
* ``muon_impl='megatron_muon'``: this fork's Muon, not upstream's emerging-optimizers one,
  which ``optimizer='muon'`` builds by default.
"""


def _recipe() -> dict:
    return {
        "muon_impl": "megatron_muon",
        "muon_matched_adamw_rms": 0.2,
        "muon_nesterov": True,
        "muon_momentum": 0.95,
        "muon_coefficient_type": "simple",
        "muon_tp_mode": "duplicated",
    }


def _flags(recipe: dict) -> list:
    """Each field's flag is its name in dashes (a bare switch for True), as Megatron-LM names
    them."""
    flags = []
    for name, value in recipe.items():
        flag = "--" + name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


SEED_RECIPE = _recipe()
SEED_RECIPE_FLAGS = _flags(SEED_RECIPE)
