"""The shapes of the hybrid benchmark models (`hybrid_bench.py`): transformers config keyword
arguments, random weights, each model's real vocabulary size (the LM head dominates a small
model).

- `JAMBA_CONFIG`: a Jamba of about 310M parameters (hidden 1024, 8 layers, attention at layer 4).
- `GRANITE_CONFIG`: the dense Granite 4.0-H shape (`granite-4.0-h-350m` / `-1b`), about 306M.
- `QWEN3_5_CONFIG`: Qwen3.5-0.8B's text model (the smallest Qwen3.5 release): hidden 1024,
  24 layers, gated attention every 4th (8 query and 2 key/value heads of 256, partial rotary
  0.25, theta 1e7), Gated DeltaNet elsewhere (16 key and 16 value heads of 128, conv 4), dense
  SwiGLU of 3584, vocabulary 248,320, tied head: about 0.75B parameters.
- `QWEN3_NEXT_CONFIG`: Qwen3-Next-80B-A3B's layout scaled to about 1B: hidden 1024, 12 layers,
  attention every 4th (8 query / 2 key-value heads of 256), Gated DeltaNet with 8 key and 16
  value heads of 128, 64 experts of 256 with top-8 routing and a gated shared expert of 512 in
  every layer, vocabulary 151,936, untied head.
- `LFM2_CONFIG`: LFM2-1.2B as published: hidden 2048, 16 layers, grouped-query attention at
  layers 2, 5, 8, 10, 12, 14 (32 query and 8 key/value heads of 64, RoPE theta 1e6), gated
  short convolutions of width 3 elsewhere, SwiGLU of 8,192 (12,288 auto-adjusted), vocabulary
  65,536, tied head: about 1.17B parameters.
- `LFM3_CONFIG`: LFM3-1.7B (transformers' defaults): short convolutions, sliding-window and
  full attention with a per-head gate, 1.7B parameters.
- `ZAYA_CONFIG`: ZAYA1-8B's real layer shapes with 4 of its 40 layers (CCA, top-1 MoE of 16
  experts), 1.4B parameters.
- `KIMI_LINEAR_CONFIG`: Kimi-Linear-48B-A3B's layout scaled to about 1B: hidden 1024, 12
  layers, MLA every 4th (8 heads; latent 512 + 64, nope 128, v 128, no rotary), KDA in the
  others (8 heads of 128, conv 4), a dense first layer (SwiGLU of 4096), then MoEs of 64 experts
  of 256 with top-8 sigmoid routing (scaled by 2.446) and a shared expert, vocabulary 163,840,
  untied head. Saved with the checkpoints' own `linear_attn_config` and `first_k_dense_replace`
  (which llama.cpp's converter reads; `KIMI_SHIPPED_KEYS`).
- `LING_CONFIG`: Ling-3.0-Flash's layout scaled to about 1B as Kimi's: hidden 1024, 12 layers
  in groups of 6 (MLA last in each: 8 heads, latent 512 + 64 with interleaved RoPE at theta 6e6,
  nope 128, v 128, a sigmoid gate per head), KDA with the safe gate (bound -5) in the others (8
  heads of 128, conv 4), two dense first layers (SwiGLU of 4096), then MoEs of 64 experts of 256
  in 8 groups (4 kept) with top-8 sigmoid routing (scaled by 2.5) and a shared expert,
  vocabulary 157,184, untied head.
- `GLM5_NEXT_CONFIG`: GLM-5.3-Flash's real layer shapes with 2 of its 45 layers (a KDA and a
  DSA layer, both with the dense SwiGLU of 12,288 of its first layers): hidden 4096, KDA 64 heads
  of 128 with the safe gate, MLA 64 heads (q rank 1536, latent 512, nope 256, v 256, no RoPE),
  an indexer of 32 heads of 128 selecting 2048 tokens in pools of 16 plus the tail, 4 mHC
  streams, vocabulary 154,880, untied head: 1.9B parameters, saved in bfloat16.
- `QWEN4_EXP_CONFIG`: Qwen3.8-Flash-Next's real layer shapes (transformers' Qwen4-Exp defaults)
  with 4 of its 40 layers (3 GDN, then indexed attention) and 64 of its 512 experts: hidden 2048,
  GDN 16 key and 32 value heads of 128, attention 16 query and 2 key/value heads of 256 (partial
  RoPE 0.25), a QSA indexer of 32 heads of 128 keeping 2048 tokens in blocks of 16 plus the tail,
  experts of 512 (top-10) and a gated shared expert of 512, 4 streams (rank 320), n-gram
  embeddings on the first layer with tables of 100,000 rows per head instead of the release's
  20,000,000 (the release's tables alone hold 41B parameters a layer), vocabulary 248,320: 2.2B
  parameters.
"""

from __future__ import annotations

JAMBA_CONFIG = dict(
    vocab_size=65536,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    attn_layer_period=8,
    attn_layer_offset=4,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)
GRANITE_CONFIG = dict(
    vocab_size=100352,
    hidden_size=768,
    num_hidden_layers=28,
    layer_types=["attention" if i % 7 == 6 else "mamba" for i in range(28)],
    num_attention_heads=12,
    num_key_value_heads=4,
    position_embedding_type=None,
    num_local_experts=0,
    num_experts_per_tok=0,  # as the dense Granite 4.0-H configs (llama.cpp asserts it)
    shared_intermediate_size=2048,
    intermediate_size=2048,  # llama.cpp sizes the dense MLP by it; transformers by the shared one
    mamba_n_heads=24,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    embedding_multiplier=12.0,
    attention_multiplier=0.015625,
    residual_multiplier=0.246,
    logits_scaling=3.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
QWEN3_5_CONFIG = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(24)],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
QWEN3_NEXT_CONFIG = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=12,
    layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(12)],
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=8,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=64,
    num_experts_per_tok=8,
    moe_intermediate_size=256,
    shared_expert_intermediate_size=512,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)

