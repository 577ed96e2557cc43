"""Model flags reach the built model: the CLI's own parse_args, transformer_config and
pretrain_gpt.model_provider on one gloo rank, then the GPTModel is inspected (not only args).

    .venv/bin/python -m pytest -q tests/unit/test_model_flags.py
"""

import importlib.util
import os

import pytest

from tests.harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 "
    "--micro-batch-size 2 --train-iters 1 --lr 1e-3 --mock-data --vocab-size 64"
).split()


def _pretrain_gpt():
    spec = importlib.util.spec_from_file_location(
        "pretrain_gpt", os.path.join(ROOT, "pretrain_gpt.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(flags: str):
    """(args, GPTModel) as pretrain_gpt.py builds them, on the calling rank."""
    from megatron.training.arguments import parse_args
    from megatron.training.core_configs import transformer_config

    main = _pretrain_gpt()
    args = parse_args(BASE + flags.split(), world_size=1)
    args.padded_vocab_size = 128
    return args, main.model_provider(args, transformer_config(args))


def _norm_facts(flags: str) -> dict:
    _, model = _build(flags)
    attention = model.decoder.layers[0].self_attention
    return {
        "input_eps": model.decoder.layers[0].input_layernorm.eps,
        "final_eps": model.decoder.final_layernorm.eps,
        "q_eps": getattr(getattr(attention, "q_layernorm", None), "eps", None),
        "k_eps": getattr(getattr(attention, "k_layernorm", None), "eps", None),
    }


def _mlp_activation(flags: str) -> list:
    """The MLP's activation on fixed inputs (what the built layer computes)."""
    import torch

    _, model = _build(flags)
    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 2.0])
    return model.decoder.layers[0].mlp.activation_func(x).tolist()


def _rotary_dims(flags: str) -> int:
    _, model = _build(flags)
    return 2 * model.rotary_pos_emb.inv_freq.numel()  # channels RoPE rotates per head


def _losses_fused_and_unfused(flags: str) -> tuple:
    """Per-token losses of one model with the fused cross-entropy path, then the unfused one."""
    import torch

    _, model = _build(flags)
    assert model.config.cross_entropy_loss_fusion
    model.eval()  # no dropout: both passes see the same logits
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (2, 16), generator=gen)
    labels = torch.randint(0, 64, (2, 16), generator=gen)
    position_ids = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        fused = model(tokens, position_ids, None, labels=labels)
        model.config.cross_entropy_loss_fusion = False
        unfused = model(tokens, position_ids, None, labels=labels)
    return fused, unfused


def _one_rank(fn, flags):
    return run_distributed(fn, 1, args=(flags,))[0]


def test_norm_epsilon_and_qk_layernorm():
    facts = _one_rank(_norm_facts, "--norm-epsilon 1e-6 --qk-layernorm")
    assert facts == {"input_eps": 1e-6, "final_eps": 1e-6, "q_eps": 1e-6, "k_eps": 1e-6}
    plain = _one_rank(_norm_facts, "")
    assert plain["input_eps"] == 1e-5 and plain["q_eps"] is None  # Megatron-LM's defaults


def test_squared_relu_is_the_mlp_activation():
    assert _one_rank(_mlp_activation, "--squared-relu") == [0.0, 0.0, 0.0, 0.25, 4.0]
    gelu = _one_rank(_mlp_activation, "")
    assert gelu[0] < 0 and gelu[4] == pytest.approx(1.9545, abs=1e-4)  # the default: GeLU


def test_rotary_percent_sets_the_rotated_channels():
    rope = "--position-embedding-type rope"
    assert _one_rank(_rotary_dims, rope) == 8  # kv channels = 32 / 4 heads
    assert _one_rank(_rotary_dims, rope + " --rotary-percent 0.5") == 4


def test_cross_entropy_loss_fusion_gives_the_unfused_numbers():
    fused, unfused = _one_rank(_losses_fused_and_unfused, "--cross-entropy-loss-fusion")
    # Same math, different op order (fused log-sum-exp vs torch's cross entropy): fp32 rounding.
    assert fused.shape == unfused.shape == (2, 16)
    assert (fused - unfused).abs().max().item() < 1e-5


