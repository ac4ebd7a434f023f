"""Tiny seeded checkpoints of the Mamba2 hybrids (Bamba, Granite 4.0-H, Nemotron-H, Falcon-H1,
Zamba2).

Each is a transformers model built from a small config with fixed seeds, every weight except
`A_log`, `D` and the norms re-drawn from N(0, 0.3^2) (so greedy generations are varied; a
smaller std where `WEIGHT_STD` says so), saved with `save_pretrained` (the checkpoints' own
tensor names) beside the GPT-NeoX tokenizer.
"""

from __future__ import annotations

import functools
import os
import shutil

import torch

from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import TOKENIZER_DIR

_COMMON = dict(vocab_size=50280, max_position_embeddings=1024)

BAMBA_CONFIGS: dict[str, dict] = {
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

GRANITE_CONFIGS: dict[str, dict] = {
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

NEMOTRON_H_CONFIGS: dict[str, dict] = {
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
    # 6 blocks "ME*M-E": MoE of 8 squared-ReLU experts in 2 groups (top-2 of the best group),
    # shared expert, scaled and renormalised weights; MQA; 3 SSD heads of 32, one group,
    # chunks of 8, conv 3; biases, no conv bias; tie_word_embeddings, which transformers ignores
    # for Nemotron-H (its checkpoints carry both matrices).
    "nemotron-h-moe": dict(
        _COMMON,
        hidden_size=48,
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
}

FALCON_H1_CONFIGS: dict[str, dict] = {
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

ZAMBA2_CONFIGS: dict[str, dict] = {
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

# Zamba2's shared block attends over 2H-wide inputs with the scale (D / 2) ** -0.5: at std 0.3
# its logits are so large that float32 rounding alone moves transformers' own logprobs by up to
# 0.2 (against float64); at 0.15 both transformers and this engine stay within 5e-5 of float64.
WEIGHT_STD: dict[str, float] = {name: 0.15 for name in ZAMBA2_CONFIGS}

HYBRID_CONFIGS: dict[str, tuple[str, dict]] = {
    **{name: ("BambaForCausalLM", cfg) for name, cfg in BAMBA_CONFIGS.items()},
    **{name: ("GraniteMoeHybridForCausalLM", cfg) for name, cfg in GRANITE_CONFIGS.items()},
    **{name: ("NemotronHForCausalLM", cfg) for name, cfg in NEMOTRON_H_CONFIGS.items()},
    **{name: ("FalconH1ForCausalLM", cfg) for name, cfg in FALCON_H1_CONFIGS.items()},
    **{name: ("Zamba2ForCausalLM", cfg) for name, cfg in ZAMBA2_CONFIGS.items()},
}


def build_hybrid_hf_model(name: str, seed: int = 0):  # noqa: ANN201 - transformers model
    """The transformers model of `HYBRID_CONFIGS[name]`, with varied random weights."""
    import transformers

    cls_name, kwargs = HYBRID_CONFIGS[name]
    model_cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    config = model_cls.config_class(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("A_log", ".D")) or "norm" in pname:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * WEIGHT_STD.get(name, 0.3))
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):  # MoE routing: varied choices
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


@functools.cache
def hybrid_model_dir(name: str) -> str:
    """Saves tiny model `HYBRID_CONFIGS[name]` once per session; its directory."""
    model = build_hybrid_hf_model(name)
    path = make_tmp_dir(f"tiny-{name}-")
    model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


def hf_class(name: str) -> str:
    """The transformers class name of tiny model `name`."""
    return HYBRID_CONFIGS[name][0]
