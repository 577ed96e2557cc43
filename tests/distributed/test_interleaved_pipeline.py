"""Interleaved pipelines (virtual stages) with Muon match one process, plain and with DistOpt.

A 4-layer tiny GPT with tied embeddings (the first and last stage each hold the word embeddings;
``finalize_model_grads`` sums their grads) trains at PP=2 x 2 virtual stages with the
pipeline-communication settings the CLI gives the model (``core_configs.transformer_config``
of a ``pretrain_gpt.py`` command line). Reproduce a case by hand:

    .venv/bin/python -m pytest tests/distributed/test_interleaved_pipeline.py -q
"""

import functools

import pytest
from cli_config import transformer_config
from harness import run_distributed
from parity import assert_close_runs
from tiny_gpt import TinyGPT, train

from megatron.training.muon_recipe import SEED_RECIPE

STEPS = 3
MUON = dict(optimizer="muon", muon_fp32_matmul_prec="highest", **SEED_RECIPE)
# As test_muon_parity.TOL: the layouts only reorder fp32 sums (measured ~5e-6 here; the
# activations and grads swapped between the two directions of a PP=2 exchange give ~1.4).
TOL, LOSS_RTOL = 1e-4, 1e-5
CLI = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 16 "
    "--max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 16 --train-iters 3 --lr 1e-2 --mock-data "
    "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
)
P2P_FIELDS = ("overlap_p2p_comm", "batch_p2p_comm")
NO_OVERLAP = "--no-overlap-p2p-communication"


def cli_spec(flags: str = "", world_size: int = 2) -> TinyGPT:
    """The tiny GPT with the pipeline-communication fields the CLI sets for ``CLI + flags``."""
    config = transformer_config((CLI + " " + flags).split(), world_size)
    p2p = {name: getattr(config, name) for name in P2P_FIELDS}
    return TinyGPT(num_layers=4, global_batch_size=16, tie_embeddings=True, extra=p2p)


@functools.cache
def reference():
    spec = TinyGPT(num_layers=4, global_batch_size=16, tie_embeddings=True)
    return run_distributed(train, 1, args=(spec, STEPS), kwargs=MUON)[0]


CASES = {  # (world size, CLI flags, train kwargs)
    "pp2_vpp2": (2, "", {}),
    "pp2_vpp2_dp2_distopt": (4, "", dict(distopt=True, bucket_size=6000, overlap=True)),
}


@pytest.mark.parametrize("case", CASES)
def test_interleaved_pp2_matches_one_process(case):
    world, flags, kwargs = CASES[case]
    spec = cli_spec(flags, world)
    got = run_distributed(train, world, pp=2, vpp=2, args=(spec, STEPS), kwargs={**MUON, **kwargs})
    errors = assert_close_runs(reference(), got, tol=TOL, loss_rtol=LOSS_RTOL)
    # every layer came from its virtual stage, and the tied embedding (both stages' copies
    # gathered under one name) trained as one process's
    assert sum(".linear_qkv." in k for k in errors) == 4
    assert "embedding.word_embeddings.weight" in errors and "output_layer.weight" not in errors


def test_upstreams_cli_refuses_pp2_virtual_stages_without_overlap():
    """Megatron-LM 0.19 refuses virtual stages at PP=2 without --overlap-p2p-communication
    (both neighbours are one rank). Should upstream allow it, CASES must run it."""
    with pytest.raises(AssertionError, match="pipeline-model-parallel size should be greate"):
        cli_spec(NO_OVERLAP, 2)