def _norm_weights(model) -> dict:
    return {name: p for name, p in model.named_parameters() if name.endswith("layernorm.weight")}


def _layernorm_1p_facts(flags: str) -> dict:
    """A model with --apply-layernorm-1p against one without, given the same params except each
    norm weight w stored as gamma = w - 1: their logits must agree (and differ when gamma is
    not shifted: the negative control)."""
    import torch

    _, plain = _build(flags)
    _, shifted = _build(flags + " --apply-layernorm-1p")
    init = {n: p.abs().max().item() for n, p in _norm_weights(shifted).items()}
    with torch.no_grad():
        for p in _norm_weights(plain).values():
            p.uniform_(0.5, 1.5)  # a scale away from 1, so gamma matters
        state = plain.state_dict()
        copied = {k: v - 1 if k.endswith("layernorm.weight") else v for k, v in state.items()}
        shifted.load_state_dict(copied)
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        position_ids = torch.arange(16).expand(2, 16)
        plain.eval(), shifted.eval()
        reference = plain(tokens, position_ids, None)
        same = shifted(tokens, position_ids, None)
        shifted.load_state_dict(state)  # gamma = w: the scale becomes 1 + w
        control = shifted(tokens, position_ids, None)
    return {
        "init": init,
        "diff": (same - reference).abs().max().item(),
        "control": (control - reference).abs().max().item(),
    }


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_apply_layernorm_1p_reaches_the_local_norms(normalization):
    facts = _one_rank(_layernorm_1p_facts, f"--normalization {normalization} --qk-layernorm")
    # every norm (input, pre-MLP, q/k, final) starts at gamma = 0, i.e. scale 1
    assert len(facts["init"]) == 2 * 4 + 1 and set(facts["init"].values()) == {0.0}
    # 1 + (w - 1) vs w: fp32 rounding of the scale only
    assert facts["diff"] < 1e-5 and facts["control"] > 1e-2


def _interleaved_rope_facts(flags: str) -> dict:
    """--rotary-interleaved rotates channel pairs (2i, 2i+1); the half-split RoPE rotates
    (i, i + d/2). Attention scores sum over channels, so an interleaved model equals a half-split
    one whose query and key rows are reordered per head as [0, 2, .., d-2, 1, 3, .., d-1]
    (same values elsewhere); the unpermuted copy is the negative control."""
    import torch

    _, interleaved = _build(flags + " --rotary-interleaved")
    _, half = _build(flags)
    assert interleaved.config.rotary_interleaved and not half.config.rotary_interleaved
    d, heads = 8, 4  # kv channels (32 / 4), heads; no GQA: linear_qkv rows are [q k v] per head
    order = list(range(0, d, 2)) + list(range(1, d, 2))
    rows = []
    for head in range(heads):
        base = head * 3 * d
        rows += [base + i for i in order] + [base + d + i for i in order]
        rows += list(range(base + 2 * d, base + 3 * d))
    state = interleaved.state_dict()
    permuted = {
        k: v[rows] if k.endswith("linear_qkv.weight") or k.endswith("linear_qkv.bias") else v
        for k, v in state.items()
    }
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).expand(2, 16)
    interleaved.eval(), half.eval()
    with torch.no_grad():
        reference = interleaved(tokens, position_ids, None)
        half.load_state_dict(permuted)
        same = half(tokens, position_ids, None)
        half.load_state_dict(state)
        control = half(tokens, position_ids, None)
    return {
        "diff": (same - reference).abs().max().item(),
        "control": (control - reference).abs().max().item(),
    }


def test_rotary_interleaved_reaches_the_attention():
    facts = _one_rank(_interleaved_rope_facts, "--use-rotary-position-embeddings")
    # the same products summed in another channel order: fp32 rounding only (measured ~6e-8);
    # the unpermuted copy is off by ~6e-4 at this tiny init scale
    assert facts["diff"] < 1e-6 and facts["control"] > 1e-4


def test_use_rotary_position_embeddings_is_rope():
    from megatron.training.arguments import ArgumentsError, parse_args

    args = parse_args(BASE + ["--use-rotary-position-embeddings"], world_size=1)
    assert args.position_embedding_type == "rope"
    with pytest.raises(ArgumentsError, match="means --position-embedding-type rope, but none"):
        parse_args(
            BASE + "--use-rotary-position-embeddings --position-embedding-type none".split(), 1
        )


