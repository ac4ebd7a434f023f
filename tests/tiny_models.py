"""Tiny Mamba checkpoints built from configs with fixed seeds, saved in Hugging Face format.

Default initialisation gives near-constant outputs, so every weight except `A_log`, `D` and
the norms is re-drawn from N(0, 0.3^2): the generations are then varied. The real GPT-NeoX
tokenizer of the `state-spaces/mamba-*-hf` checkpoints is saved beside the weights.
"""

from __future__ import annotations

import functools
import os
import shutil

import torch

from tests.helpers.tmp_dirs import make_tmp_dir

TOKENIZER_DIR = os.path.join(os.path.dirname(__file__), "data", "gpt-neox-20b-tokenizer")

CONFIGS: dict[str, dict] = {
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


def build_hf_model(name: str, seed: int = 0):  # noqa: ANN201 - transformers model
    """The transformers `MambaForCausalLM` of config `name`, with varied random weights."""
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(seed)
    config = MambaConfig(**CONFIGS[name], bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = MambaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("A_log", ".D")) or "norm" in pname:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@functools.cache
def tiny_model_dir(name: str, fmt: str = "safetensors") -> str:
    """Saves tiny model `name` once per session and returns its directory.

    Args:
        name: a key of `CONFIGS`.
        fmt: `safetensors`, `sharded` (several safetensors shards with an index) or `bin`.
    """
    model = build_hf_model(name)
    path = make_tmp_dir(f"tiny-mamba-{name}-{fmt}-")
    if fmt == "bin":
        model.save_pretrained(path)
        os.remove(os.path.join(path, "model.safetensors"))
        state = {k: v.clone() for k, v in model.state_dict().items()}
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
    elif fmt == "sharded":
        model.save_pretrained(path, max_shard_size="1MB")
    else:
        model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


# FalconMamba and Mamba2 tiny checkpoints: name -> (transformers class, config kwargs).
OTHER_CONFIGS: dict[str, tuple[str, dict]] = {
    # Mamba's "tied" shape; the dt/B/C norms use the default epsilon.
    "falcon-tied": ("FalconMambaForCausalLM", dict(CONFIGS["tied"], mixer_rms_eps=1e-6)),
    # Mamba's "untied" shape; the mixer epsilon differs from the layer norms'.
    "falcon-untied": ("FalconMambaForCausalLM", dict(CONFIGS["untied"], mixer_rms_eps=1e-3)),
    # 8 heads of 16 in 2 groups, SSD chunks of 16, untied head (Mamba2's default).
    "mamba2-groups": (
        "Mamba2ForCausalLM",
        dict(
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
    ),
    # 3 heads of 32 in one group, conv 3, SSD chunks of 8, biases, tied head, vocab 50277
    # padded to a multiple of 16 (as the mamba-ssm checkpoints are).
    "mamba2-tied": (
        "Mamba2ForCausalLM",
        dict(
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
    ),
}


def build_other_hf_model(name: str, seed: int = 0):  # noqa: ANN201 - transformers model
    """The transformers model of `OTHER_CONFIGS[name]`, with varied random weights.

    Every weight except `A_log`, `D` and the norms is re-drawn from N(0, 0.3^2); Mamba2's
    `dt_bias` too.
    """
    import transformers

    cls_name, kwargs = OTHER_CONFIGS[name]
    model_cls = getattr(transformers, cls_name)
    torch.manual_seed(seed)
    config = model_cls.config_class(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("A_log", ".D")) or "norm" in pname:
                continue
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


@functools.cache
def other_model_dir(name: str) -> str:
    """Saves tiny model `OTHER_CONFIGS[name]` (safetensors) once per session; its directory."""
    model = build_other_hf_model(name)
    path = make_tmp_dir(f"tiny-{name}-")
    model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


# Jamba hybrids: attention every `attn_layer_period` from `attn_layer_offset`, MoE every
# `expert_layer_period` from `expert_layer_offset`. Varied GQA ratios, expert counts, top-k
# and conv widths.
_JAMBA_COMMON = dict(vocab_size=50280, max_position_embeddings=1024, rms_norm_eps=1e-6)
JAMBA_CONFIGS: dict[str, dict] = {
    # 4 layers: Mamba, attention (+MoE), Mamba, attention (+MoE); GQA 2; 4 experts, top-2.
    "jamba-gqa": dict(
        _JAMBA_COMMON,
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
        _JAMBA_COMMON,
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
        _JAMBA_COMMON,
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
OTHER_CONFIGS.update({name: ("JambaForCausalLM", cfg) for name, cfg in JAMBA_CONFIGS.items()})
