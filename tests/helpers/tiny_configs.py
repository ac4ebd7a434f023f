"""The configs of the tiny models of `tests.tiny_models`, family by family (transformers
keyword arguments; the registry adds the token ids and builds the weights).

Each family's variants differ where its code branches (tied or untied head, biases, conv width,
GQA ratio, SSD groups and chunk size, MoE or dense, position embedding or none); the registry
asserts those differences when it is built.
"""

from __future__ import annotations

MAMBA: dict[str, dict] = {
    # conv 4, auto time-step rank, no linear biases, fp32 residual, tied head.
    "tied": dict(
        hidden_size=64,
        num_hidden_layers=2,
        state_size=8,
        conv_kernel=4,
        expand=2,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        tie_word_embeddings=True,
        vocab_size=50280,
    ),
    # conv 3, explicit rank, biases, no conv bias, untied head, vocab padded further.
    "untied": dict(
        hidden_size=48,
        num_hidden_layers=3,
        state_size=16,
        conv_kernel=3,
        expand=2,
        time_step_rank=8,
        use_bias=True,
        use_conv_bias=False,
        residual_in_fp32=False,
        tie_word_embeddings=False,
        vocab_size=50304,
        layer_norm_epsilon=1e-5,
    ),
}

FALCON_MAMBA: dict[str, dict] = {
    # Mamba's "tied" shape; the dt/B/C norms use the default epsilon.
    "falcon-tied": dict(MAMBA["tied"], mixer_rms_eps=1e-6),
    # Mamba's "untied" shape; the mixer epsilon differs from the layer norms'.
    "falcon-untied": dict(MAMBA["untied"], mixer_rms_eps=1e-3),
}

MAMBA2: dict[str, dict] = {
    # 8 heads of 16 in 2 groups, SSD chunks of 16, untied head (Mamba2's default).
    "mamba2-groups": dict(
        hidden_size=64,
        num_hidden_layers=2,
        expand=2,
        num_heads=8,
        head_dim=16,
        n_groups=2,
        state_size=16,
        conv_kernel=4,
        chunk_size=16,
        use_bias=False,
        use_conv_bias=True,
        residual_in_fp32=True,
        tie_word_embeddings=False,
        vocab_size=50280,
    ),
    # 3 heads of 32 in one group, conv 3, SSD chunks of 8, biases, tied head, vocab 50277
    # padded to a multiple of 16 (as the mamba-ssm checkpoints are).
    "mamba2-tied": dict(
        hidden_size=48,
        num_hidden_layers=3,
        expand=2,
        num_heads=3,
        head_dim=32,
        n_groups=1,
        state_size=8,
        conv_kernel=3,
        chunk_size=8,
        use_bias=True,
        use_conv_bias=False,
        residual_in_fp32=False,
        tie_word_embeddings=True,
        vocab_size=50288,
    ),
    # 4 heads of 24 in one group (replicated on 2 ranks, the gated norm's statistics all-reduced),
    # conv 3, biases, tied head and an odd vocabulary (the last vocabulary shard is padded).
    "mamba2-g1": dict(
        hidden_size=48,
        num_hidden_layers=2,
        expand=2,
        num_heads=4,
        head_dim=24,
        n_groups=1,
        state_size=8,
        conv_kernel=3,
        chunk_size=8,
        use_bias=True,
        use_conv_bias=True,
        residual_in_fp32=False,
        tie_word_embeddings=True,
        vocab_size=50277,
    ),
}