def _gated_mlp_output(flags: str) -> dict:
    """The built first layer's MLP on a fixed input, with zero biases, against the GLU formula
    act(clamp(x Wg)) * (clamp(x Wl) + offset) Wo (TP=1: linear_fc1's rows are [gate; linear])."""
    import torch

    args, model = _build(flags)
    mlp = model.decoder.layers[0].mlp
    with torch.no_grad():
        for name, p in mlp.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0, 1, generator=torch.Generator().manual_seed(len(name)))
        x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(1))
        out, bias = mlp(x)
        out = out + (bias if bias is not None else 0)
        gate, linear = (x @ mlp.linear_fc1.weight.t()).chunk(2, dim=-1)
        clamp = args.activation_func_clamp_value
        if clamp is not None:
            gate, linear = gate.clamp(max=clamp), linear.clamp(-clamp, clamp)
        hidden = mlp.config.activation_func(gate) * (linear + args.glu_linear_offset)
        expected = hidden @ mlp.linear_fc2.weight.t()
    return {"diff": (out - expected).abs().max().item(), "scale": expected.abs().max().item()}


@pytest.mark.parametrize(
    "flags",
    [
        "--swiglu --glu-linear-offset 1.0 --activation-func-clamp-value 2.0",
        "--quick-geglu --glu-linear-offset 0.5",
        "--swiglu",  # the plain GLU through the same formula: the reference itself is right
    ],
)
def test_glu_offset_and_clamp_reach_the_mlp(flags):
    facts = _one_rank(_gated_mlp_output, flags)
    # the same fp32 matmuls in the same order: exact up to rounding of O(scale) values
    assert facts["diff"] <= 1e-5 * max(1.0, facts["scale"])


def test_glu_flags_need_a_gated_mlp():
    from megatron.training.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError, match="act on a gated MLP: add --swiglu or --quick-geglu"):
        parse_args(BASE + ["--glu-linear-offset", "1"], world_size=1)
    with pytest.raises(ArgumentsError, match="--activation-func-clamp-value must be > 0, got -1"):
        parse_args(BASE + ["--swiglu", "--activation-func-clamp-value", "-1"], world_size=1)


def _init_facts(flags: str) -> dict:
    """max |w| over the bound xavier_uniform draws from, sqrt(6 / (fan_in + fan_out))."""
    _, model = _build(flags)
    layer = model.decoder.layers[0]
    weights = {
        "qkv": layer.self_attention.linear_qkv.weight,
        "fc1": layer.mlp.linear_fc1.weight,
        "embedding": model.embedding.word_embeddings.weight,
        "proj": layer.self_attention.linear_proj.weight,  # an output layer
    }
    return {k: w.abs().max().item() / (6 / sum(w.shape)) ** 0.5 for k, w in weights.items()}


def test_init_method_xavier_uniform_reaches_the_weights():
    xavier = _one_rank(_init_facts, "--init-method-xavier-uniform")
    normal = _one_rank(_init_facts, "")
    # uniform in [-bound, bound]: thousands of draws come within 2% of the bound, never past it
    assert all(0.98 < xavier[k] <= 1.0 for k in ("qkv", "fc1", "embedding")), xavier
    # normal(0, 0.02) stays far inside those bounds (~4 sigma = 0.08 against ~0.2), and the
    # output layers keep their scaled normal init with the flag too (Megatron-LM's choice)
    assert all(v < 0.5 for v in normal.values()) and xavier["proj"] < 0.5, (normal, xavier)


