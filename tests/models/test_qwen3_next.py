"""Qwen3-Next beyond the family suite: where the MoE sits, and the released checkpoints' MTP head.

The layers with the MoE (`decoder_sparse_step`, `mlp_only_layers`, `num_experts`) must be the
ones transformers builds it on, over plans the tiny variants do not cover (its released MTP
head is skipped: `tests/test_model_loader.py`).
"""

from __future__ import annotations

import pytest

from vllm_mamba.models.qwen3_next import is_moe_layer


@pytest.mark.parametrize(
    ("sparse_step", "mlp_only", "num_experts"),
    [(1, [], 4), (2, [], 4), (2, [3], 4), (3, [0, 2], 4), (1, [], 0)],
)
def test_moe_layers_are_transformers(
    sparse_step: int, mlp_only: list[int], num_experts: int
) -> None:
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock

    config = transformers.Qwen3NextConfig(
        vocab_size=32, hidden_size=16, intermediate_size=8, num_hidden_layers=6,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, linear_num_key_heads=1,
        linear_num_value_heads=1, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=num_experts, num_experts_per_tok=1, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, decoder_sparse_step=sparse_step,
        mlp_only_layers=mlp_only,
    )  # fmt: skip
    model = transformers.Qwen3NextModel(config)
    want = [isinstance(layer.mlp, Qwen3NextSparseMoeBlock) for layer in model.layers]
    assert [is_moe_layer(config, i) for i in range(6)] == want
