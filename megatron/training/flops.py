"""Model FLOPs per iteration, as Megatron-LM counts them for ``throughput per GPU (TFLOP/s/GPU)``.

Every GEMM runs three times per step (forward, weight grad, input grad) at 2 FLOPs per
multiply-add: 6 x (multiply-adds per token) x tokens. Per token and layer (s = seq length,
h = hidden, q = kv_channels x heads, kv = kv_channels x query groups, f = ffn hidden size):

    attention  h (q + 2 kv) [qkv]  +  q s / 2 x 2 [QK^T and AV, causal half]  +  q h [proj]
    MLA        the low-rank projections instead of qkv, heads x (qk + rope dims) s / 2 and
               heads x v_head_dim s / 2 for the core attention, heads x v_head_dim x h [proj]
    MLP        h f x (3 with a gated linear unit (SwiGLU), else 2)
    MoE        h x (moe ffn x top-k + shared expert ffn) x (3 or 2)
    logits     h x padded vocab (once, after the last layer)

Norms, softmax, activations and the optimizer are left out, as upstream does; so is any
dropped token of MoE routing (top-k experts are counted for every token).
"""


def flops_per_iteration(config, seq_length: int, vocab: int, batch_size: int) -> float:
    """FLOPs of one iteration of ``batch_size`` sequences of ``config`` (a TransformerConfig)."""
    per_token_macs = _layers_macs(config, seq_length) + config.hidden_size * vocab
    return 6.0 * batch_size * seq_length * per_token_macs


def _layers_macs(config, seq_length: int) -> float:
    moe_layers = _moe_layer_count(config)
    dense_layers = config.num_layers - moe_layers
    attention = _attention_macs(config, seq_length) * config.num_layers
    return attention + dense_layers * _dense_mlp_macs(config) + moe_layers * _moe_macs(config)


def _gemms(config) -> int:
    # a gated linear unit stacks two h -> f GEMMs before the f -> h one
    return 3 if config.gated_linear_unit else 2


def _dense_mlp_macs(config) -> float:
    return config.hidden_size * config.ffn_hidden_size * _gemms(config)


def _moe_macs(config) -> float:
    routed = (config.moe_ffn_hidden_size or config.ffn_hidden_size) * config.moe_router_topk
    shared = config.moe_shared_expert_intermediate_size or 0
    return config.hidden_size * (routed + shared) * _gemms(config)


def _moe_layer_count(config) -> int:
    if not config.num_moe_experts:
        return 0
    return moe_layer_count(config.num_layers, config.moe_layer_freq)


def moe_layer_count(num_layers: int, freq) -> int:
    """MoE layers of the decoder by --moe-layer-freq: every ``freq``-th layer, or a 0/1 list."""
    if isinstance(freq, int):
        return sum(1 for i in range(num_layers) if i % freq == 0)
    return sum(freq)


def _attention_macs(config, s: int) -> float:
    h, heads = config.hidden_size, config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) and hasattr(config, "qk_pos_emb_head_dim"):
        return _mla_macs(config, s)
    q = config.kv_channels * heads
    kv = config.kv_channels * (config.num_query_groups or heads)
    return h * (q + 2 * kv) + q * s + q * h


def _mla_macs(config, s: int) -> float:
    h, heads = config.hidden_size, config.num_attention_heads
    qk, rope, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
    if config.q_lora_rank is None:
        q_proj = h * heads * (qk + rope)
    else:
        q_proj = config.q_lora_rank * (h + heads * (qk + rope) + 1)
    kv_proj = config.kv_lora_rank * (h + heads * (qk + v) + 1) + h * rope
    core = s * heads * (qk + rope) / 2 + s * heads * v / 2
    return q_proj + kv_proj + core + heads * v * h