# Qwen3.6-35B-A3B's (and Qwen3.5-35B-A3B's) layer shapes: hidden 2048, 256 experts of 512 (top 8)
# plus a 512-wide shared expert, Gated DeltaNet with 16 key / 32 value heads of 128, attention
# with 16 query / 2 key-value heads of 256; four of its 40 layers (three linear, one attention,
# its 3:1 pattern), saved in bfloat16 (about 4.3B parameters, 8.5 GB).
QWEN3_6_MOE_CONFIG = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=4,
    layer_types=["full_attention" if i % 4 == 3 else "linear_attention" for i in range(4)],
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    num_experts=256,
    num_experts_per_tok=8,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10_000_000.0,
        "partial_rotary_factor": 0.25,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)

LFM2_CONFIG = dict(
    vocab_size=65536,
    hidden_size=2048,
    intermediate_size=12288,
    num_hidden_layers=16,
    layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)],
    num_attention_heads=32,
    num_key_value_heads=8,
    conv_L_cache=3,
    conv_bias=False,
    block_multiple_of=256,
    block_ffn_dim_multiplier=1.0,
    block_auto_adjust_ff_dim=True,
    norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
# LFM3-1.7B as transformers 5.24's defaults give it: hidden 2048, 24 layers (13 short convs of
# width 3, 5 sliding-window attention layers of 256 tokens with default RoPE, 6 full ones with
# proportional RoPE), 16 query and 4 key/value heads of 128 with a per-head gate and sandwich
# norms, SwiGLU of 7680, vocabulary 128,000, tied head: about 1.7B parameters.
LFM3_CONFIG = dict(vocab_size=128_000, max_position_embeddings=8192)
# ZAYA1-8B's layer shapes (transformers' defaults: hidden 2048, CCA with 8 query and 2 KV heads
# of 128, 16 experts of 2048 with a top-1 MLP router, vocabulary 262,272, tied head) with 4 of
# its 40 layers: 1.4B parameters, 2.8 GB in bfloat16.
ZAYA_CONFIG = dict(
    vocab_size=262_272,
    num_hidden_layers=4,
    layer_types=["hybrid"] * 4,
    max_position_embeddings=8192,
)
_KIMI_FULL = (4, 8, 12)  # 1-indexed, as the checkpoints list them
KIMI_LINEAR_CONFIG = dict(
    vocab_size=163840,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=12,
    layer_types=[
        "full_attention" if i + 1 in _KIMI_FULL else "linear_attention" for i in range(12)
    ],
    mlp_layer_types=["dense"] + ["sparse"] * 11,
    linear_num_heads=8,
    linear_head_dim=128,
    linear_conv_kernel_dim=4,
    num_attention_heads=8,
    num_key_value_heads=8,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_local_experts=64,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    moe_intermediate_size=256,
    n_shared_experts=1,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
KIMI_SHIPPED_KEYS = dict(
    linear_attn_config={
        "full_attn_layers": list(_KIMI_FULL),
        "kda_layers": [i for i in range(1, 13) if i not in _KIMI_FULL],
        "head_dim": 128,
        "num_heads": 8,
        "short_conv_kernel_size": 4,
    },
    first_k_dense_replace=1,
    moe_router_activation_func="sigmoid",
    mla_use_nope=True,
)
LING_CONFIG = dict(
    vocab_size=157184,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=12,
    layer_group_size=6,
    first_k_dense_replace=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=128,
    short_conv_kernel_size=4,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    rope_theta=6_000_000.0,
    num_experts=64,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    moe_intermediate_size=256,
    num_shared_experts=1,
    num_nextn_predict_layers=0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
GLM5_NEXT_CONFIG = dict(
    vocab_size=154880,
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=2,
    layer_types=["linear_attention", "indexed_attention"],
    indexer_types=["full", "full"],
    mlp_layer_types=["dense", "dense"],
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=256,
    qk_rope_head_dim=0,
    v_head_dim=256,
    index_topk=2048,
    index_head_dim=128,
    index_n_heads=32,
    index_kpool=16,
    linear_head_dim=128,
    linear_num_heads=64,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    hc_mult=4,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=2048,
    swiglu_limit=10.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    max_position_embeddings=65536,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
    vision_config=dict(depth=1, hidden_size=64, num_heads=2, intermediate_size=64),
)
QWEN4_EXP_CONFIG = dict(
    vocab_size=248320,
    hidden_size=2048,
    num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["indexed_attention"],
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=64,
    num_experts_per_tok=10,
    hc_count=4,
    hc_lowrank=320,
    ple_layer_ids=[1],
    ple_embed_dim=2048,
    ngram_size=3,
    heads_per_ngram=8,
    ngram_vocab_size_base=100_000,
    split_ngram_parts=1,
    indexer_n_heads=32,
    indexer_kv_heads=1,
    indexer_head_dim=128,
    indexer_budget=2048,
    indexer_compress_ratio=16,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        mrope_section=[11, 11, 10],
        mrope_interleaved=True,
    ),
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=65536,
    pad_token_id=0,
    bos_token_id=0,
    eos_token_id=0,
)