# Jamba hybrids: attention every `attn_layer_period` from `attn_layer_offset`, MoE every
# `expert_layer_period` from `expert_layer_offset`. Varied GQA ratios, expert counts, top-k
# and conv widths.
_COMMON_JAMBA = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-6)
JAMBA: dict[str, dict] = {
    # 4 layers: Mamba, attention (+MoE), Mamba, attention (+MoE); GQA 2; 4 experts, top-2.
    "jamba-gqa": dict(
        _COMMON_JAMBA,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        tie_word_embeddings=False,
    ),
    # 5 layers: attention at 0 and 3; MQA (6 query heads, 1 kv head); 3 experts, top-1 at
    # layer 2; conv 3, explicit dt rank, projection biases, no conv bias, tied head.
    "jamba-mqa": dict(
        _COMMON_JAMBA,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=5,
        attn_layer_period=3,
        attn_layer_offset=0,
        num_attention_heads=6,
        num_key_value_heads=1,
        num_experts=3,
        num_experts_per_tok=1,
        expert_layer_period=3,
        expert_layer_offset=2,
        mamba_d_state=16,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_dt_rank=8,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
    # 3 layers: attention at 2 only, plain multi-head (4 = 4); dense MLPs only; conv 2.
    "jamba-dense": dict(
        _COMMON_JAMBA,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        attn_layer_period=4,
        attn_layer_offset=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_experts=1,
        num_experts_per_tok=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        mamba_d_state=8,
        mamba_d_conv=2,
        mamba_expand=2,
        tie_word_embeddings=False,
    ),
}

_COMMON = dict(vocab_size=50280, max_position_embeddings=1024)

BAMBA: dict[str, dict] = {
    # 4 layers: Mamba2, attention, Mamba2, attention; GQA 2; 8 SSD heads of 16 in 2 groups,
    # SSD chunks of 16; half-width RoPE over heads of 16; untied head.
    "bamba-gqa": dict(
        _COMMON,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        attn_layer_indices=[1, 3],
        num_attention_heads=4,
        num_key_value_heads=2,
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # 3 layers: attention first; MQA (6 query heads of 8, one kv head); 3 SSD heads of 32,
    # one group, chunks of 8, conv 3; every bias on, no conv bias; tied head; rope_theta 500.
    "bamba-mqa": dict(
        _COMMON,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=3,
        attn_layer_indices=[0],
        num_attention_heads=6,
        num_key_value_heads=1,
        mamba_n_heads=3,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_chunk_size=8,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

GRANITE: dict[str, dict] = {
    # 4 layers: Mamba2, attention, Mamba2, attention; GQA 2 with RoPE; 4 experts top-2 plus a
    # shared expert; every multiplier away from 1; SSD chunks of 16 over 8 heads in 2 groups.
    "granite-moe-rope": dict(
        _COMMON,
        hidden_size=64,
        intermediate_size=32,
        shared_intermediate_size=48,
        num_hidden_layers=4,
        layer_types=["mamba", "attention", "mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
        embedding_multiplier=2.0,
        attention_multiplier=0.2,
        residual_multiplier=0.7,
        logits_scaling=1.5,
        mamba_n_heads=8,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # 3 layers: attention first, no position embedding (NoPE, as the 4.0-H models); MQA; dense
    # (shared MLP only); 3 SSD heads of 32, chunks of 8, conv 3; biases; tied head.
    "granite-dense-nope": dict(
        _COMMON,
        hidden_size=48,
        intermediate_size=32,
        shared_intermediate_size=96,
        num_hidden_layers=3,
        layer_types=["attention", "mamba", "mamba"],
        num_attention_heads=6,
        num_key_value_heads=1,
        num_local_experts=0,
        position_embedding_type=None,
        embedding_multiplier=1.5,
        attention_multiplier=0.4,
        residual_multiplier=1.2,
        logits_scaling=2.0,
        attention_bias=True,
        mamba_n_heads=3,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_chunk_size=8,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

NEMOTRON_H: dict[str, dict] = {
    # 6 blocks "M*-M-*": Mamba2, attention, MLP, Mamba2, MLP, attention; GQA 2 (no position
    # embedding); 8 SSD heads of 16 in 2 groups, chunks of 16; untied head. transformers clamps
    # the time step below at time_step_min in prefill but not in decode, and a one-token chunk
    # of a chunked prefill is a decode here (as in vLLM): time_step_min is made small enough to
    # never bind, so the invariance tests on this model compare like with like.
    "nemotron-h-dense": dict(
        _COMMON,
        hidden_size=64,
        hybrid_override_pattern="M*-M-*",
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        mamba_num_heads=8,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        conv_kernel=4,
        chunk_size=16,
        time_step_min=1e-9,
        time_step_floor=1e-10,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
    ),
    # 6 blocks "ME*M-E": MoE of 8 squared-ReLU experts in 2 groups (top-2 of the best group)
    # in a latent space of 24 (Nemotron 3 Super's `moe_latent_size`: `fc1_latent_proj` in,
    # `fc2_latent_proj` out), shared expert, scaled and renormalised weights; MQA; 3 SSD heads
    # of 32, one group, chunks of 8, conv 3; biases, no conv bias; tie_word_embeddings, which
    # transformers ignores for Nemotron-H (its checkpoints carry both matrices).
    "nemotron-h-moe": dict(
        _COMMON,
        hidden_size=48,
        moe_latent_size=24,
        hybrid_override_pattern="ME*M-E",
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        mlp_bias=True,
        mamba_num_heads=3,
        mamba_head_dim=32,
        n_groups=1,
        ssm_state_size=8,
        conv_kernel=3,
        chunk_size=8,
        use_bias=True,
        use_conv_bias=False,
        layer_norm_epsilon=1e-6,
        tie_word_embeddings=True,
    ),
    # The "nemotron-h-moe" shape with 4 Mamba2 heads of 24 (split over 2 ranks) and one KV head
    # (replicated on both ranks); the latent projections replicated, the experts split.
    "nemotron-h-mqa-even": dict(
        _COMMON,
        hidden_size=48,
        moe_latent_size=24,
        hybrid_override_pattern="ME*M-E",
        num_hidden_layers=6,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=8,
        intermediate_size=64,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48,
        routed_scaling_factor=1.5,
        norm_topk_prob=True,
        mlp_bias=True,
        mamba_num_heads=4,
        mamba_head_dim=24,
        n_groups=1,
        ssm_state_size=8,
        conv_kernel=3,
        chunk_size=8,
        use_bias=True,
        use_conv_bias=False,
        layer_norm_epsilon=1e-6,
        tie_word_embeddings=True,
    ),
}

FALCON_H1: dict[str, dict] = {
    # 3 layers of attention (GQA 2, RoPE base 1000) beside Mamba2 (width 96 from mamba_d_ssm,
    # 6 heads of 16 in 2 groups, chunks of 16) with the gated norm applied before the gate;
    # every muP multiplier away from 1; untied head.
    "falcon-h1-norm": dict(
        _COMMON,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        mamba_d_ssm=96,
        mamba_n_heads=6,
        mamba_n_groups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_chunk_size=16,
        mamba_rms_norm=True,
        mamba_norm_before_gate=True,
        embedding_multiplier=1.5,
        lm_head_multiplier=0.8,
        mlp_multipliers=[0.9, 1.1],
        key_multiplier=0.7,
        attention_in_multiplier=1.2,
        attention_out_multiplier=0.9,
        ssm_in_multiplier=1.1,
        ssm_out_multiplier=0.8,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    # 2 layers; MQA (6 query heads of 8); Mamba2 width 2 x 48 in 3 heads of 32, one group,
    # chunks of 8, conv 3, no gated norm (y * silu(z)); every bias on but the conv's; tied head.
    "falcon-h1-plain": dict(
        _COMMON,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=1,
        head_dim=8,
        mamba_d_ssm=None,
        mamba_expand=2,
        mamba_n_heads=3,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_chunk_size=8,
        mamba_rms_norm=False,
        mamba_proj_bias=True,
        mamba_conv_bias=False,
        projectors_bias=True,
        attention_bias=True,
        mlp_bias=True,
        embedding_multiplier=0.9,
        lm_head_multiplier=1.3,
        key_multiplier=1.4,
        ssm_out_multiplier=1.2,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

ZAMBA2: dict[str, dict] = {
    # 6 layers, hybrid at 1, 3 and 5 over two shared blocks (block 0 serves layers 1 and 5):
    # q/k/v adapters of rank 8 and MLP adapters per use, RoPE (base 1000) over 4 heads of 32
    # (the block attends over 2 x 64); 8 SSD heads of 16 in 2 groups, chunks of 16; tied head
    # (transformers ties the shared blocks only then).
    "zamba2-lora-rope": dict(
        _COMMON,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"],
        num_mem_blocks=2,
        use_shared_attention_adapter=True,
        adapter_rank=8,
        use_mem_rope=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        num_attention_heads=4,
        num_key_value_heads=4,
        n_mamba_heads=8,
        mamba_ngroups=2,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        chunk_size=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # 5 layers, hybrid first and at 3 and 4, one block (MLP adapters only) untied: as in
    # transformers, without tie_word_embeddings each use loads its own copy; GQA 3 (6 query
    # heads of 16), no position embedding; tanh GELU; 3 SSD heads of 32, one group, chunks of
    # 8, conv 3; linear biases; untied head.
    "zamba2-gqa-nope": dict(
        _COMMON,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=5,
        layers_block_type=["hybrid", "mamba", "mamba", "hybrid", "hybrid"],
        num_mem_blocks=1,
        use_shared_attention_adapter=False,
        adapter_rank=4,
        use_mem_rope=False,
        hidden_act="gelu_pytorch_tanh",
        num_attention_heads=6,
        num_key_value_heads=2,
        n_mamba_heads=3,
        mamba_ngroups=1,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_expand=2,
        chunk_size=8,
        add_bias_linear=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}

# Qwen3.5: Gated DeltaNet layers (`linear_attention`) and gated attention (`full_attention`),
# zero-centred norms, partial RoPE (a quarter of each head). The variants differ in the GDN
# head ratio and dims, the attention interval, GQA or MQA, and the head's tying.
_COMMON_QWEN3_5 = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-6)
QWEN3_5: dict[str, dict] = {
    # 4 layers, attention last (interval 4, as the releases); GDN 2 key heads to 4 value heads
    # (ratio 2) of 16; attention GQA 2 (4 query heads of 16, RoPE on 4 dims); untied head.
    "qwen3_5-gqa": dict(
        _COMMON_QWEN3_5,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    # 3 layers, attention in the middle (interval 2); GDN 2 key and 2 value heads (ratio 1),
    # key dim 8 and value dim 24; MQA (4 query heads of 32, RoPE on 8 dims, base 1000), conv 3;
    # tied head.
    "qwen3_5-mqa": dict(
        _COMMON_QWEN3_5,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000.0,
            "partial_rotary_factor": 0.25,
        },
        tie_word_embeddings=True,
    ),
}

QWEN3_5_MOE: dict[str, dict] = {
    # QWEN3_5's "qwen3_5-gqa" shape in 2 layers (GDN, attention) with a MoE of 4 experts of 32,
    # top-2, and a shared expert of 48; untied head.
    "qwen3_5-moe-top2": dict(
        {k: v for k, v in QWEN3_5["qwen3_5-gqa"].items() if k != "intermediate_size"},
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    ),
    # QWEN3_5's "qwen3_5-mqa" shape with 3 experts of 24, top-1, a shared expert of 32; tied.
    "qwen3_5-moe-top1": dict(
        {k: v for k, v in QWEN3_5["qwen3_5-mqa"].items() if k != "intermediate_size"},
        num_experts=3,
        num_experts_per_tok=1,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
    ),
}

# Qwen3-Next: Qwen3.5's layers with the interleaved `in_proj_qkvz` / `in_proj_ba` GDN layout and
# a MoE with a sigmoid-gated shared expert. The variants differ in the GDN head ratio and dims,
# where the MoE sits (every layer, or not on `mlp_only_layers`), top-k renormalisation, GQA or
# MQA, and the head's tying.
QWEN3_NEXT: dict[str, dict] = {
    # 3 layers (GDN, attention, GDN); GDN 2 key heads to 4 value heads (ratio 2) of 16;
    # attention GQA 2 (4 query heads of 16, RoPE on 4 dims); the MoE on every layer: 4 experts
    # of 32, top-2 renormalised, a shared expert of 48; untied head.
    "qwen3-next-moe": dict(
        _COMMON_QWEN3_5,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
    ),
    # 3 layers (GDN, attention, GDN); GDN 2 key and 2 value heads (ratio 1), key dim 8 and value
    # dim 24, conv 3; MQA (4 query heads of 32, RoPE on 8 dims, base 1000); the attention layer
    # dense (`mlp_only_layers`, an MLP of 80), the others the MoE: 3 experts of 24, top-1 not
    # renormalised (weighted by its probability), a shared expert of 32; tied head.
    "qwen3-next-mlp-only": dict(
        _COMMON_QWEN3_5,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000.0,
            "partial_rotary_factor": 0.25,
        },
        num_experts=3,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
    ),
}

# OLMo Hybrid: pre-norm GDN layers (OLMo's separate projections and convs) and post-norm
# attention layers with q/k norms over the whole projections. The variants differ in the layer
# order, `linear_allow_neg_eigval` (beta doubled or not), RoPE or none (NoPE, as the releases),
# GQA or MQA, the GDN head ratio, and the head's tying.
_COMMON_KIMI = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-5)
KIMI_LINEAR: dict[str, dict] = {
    # 4 layers (KDA, MLA, KDA, KDA); KDA 4 heads of 16, conv 4; MLA 4 heads (q from hidden,
    # latent 32 + shared k_rot 8, nope 16, v 16); the first layer a dense MLP of 96, the others
    # DeepSeek-V3 MoEs: 8 experts of 32 in 2 groups (the best 1 kept), top-2 renormalised,
    # scaled by 2.446, one shared expert; untied head.
    "kimi-linear-moe": dict(
        _COMMON_KIMI,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        linear_num_heads=4,
        linear_head_dim=16,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.446,
        moe_intermediate_size=32,
        n_shared_experts=1,
        tie_word_embeddings=False,
    ),
    # 3 layers (KDA, MLA, KDA); KDA 2 heads of 32, conv 3; MLA 2 heads with a low-rank query
    # (rank 24, normed), latent 48 + k_rot 4, nope 24, v 32; the middle layer dense (80), the
    # others MoEs: 4 experts of 24 in 1 group, top-1 not renormalised, 2 shared experts.
    "kimi-linear-qlora": dict(
        _COMMON_KIMI,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        linear_num_heads=2,
        linear_head_dim=32,
        linear_conv_kernel_dim=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=24,
        kv_lora_rank=48,
        qk_nope_head_dim=24,
        qk_rope_head_dim=4,
        v_head_dim=32,
        num_local_experts=4,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        moe_intermediate_size=24,
        n_shared_experts=2,
        tie_word_embeddings=False,
    ),
}

# Ling 3 (BailingHybrid): Kimi Linear's skeleton with full-rank KDA gates (the safe gate or
# Kimi's), MLA with interleaved RoPE and a sigmoid gate per head, and MoEs whose SwiGLUs clip.
_COMMON_LING = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-5)
LING: dict[str, dict] = {
    # 4 layers (KDA, KDA, MLA, KDA); KDA 4 heads of 16 (`head_dim`; transformers then sets
    # `head_dim` to the rope dim), conv 4, the safe gate at -5; MLA 4 heads (q from hidden,
    # latent 32 + k_rot 8, nope 16, v 16, rope theta 10000); the first layer dense (96), the
    # others MoEs of 8 experts of 32 in 2 groups (1 kept), top-2 renormalised, scaled by 2.5,
    # one shared expert; one MTP layer named.
    "ling-moe": dict(
        _COMMON_LING,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        short_conv_kernel_size=4,
        kda_safe_gate=True,
        kda_lower_bound=-5.0,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_theta=10000.0,
        num_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        num_shared_experts=1,
        num_nextn_predict_layers=1,
        tie_word_embeddings=False,
    ),
    # 3 layers (KDA, MLA, KDA); KDA 2 heads of 32, conv 3, Kimi's softplus gate; MLA 2 heads
    # with a low-rank query (rank 24), latent 48 + k_rot 4, nope 24, v 32, YaRN RoPE (factor 4,
    # `mscale_all_dim` 1, so the softmax scale grows); the middle layer dense (80), the others
    # MoEs of 4 experts of 24 in 1 group, top-1 not renormalised, 2 shared experts, unclipped.
    "ling-qlora": dict(
        _COMMON_LING,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        short_conv_kernel_size=3,
        kda_safe_gate=False,
        q_lora_rank=24,
        kv_lora_rank=48,
        qk_nope_head_dim=24,
        qk_rope_head_dim=4,
        v_head_dim=32,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            original_max_position_embeddings=256,
        ),
        num_experts=4,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        moe_intermediate_size=24,
        num_shared_experts=2,
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    ),
}
# ling-moe with the releases' SwiGLU clips (transformers 5.24 reads no limits; its reference for
# this variant adds transformers 5.25's clip, `tests/models/test_bailing_hybrid.py`): routed
# experts at 0.05 on layers 1 and 3, the shared expert at 0.08 on layer 2 (the tiny weights'
# activations pass those often).
LING["ling-clipped"] = dict(
    LING["ling-moe"],
    expert_swiglu_limit_list=[0, 0.05, 0, 0.05],
    share_expert_swiglu_limit_list=[0, 0, 0.08, 0],
)

# GLM-5-Next: KDA and DSA layers (NoPE MLA over the tokens a k-pool indexer selects) inside mHC
# residual streams, SwiGLUs clipped before the activation. The indexer budgets are small, so the
# longer prompts drop pools; 16 indexer heads keep its scores off exact ties (a query whose heads
# all score negative scores 0 for every pool, and the top-k of tied pools is arbitrary).
_COMMON_GLM = dict(
    vocab_size=50280,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    index_head_dim=8,
    index_n_heads=16,
    qk_rope_head_dim=0,
    tie_word_embeddings=False,
    # A tiny vision tower: the image-text checkpoint's, skipped by the engine (served text-only).
    vision_config=dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=64,
        projection_intermediate_size=32,
    ),
)
GLM5_NEXT: dict[str, dict] = {
    # 4 layers (KDA, DSA full, DSA shared, KDA), 3 streams (20 Sinkhorn iterations); KDA 4 heads
    # of 16 (conv 4) with the safe gate at -5; MLA 4 heads (q rank 24, latent 32, nope 16, v 16);
    # the indexer keeps 2 pools of 4 tokens and the tail; the first layer dense (96), the others
    # MoEs of 8 experts of 32 in 2 groups (1 kept), top-2 renormalised, scaled by 2.5, one shared;
    # SwiGLU clip 1.0.
    "glm5-next-moe": dict(
        _COMMON_GLM,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        layer_types=[
            "linear_attention",
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
        ],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        hc_mult=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=8,
        index_kpool=4,
        linear_head_dim=16,
        linear_num_heads=4,
        linear_conv_kernel_dim=4,
        linear_lower_bound=-5.0,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=32,
        n_shared_experts=1,
        swiglu_limit=1.0,
    ),
    # 3 layers (DSA, KDA, DSA), both DSA layers with their own indexer, 2 streams (5 Sinkhorn
    # iterations); KDA 2 heads of 32 (conv 3) with Kimi's softplus gate; MLA 2 heads (q rank
    # 16, latent 48, nope 24, v 32); the indexer keeps 3 pools of 2 tokens and the tail; the
    # middle layer a MoE of 4 experts of 24 (top-1, not renormalised, 2 shared), the others
    # dense (80); SwiGLU clip 0.5.
    "glm5-next-dense": dict(
        _COMMON_GLM,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full", "full", "full"],
        mlp_layer_types=["dense", "sparse", "dense"],
        hc_mult=2,
        hc_sinkhorn_iters=5,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=16,
        kv_lora_rank=48,
        qk_nope_head_dim=24,
        v_head_dim=32,
        index_topk=6,
        index_kpool=2,
        linear_head_dim=32,
        linear_num_heads=2,
        linear_conv_kernel_dim=3,
        linear_lower_bound=None,
        n_routed_experts=4,
        num_experts_per_tok=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        moe_intermediate_size=24,
        n_shared_experts=2,
        swiglu_limit=0.5,
    ),
}

# Qwen4-Exp: Gated DeltaNet and indexed (QSA) attention inside gated hyper-connections, softmax
# MoEs with a gated shared expert, per-layer n-gram embeddings on chosen layers. The indexer
# budgets are small, so the longer prompts drop blocks; 16 indexer heads keep its block scores
# off exact ties (see GLM5_NEXT's note).
_COMMON_QWEN4 = dict(
    vocab_size=50280,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    hidden_size=64,
    head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    indexer_n_heads=16,
    indexer_kv_heads=1,
    indexer_head_dim=8,
    rope_parameters=dict(
        rope_type="default",
        rope_theta=10000.0,
        partial_rotary_factor=0.25,
        mrope_section=[1, 1, 0],
        mrope_interleaved=True,
    ),
    tie_word_embeddings=False,
)
QWEN4_EXP: dict[str, dict] = {
    # 4 layers (GDN, QSA, GDN, QSA), 3 streams (rank 16); GQA 4 heads of 16 over 2 KV heads,
    # GDN 2 key and 4 value heads of 16 (conv 4); 4 experts of 32, top-2; the indexer keeps 2
    # blocks of 4 tokens and the tail; n-gram embeddings on both GDN layers (trigrams, 2 heads
    # per order over tables of ~1000 rows in 2 checkpoint shards, conv 3 dilated by 3).
    "qwen4-exp-ple": dict(
        _COMMON_QWEN4,
        num_hidden_layers=4,
        layer_types=[
            "linear_attention",
            "indexed_attention",
            "linear_attention",
            "indexed_attention",
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        hc_count=3,
        hc_lowrank=16,
        ple_layer_ids=[1, 3],
        ple_embed_dim=32,
        ple_conv_kernel_size=3,
        ngram_size=3,
        heads_per_ngram=2,
        ngram_vocab_size_base=1000,
        split_ngram_parts=2,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    # 3 layers (QSA, GDN, QSA), 2 streams (rank 8); MQA 2 heads of 16, GDN 1 key and 2 value
    # heads (conv 3); 6 experts of 32, top-1 not renormalised; the indexer keeps 3 blocks of 2
    # tokens and the tail; no n-gram embeddings.
    "qwen4-exp-plain": dict(
        _COMMON_QWEN4,
        num_hidden_layers=3,
        layer_types=["indexed_attention", "linear_attention", "indexed_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        linear_conv_kernel_dim=3,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        num_experts=6,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        hc_count=2,
        hc_lowrank=8,
        ple_layer_ids=[],
        indexer_budget=6,
        indexer_compress_ratio=2,
    ),
}

_COMMON_OLMO = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-6)
OLMO_HYBRID: dict[str, dict] = {
    # 3 layers (GDN, attention, GDN); GDN 2 key heads of 16 to 4 value heads of 32, beta in
    # [0, 2]; attention GQA 2 (4 heads of 16) with RoPE; untied head.
    "olmo-hybrid-rope": dict(
        _COMMON_OLMO,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=32,
        linear_conv_kernel_dim=4,
        linear_allow_neg_eigval=True,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
    # 3 layers (attention first, then 2 GDN); GDN 2 key and 2 value heads (key 8, value 24),
    # conv 3, beta in [0, 1]; attention MQA (4 heads of 16), no position embedding; tied head.
    "olmo-hybrid-nope": dict(
        _COMMON_OLMO,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=3,
        linear_allow_neg_eigval=False,
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "default", "rope_theta": None},
        tie_word_embeddings=True,
    ),
}

# LFM2: short-conv layers (`conv`) and attention layers (`full_attention`) with per-head q/k
# norms and RoPE over whole heads; SwiGLU feed-forwards. The variants differ in the conv bias
# (in_proj, conv and out_proj), the conv width, the layer order, GQA or MQA, how the SwiGLU
# width is derived, and the head's tying.
_COMMON_LFM2 = dict(vocab_size=50280, max_position_embeddings=1024, norm_eps=1e-5)
LFM2: dict[str, dict] = {
    # 4 layers (conv, attention, conv, conv); no biases, conv width 3; GQA 2 (4 heads of 16,
    # RoPE base 1e6); the SwiGLU width auto-adjusted: int(2/3 * 144) = 96, times 1.5 = 144,
    # rounded up to a multiple of 32 = 160; tied head.
    "lfm2-gqa": dict(
        _COMMON_LFM2,
        hidden_size=64,
        intermediate_size=144,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_bias=False,
        conv_L_cache=3,
        block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.5,
        block_multiple_of=32,
        tie_word_embeddings=True,
    ),
    # 4 layers (attention, conv, conv, attention); biases, conv width 4; MQA (4 heads of 16,
    # RoPE base 1000); the SwiGLU width as given (80); untied head.
    "lfm2-mqa": dict(
        _COMMON_LFM2,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=4,
        layer_types=["full_attention", "conv", "conv", "full_attention"],
        num_attention_heads=4,
        num_key_value_heads=1,
        conv_bias=True,
        conv_L_cache=4,
        block_auto_adjust_ff_dim=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        tie_word_embeddings=False,
    ),
}

# LFM2-MoE: LFM2's layers with a sigmoid-routed MoE after the first `num_dense_layers` dense
# ones. The variants differ in top-k, the dense layers, the selection bias, renormalisation and
# scaling, the conv bias and width, GQA or MQA, and the head's tying.
LFM2_MOE: dict[str, dict] = {
    # 4 layers (conv, attention, conv, conv), the first dense (96), then 4 experts of 32, top-2
    # chosen with the expert bias, renormalised, scaled by 1.5; no biases, conv width 3; GQA 2;
    # untied head.
    "lfm2-moe-top2": dict(
        _COMMON_LFM2,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        layer_types=["conv", "full_attention", "conv", "conv"],
        num_attention_heads=4,
        num_key_value_heads=2,
        conv_bias=False,
        conv_L_cache=3,
        num_dense_layers=1,
        num_experts=4,
        num_experts_per_tok=2,
        use_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
        tie_word_embeddings=False,
    ),
    # 4 layers (conv, conv, attention, conv), the first two dense (80), then 3 experts of 24,
    # top-1 by score alone (no expert bias), weighted by its sigmoid (not renormalised);
    # biases, conv width 4; MQA; tied head.
    "lfm2-moe-top1": dict(
        _COMMON_LFM2,
        hidden_size=64,
        intermediate_size=80,
        moe_intermediate_size=24,
        num_hidden_layers=4,
        layer_types=["conv", "conv", "full_attention", "conv"],
        num_attention_heads=4,
        num_key_value_heads=1,
        conv_bias=True,
        conv_L_cache=4,
        num_dense_layers=2,
        num_experts=3,
        num_experts_per_tok=1,
        use_expert_bias=False,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        tie_word_embeddings=True,
    ),
}

# RWKV-7 (fla's field names; `tests.helpers.rwkv_checkpoints` draws the weights and writes
# both formats, the `rwkv` package is the reference). Heads of 64 (the released size) and of
# 32 with Dv = Dk; LoRA ranks and channel-mix widths differ.
_COMMON_RWKV7 = dict(vocab_size=50280)
RWKV7 = {
    # 2 heads of 64, 3 layers, ranks 8/8/8/16, channel mix 256.
    "rwkv7-h64": dict(
        _COMMON_RWKV7,
        hidden_size=128,
        num_hidden_layers=3,
        head_dim=64,
        decay_low_rank_dim=8,
        a_low_rank_dim=8,
        v_low_rank_dim=8,
        gate_low_rank_dim=16,
        intermediate_size=256,
    ),
    # 3 heads of 32, 2 layers, ranks 16/4/4/8, channel mix 160.
    "rwkv7-h32": dict(
        _COMMON_RWKV7,
        hidden_size=96,
        num_hidden_layers=2,
        head_dim=32,
        decay_low_rank_dim=16,
        a_low_rank_dim=4,
        v_low_rank_dim=4,
        gate_low_rank_dim=8,
        intermediate_size=160,
    ),
}

# RWKV-4 (transformers' `RwkvConfig`). The main variant rescales (`rescale_every` 2 < 3
# blocks: the output weights of block 2 halved, the hidden states halved after block 1); the
# second is tied, without rescaling. `attention_hidden_size` equals `hidden_size` (as in the
# released models): transformers' generate sizes its WKV state by `hidden_size` and fails
# otherwise (a narrower WKV is checked in tests/models/test_rwkv4.py).
_COMMON_RWKV4 = dict(vocab_size=50280, context_length=1024, layer_norm_epsilon=1e-5)
RWKV4 = {
    # H 64, F 128, 3 blocks, rescale every 2, untied head.
    "rwkv4-rescale": dict(
        _COMMON_RWKV4,
        hidden_size=64,
        attention_hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        rescale_every=2,
        tie_word_embeddings=False,
    ),
    # H 48, F 96, 2 blocks, no rescaling, tied head.
    "rwkv4-tied": dict(
        _COMMON_RWKV4,
        hidden_size=48,
        attention_hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        rescale_every=0,
        tie_word_embeddings=True,
    ),
}

# Lara-4-Mini: GDN (Qwen3.5's, its input projections fused in one `in_proj`), sliding-window
# attention with RoPE and full attention without, the MoE with an ungated shared expert on
# every layer. The variants differ in the layer plan, the GDN head ratio and dims, GQA or MQA,
# the window (both shorter than the longer test prompts), attention biases, top-k
# renormalisation and the head's tying.
_COMMON_LARA = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-6)
LARA_MINI: dict[str, dict] = {
    # The released plan in 5 layers (GDN, sliding, GDN, full, sliding); GDN 2 key heads to 4
    # value heads (ratio 2) of 16; attention GQA 2 (4 query heads of 16), window 16; 4 experts
    # of 32, top-2 renormalised, a shared expert of 48; untied head.
    "lara-mini-gqa": dict(
        _COMMON_LARA,
        hidden_size=64,
        num_hidden_layers=5,
        layer_types=[
            "linear_attention",
            "sliding_attention",
            "linear_attention",
            "full_attention",
            "sliding_attention",
        ],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        attention_bias=False,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        tie_word_embeddings=False,
    ),
    # 4 layers (sliding, GDN, full, GDN); GDN 2 key and 2 value heads (ratio 1), key dim 8 and
    # value dim 24, conv 3; MQA (4 query heads of 32, RoPE base 1000) with biases, window 8;
    # 3 experts of 24, top-1 not renormalised, a shared expert of 32; tied head.
    "lara-mini-mqa": dict(
        _COMMON_LARA,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "linear_attention", "full_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=24,
        linear_conv_kernel_dim=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        sliding_window=8,
        attention_bias=True,
        num_experts=3,
        num_experts_per_tok=1,
        norm_topk_prob=False,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=32,
        tie_word_embeddings=True,
    ),
}

# LFM3: LFM2's short-conv layers with sliding- and full-attention layers (`layer_types`), RoPE
# per kind (sliding `default`, full `proportional`: the first pairs of each head rotate at
# `base ** (-2i / D)`, the others pass through), a sigmoid gate per head on the attention output
# and post-norms on both stages (sandwich). The windows are shorter than the test prompts. The
# variants differ in the gate, the sandwich norms, the window, the RoPE parameters, the conv
# bias and width, the layer order, GQA or MQA, and the head's tying. No MoE in this family.
_COMMON_LFM3 = dict(vocab_size=50280, max_position_embeddings=1024, norm_eps=1e-5)
LFM3: dict[str, dict] = {
    # As LFM3-1.7B: 5 layers (conv, sliding, full, conv, sliding), window 16; gate and sandwich
    # norms; GQA 2 (4 heads of 16; sliding RoPE base 1e4, full proportional base 1e6 over 4 of
    # the 8 pairs); no biases, conv width 7; SwiGLU 96; tied head.
    "lfm3-gqa": dict(
        _COMMON_LFM3,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=5,
        layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        conv_bias=False,
        conv_L_cache=7,
        use_attention_gate=True,
        use_sandwich_norm=True,
        tie_word_embeddings=True,
    ),
    # 4 layers (sliding, conv, conv, full), window 24; neither gate nor sandwich norms; MQA (2
    # heads of 32; sliding RoPE base 1000, full proportional base 1e4 over 4 of the 16 pairs);
    # biases, conv width 3; SwiGLU 80; untied head.
    "lfm3-mqa": dict(
        _COMMON_LFM3,
        hidden_size=64,
        intermediate_size=80,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "conv", "conv", "full_attention"],
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=24,
        conv_bias=True,
        conv_L_cache=3,
        use_attention_gate=False,
        use_sandwich_norm=False,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            "full_attention": {
                "rope_type": "proportional",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
        tie_word_embeddings=False,
    ),
}

# Zamba v1: multi-head Mamba layers and one shared attention block (over [h, emb], 2H wide,
# scale (D / 2) ** -0.5, no position embedding) reused by the hybrid layers, each with its own
# KV cache. The variants differ in the layer plan (the config's period/offset rule, or an
# explicit list starting with a hybrid layer), the Mamba heads (4 of 32; 3 of 48), MHA or GQA,
# the conv and projection biases, and tying (transformers shares the block only when tied).
_COMMON_ZAMBA = dict(vocab_size=50280, max_position_embeddings=1024)
ZAMBA: dict[str, dict] = {
    # 7 layers, hybrid at 2, 4 and 6 (transformers' rule: layer 2, then period 2 offset 1);
    # 4 attention heads of 32, MHA; GELU MLP 96; Mamba width 128 in 4 heads of 32, state 16,
    # conv 4, dt rank auto (4); conv bias, no projection biases; tied.
    "zamba-mha-tied": dict(
        _COMMON_ZAMBA,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=7,
        attn_layer_period=2,
        attn_layer_offset=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_mamba_heads=4,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_conv_bias=True,
        mamba_proj_bias=False,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # 5 layers, hybrid first and at 3 and 4, each use with its own block copy (untied); GQA 3
    # (6 query heads of 24); tanh GELU MLP 64; Mamba width 144 in 3 heads of 48, state 8,
    # conv 3, dt rank 5; no conv bias, in_proj / out_proj biases; untied head.
    "zamba-gqa-untied": dict(
        _COMMON_ZAMBA,
        hidden_size=72,
        intermediate_size=64,
        num_hidden_layers=5,
        layers_block_type=["hybrid", "mamba", "mamba", "hybrid", "hybrid"],
        num_attention_heads=6,
        num_key_value_heads=2,
        hidden_act="gelu_pytorch_tanh",
        n_mamba_heads=3,
        mamba_d_state=8,
        mamba_d_conv=3,
        mamba_expand=2,
        mamba_dt_rank=5,
        mamba_conv_bias=False,
        mamba_proj_bias=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}

_COMMON_RGEMMA = dict(vocab_size=50280, rms_norm_eps=1e-6)

RECURRENT_GEMMA: dict[str, dict] = {
    # recurrent, recurrent, attention; MQA (4 query heads of 16, one KV head), window 16
    # (shorter than most prompts), RG-LRU as wide as the hidden state in 4 gate heads, conv 4,
    # no attention biases, soft cap 30 (the default).
    "recurrent-gemma-mqa": dict(
        _COMMON_RGEMMA,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        lru_width=64,
        attention_window_size=16,
        conv1d_width=4,
        attention_bias=False,
        logits_soft_cap=30.0,
    ),
    # recurrent, attention, twice; GQA 2 (4 heads of 12), window 7 (not a block multiple),
    # RG-LRU in 4 heads of 12, conv 3, attention biases, a soft cap of 4 that bites. (A
    # `lru_width` other than the hidden size breaks transformers' own one-token prompts: its
    # fresh conv state is hidden-sized; every release has them equal.)
    "recurrent-gemma-gqa": dict(
        _COMMON_RGEMMA,
        hidden_size=48,
        intermediate_size=128,
        num_hidden_layers=4,
        block_types=["recurrent", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        lru_width=48,
        attention_window_size=7,
        conv1d_width=3,
        attention_bias=True,
        logits_soft_cap=4.0,
    ),
}

# MiniMax-Text-01: lightning-attention (linear attention with a fixed decay per head and layer,
# an RMSNorm over all heads, a sigmoid output gate) and softmax-attention layers, Mixtral's MoE
# on every layer, each stage's residual its normed input scaled by the layer kind's alpha and
# beta. The variants differ in the layer plan, GQA or MQA, the softmax layers' window (none, or
# shorter than the longer test prompts), the MoE's top-k, the residual factors (set or the
# defaults of 1) and the head's tying.
_COMMON_MINIMAX = dict(vocab_size=50280, max_position_embeddings=1024)
MINIMAX: dict[str, dict] = {
    # 5 layers (lightning, softmax, lightning, lightning, softmax); 4 heads of 16 (softmax GQA
    # 2, full attention, RoPE base 1e6); 4 experts of 48, top-2; factors as the releases set
    # them (alpha > 1, beta 1) for the attention stages, others for the MoE; untied head.
    "minimax-full-top2": dict(
        _COMMON_MINIMAX,
        hidden_size=64,
        intermediate_size=48,
        num_hidden_layers=5,
        layer_types=[
            "linear_attention",
            "full_attention",
            "linear_attention",
            "linear_attention",
            "full_attention",
        ],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=None,
        num_local_experts=4,
        num_experts_per_tok=2,
        rms_norm_eps=1e-5,
        linear_attn_alpha_factor=1.6,
        linear_attn_beta_factor=1.0,
        full_attn_alpha_factor=1.4,
        full_attn_beta_factor=1.0,
        mlp_alpha_factor=1.2,
        mlp_beta_factor=0.8,
        tie_word_embeddings=False,
    ),
    # 4 layers (transformers' default plan: softmax, lightning, softmax, lightning); 4 heads of
    # 12 (softmax MQA, window 12, RoPE base 1e4); 3 experts of 40, top-1; every factor 1 (the
    # normed residual alone); tied head.
    "minimax-window-top1": dict(
        _COMMON_MINIMAX,
        hidden_size=48,
        intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=12,
        sliding_window=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        num_local_experts=3,
        num_experts_per_tok=1,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
    ),
}

# Inkling: attention layers with four residual short convs each, a relative-position bias
# conditioned on the query token, sliding (`hybrid_sliding`) and full (`hybrid`) layers of
# their own head shapes, a dense SwiGLU or an MoE whose router weighs the shared experts, no
# position embedding. The windows, bias extents and log-scaling floors are shorter than the
# longer prompts, so each cut bites. The variants differ in the layer plans, the head shapes
# (one KV spec for both kinds, so a KV group per window; or two specs, one group), log scaling
# on or off, the conv width, the shared experts and a padded head or not.
_COMMON_INKLING = dict(vocab_size=50280, rms_norm_eps=1e-6, hidden_act="silu")
INKLING: dict[str, dict] = {
    # sliding, full, sliding, full; 4 query and 2 KV heads of 16 in both kinds, window 16, bias
    # extent 24 (full), log scaling past position 20; a dense first layer (SwiGLU 96), then 4
    # experts of 32, top-2, one shared expert; conv 4; the head padded past 50277 rows.
    "inkling-gqa": dict(
        _COMMON_INKLING,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=16,
        d_rel=4,
        rel_extent=24,
        log_scaling_n_floor=20,
        log_scaling_alpha=0.5,
        conv_kernel_size=4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        route_scale=2.0,
        logits_mup_width_multiplier=2.0,
        unpadded_vocab_size=50277,
    ),
    # full, sliding, sliding; full MQA (4 heads of 16), sliding 2 heads of 24 and 1 KV head,
    # window 8, bias extent 40, no log scaling; 3 experts of 24, top-1, two shared experts, on
    # every layer; conv 3; the head unpadded.
    "inkling-mqa": dict(
        _COMMON_INKLING,
        hidden_size=48,
        num_hidden_layers=3,
        layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding"],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=1,
        swa_head_dim=24,
        sliding_window_size=8,
        d_rel=8,
        rel_extent=40,
        log_scaling_n_floor=None,
        conv_kernel_size=3,
        mlp_layer_types=["sparse", "sparse", "sparse"],
        moe_intermediate_size=24,
        n_routed_experts=3,
        num_experts_per_tok=1,
        n_shared_experts=2,
        route_scale=1.5,
        logits_mup_width_multiplier=4.0,
        unpadded_vocab_size=None,
    ),
}

# ZAYA1: CCA attention (q / k through a depthwise then a grouped per-head conv with per-sequence
# histories, the value half delayed by one token, L2-normed q / k with a key scale) on full
# (`hybrid`) and sliding (`hybrid_sliding`) layers, residual scaling, a top-1 router whose state
# carries from layer to layer, with a skip expert. The windows are shorter than the test
# prompts. The variants differ in the layer order, the window, GQA (two KV heads: the first
# all current value, the second all delayed) or MQA (one head, half of each), the convs' widths
# (history 2 or 3), the biases, the RoPE parameters and the head's tying.
_COMMON_ZAYA = dict(vocab_size=50280, max_position_embeddings=1024)
ZAYA: dict[str, dict] = {
    # sliding, full, sliding; window 16; GQA 2 (4 heads of 16), CCA widths 2 and 2; no biases;
    # the default RoPE (full base 5e6, sliding 1e4, half of each head); 4 experts of 32, router
    # width 16; tied head.
    "zaya-gqa": dict(
        _COMMON_ZAYA,
        hidden_size=64,
        num_hidden_layers=3,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=16,
        cca_time0=2,
        cca_time1=2,
        attention_bias=False,
        num_experts=4,
        moe_intermediate_size=32,
        router_hidden_size=16,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
    # full, sliding, sliding; window 7 (not a block multiple); MQA (3 heads of 16), CCA widths
    # 3 and 2; biases; full RoPE base 1e4 over whole heads, sliding base 100 over a quarter;
    # 3 experts of 24, router width 12; untied head.
    "zaya-mqa": dict(
        _COMMON_ZAYA,
        hidden_size=48,
        num_hidden_layers=3,
        layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding"],
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=7,
        cca_time0=3,
        cca_time1=2,
        attention_bias=True,
        num_experts=3,
        moe_intermediate_size=24,
        router_hidden_size=12,
        rope_parameters={
            "hybrid": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
            "hybrid_sliding": {
                "rope_type": "default",
                "rope_theta": 100.0,
                "partial_rotary_factor": 0.25,
            },
        },
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    ),
}

# xLSTM: mLSTM blocks (exponential input and forget gates, matrix memory, stabilised
# normaliser, per-head LayerNorm, sigmoid output gate) with a gated SiLU feed-forward. The
# variants differ in the query/key width (half the values' or equal), the biases (projections,
# block norms, head norm), the gate and logit soft caps (the defaults, or small ones that
# bite), the chunk of transformers' prefill (its chunkwise form for prompts of 64 or 16 tokens
# and more, token by token past the last whole chunk) and the tie flag (transformers' xLSTM
# never ties). Widths are multiples of 64: transformers' state cache rounds them up so.
_COMMON_XLSTM = dict(vocab_size=50280, norm_eps=1e-6, eps=1e-6)
XLSTM: dict[str, dict] = {
    # 2 blocks of 128, 4 heads (Dk 16, Dv 32), feed-forward 384 (2.667 x 128 rounded to 64),
    # no biases, soft caps 15 and 30 (xLSTM-7B's), chunks of 64, untied head.
    "xlstm-dk16": dict(
        _COMMON_XLSTM,
        hidden_size=128,
        num_hidden_layers=2,
        num_heads=4,
        qk_dim_factor=0.5,
        v_dim_factor=1.0,
        ffn_proj_factor=2.667,
        ffn_round_up_to_multiple_of=64,
        use_bias=False,
        gate_soft_cap=15.0,
        output_logit_soft_cap=30.0,
        chunk_size=64,
        tie_word_embeddings=False,
    ),
    # 2 blocks of 64, 2 heads (Dk = Dv = 32), feed-forward 96 (1.3 x 64 rounded to 32), biases
    # everywhere, soft caps 5 and 4, chunks of 16, the tie flag set (and ignored).
    "xlstm-bias": dict(
        _COMMON_XLSTM,
        hidden_size=64,
        num_hidden_layers=2,
        num_heads=2,
        qk_dim_factor=1.0,
        v_dim_factor=1.0,
        ffn_proj_factor=1.3,
        ffn_round_up_to_multiple_of=32,
        use_bias=True,
        gate_soft_cap=5.0,
        output_logit_soft_cap=4.0,
        chunk_size=16,
        tie_word_embeddings=True,
    ),
}

# Inkling 2: Inkling's layers with block attention residuals (blocks of
# `n_layers_per_attn_res_block` layers), L2-clipped queries, keys and relative states, sinks, an
# output gate, dynamic key/value convs in the full layers, soft-capped experts and logits. Every
# clip and cap is set low enough to bite on these weights; the windows, extents and log-scaling
# floors are shorter than the longer prompts. The variants differ in the layer plans (a sliding
# or a full first layer), the block size, the head shapes, the conv width, the caps and a
# padded head or not.
_COMMON_INKLING2 = dict(vocab_size=50280, rms_norm_eps=1e-6, hidden_act="silu")
INKLING2: dict[str, dict] = {
    # sliding, full, sliding, full in blocks of 2; 4 query and 2 KV heads of 16 in both kinds,
    # window 16, bias extent 24, log scaling past position 20; 4 experts of 32, top-2; conv 4;
    # the head padded past 50277 rows.
    "inkling2-gqa": dict(
        _COMMON_INKLING2,
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"],
        n_layers_per_attn_res_block=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=16,
        sliding_window_size=16,
        d_rel=4,
        rel_extent=24,
        log_scaling_n_floor=20,
        log_scaling_alpha=0.5,
        qk_l2_clip_threshold=3.0,
        rel_l2_clip_threshold=1.0,
        conv_kernel_size=4,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        route_scale=2.0,
        mlp_gate_softcap=1.0,
        mlp_up_softcap=2.0,
        final_logit_softcapping=5.0,
        unpadded_vocab_size=50277,
    ),
    # full, sliding, sliding, full, sliding in blocks of 3; full MQA (4 heads of 16), sliding 2
    # heads of 24 and 1 KV head, window 8, bias extent 40, log scaling past 64; 3 experts of 24,
    # top-1; conv 3; the head as wide as the vocabulary.
    "inkling2-mqa": dict(
        _COMMON_INKLING2,
        hidden_size=48,
        num_hidden_layers=5,
        layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        swa_num_attention_heads=2,
        swa_num_key_value_heads=1,
        swa_head_dim=24,
        sliding_window_size=8,
        d_rel=8,
        rel_extent=40,
        log_scaling_n_floor=64,
        log_scaling_alpha=0.3,
        qk_l2_clip_threshold=4.0,
        rel_l2_clip_threshold=2.0,
        conv_kernel_size=3,
        moe_intermediate_size=24,
        n_routed_experts=3,
        num_experts_per_tok=1,
        route_scale=1.5,
        mlp_gate_softcap=2.0,
        mlp_up_softcap=3.0,
        final_logit_softcapping=8.0,
        unpadded_vocab_size=50280,
    ),
}

# Inkling 2 Loop: Inkling 2 whose middle blocks of layers run several passes per step, each with
# its own KV caches and conv histories, the later passes gated with messages from the previous
# one. The variants differ in the loop (layers 2-3 three times in blocks of 2; layers 1-2 twice
# in blocks of 1), the gate rank, the layer plans and head shapes, and a padded head or not.
INKLING2_LOOP: dict[str, dict] = {
    "inkling2-loop-gqa": dict(
        INKLING2["inkling2-gqa"],
        num_hidden_layers=6,
        layer_types=["hybrid_sliding", "hybrid"] * 3,
        loop_layer_index_start=2,
        loop_layer_index_end=4,
        loop_num_passes=3,
        loop_gate_rank=8,
    ),
    "inkling2-loop-mqa": dict(
        INKLING2["inkling2-mqa"],
        num_hidden_layers=4,
        layer_types=["hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding"],
        n_layers_per_attn_res_block=1,
        loop_layer_index_start=1,
        loop_layer_index_end=3,
        loop_num_passes=2,
        loop_gate_rank=4,
    ),
}