def test_padded_vocab_size_sets_the_embedding_rows():
    from megatron.training.arguments import ArgumentsError, parse_args

    main = _pretrain_gpt()
    args = parse_args(BASE + ["--padded-vocab-size", "200"], world_size=1)
    assert main.model_vocab_size(args, 65) == 200  # used as given, not rounded to 128s
    assert main.model_vocab_size(parse_args(BASE, world_size=1), 65) == 128
    with pytest.raises(ArgumentsError, match="--padded-vocab-size \\(60\\) is smaller than"):
        main.model_vocab_size(parse_args(BASE + ["--padded-vocab-size", "60"], 1), 65)
    with pytest.raises(ArgumentsError, match="divisible by --tensor-model-parallel-size \\(2\\)"):
        parse_args(BASE + "--padded-vocab-size 201 --tensor-model-parallel-size 2".split(), 2)
    facts = _one_rank(_embedding_rows, "--padded-vocab-size 200")
    assert facts == (200, 200)  # the built embedding's rows and the logits' width


def _embedding_rows(flags: str) -> tuple:
    import torch

    from megatron.training.arguments import parse_args
    from megatron.training.core_configs import transformer_config

    main = _pretrain_gpt()
    args = parse_args(BASE + flags.split(), world_size=1)
    args.padded_vocab_size = main.model_vocab_size(args, 65)
    model = main.model_provider(args, transformer_config(args))
    tokens = torch.zeros(1, 16, dtype=torch.long)
    with torch.no_grad():
        logits = model(tokens, torch.arange(16).unsqueeze(0), None)
    return model.embedding.word_embeddings.weight.shape[0], logits.shape[-1]


def _no_rope_facts(flags: str) -> dict:
    """--no-rope-freq 1 (every layer NoPE) with RoPE must give a position-free model's logits
    (--position-embedding-type none, the same params); RoPE on every layer is the control."""
    import torch

    _, nope = _build(flags + " --position-embedding-type rope --no-rope-freq 1")
    _, free = _build(flags + " --position-embedding-type none")
    _, rope = _build(flags + " --position-embedding-type rope")
    free.load_state_dict(nope.state_dict())
    rope.load_state_dict(nope.state_dict())
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    position_ids = torch.arange(16).expand(2, 16)
    out = {}
    with torch.no_grad():
        for name, model in (("nope", nope), ("free", free), ("rope", rope)):
            model.eval()
            out[name] = model(tokens, position_ids, None)
    _, every_2nd = _build(flags + " --position-embedding-type rope --no-rope-freq 2")
    return {
        "diff": (out["nope"] - out["free"]).abs().max().item(),
        "control": (out["rope"] - out["free"]).abs().max().item(),
        "pattern": list(every_2nd.config.no_rope_freq),
    }


def test_no_rope_freq_skips_rope_in_the_chosen_layers():
    facts = _one_rank(_no_rope_facts, "")
    assert facts["diff"] == 0.0 and facts["control"] > 1e-4  # same ops with RoPE skipped
    assert facts["pattern"] == [0, 1]  # layer 2 of 2 is NoPE


def test_no_rope_freq_needs_rope():
    from megatron.training.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError, match="--no-rope-freq picks layers that skip RoPE"):
        parse_args(BASE + ["--no-rope-freq", "2"], world_size=1)


def _tokens_per_expert(flags: str) -> list:
    """How many tokens the first MoE layer's router sends to each expert (64 tokens, top-2)."""
    import torch

    _, model = _build("--num-experts 4 --moe-router-topk 2 " + flags)
    router = model.decoder.layers[0].mlp.router
    x = torch.randn(16, 4, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, routing_map = router(x)
    return routing_map.sum(0).tolist()


def test_moe_pad_expert_input_to_capacity_fills_every_expert():
    capacity = "--moe-expert-capacity-factor 1.0"
    padded = _one_rank(_tokens_per_expert, capacity + " --moe-pad-expert-input-to-capacity")
    dropped = _one_rank(_tokens_per_expert, capacity)
    # capacity = 64 tokens x top-2 / 4 experts x factor 1.0 = 32: padded up to it everywhere;
    # without padding only dropped down to it, so some expert gets fewer (the negative control)
    assert padded == [32] * 4 and max(dropped) <= 32 and min(dropped) < 32


def test_moe_pad_expert_input_to_capacity_needs_a_capacity():
    from megatron.training.arguments import ArgumentsError, parse_args

    with pytest.raises(ArgumentsError, match="needs --moe-expert-capacity-factor"):
        parse_args(BASE + "--num-experts 4 --moe-pad-expert-input-to-capacity".split(), 1)
