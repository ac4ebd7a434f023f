"""Tiny checkpoints and helpers of the tensor-parallel tests (2 ranks, gloo on the CPU).

The Mamba and FalconMamba checkpoints are those of `tests.tiny_models`; Mamba2 comes in two
shapes whose heads split over 2 ranks: `n_groups` 2 (each rank holds one group) and
`n_groups` 1 (the group is replicated and the gated norm's statistics are all-reduced), the
latter with biases, a tied head and an odd vocabulary (the last vocabulary shard is padded).
The hybrids are those of `tests.helpers.hybrid_models` and `tests.tiny_models` whose heads
split over 2 ranks, and `nemotron-h-mqa-even`: Nemotron-H with one KV head (replicated on both
ranks), MoE and 4 Mamba2 heads in one group.
"""

from __future__ import annotations

import functools
import os
import shutil

import torch

from tests.helpers.hybrid_models import hybrid_model_dir
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import TOKENIZER_DIR, other_model_dir, tiny_model_dir

MAMBA2_G1 = dict(
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
)


def _save_tiny(cls_name: str, kwargs: dict, prefix: str) -> str:
    """Saves a transformers model of config `kwargs` with varied random weights (every weight
    but `A_log`, `D` and the norms from N(0, 0.3^2), as `tests.tiny_models`)."""
    import transformers

    model_cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    config = model_cls.config_class(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = model_cls(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not (name.endswith(("A_log", ".D")) or "norm" in name):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = make_tmp_dir(prefix)
    model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


# Nemotron-H with MoE (grouped routing, shared expert) and MQA (one KV head, replicated),
# 4 Mamba2 heads in one group.
NEMOTRON_H_MQA_EVEN = dict(
    vocab_size=50280,
    max_position_embeddings=1024,
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
)


OWN = {
    "mamba2-g1": ("Mamba2ForCausalLM", MAMBA2_G1),
    "nemotron-h-mqa-even": ("NemotronHForCausalLM", NEMOTRON_H_MQA_EVEN),
}


@functools.cache
def model_dir(name: str) -> str:
    """The checkpoint directory of a tensor-parallel test model (saved once per session)."""
    if name in ("tied", "untied"):
        return tiny_model_dir(name)
    if name in OWN:
        return _save_tiny(*OWN[name], prefix=f"tiny-{name}-")
    if name.startswith(("bamba", "granite", "nemotron", "falcon-h1", "zamba2")):
        return hybrid_model_dir(name)
    return other_model_dir(name)
