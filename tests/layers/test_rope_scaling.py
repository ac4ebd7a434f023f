"""Scaled RoPE (`layers/rope_scaling.py`) against transformers: the frequencies and attention
factor of each static type (`linear`, `llama3`, `yarn` with its variants) equal transformers'
own, a tiny LFM2 with YaRN generates transformers' greedy tokens past its original context, and
the types whose frequencies follow the batch are refused naming the field."""

from __future__ import annotations

import os
import random

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.helpers.runners import HfRunner, VllmRunner
from tests.helpers.tiny_configs import LFM2
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import copy_tokenizer
from vllm_mamba.layers.rope_scaling import rope_frequencies

HEAD_DIM = 64
SCALED = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 4096,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 16,
        "beta_slow": 2,
    },
    "yarn-untruncated": {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
        "truncate": False,
        "attention_factor": 1.25,
    },
}


def _llama_config(params: dict, partial: float = 1.0) -> transformers.LlamaConfig:
    rope = {"rope_theta": 10000.0, **params}
    if partial != 1.0:
        rope["partial_rotary_factor"] = partial
    return transformers.LlamaConfig(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        head_dim=HEAD_DIM,
        max_position_embeddings=8192,
        rope_parameters=rope,
    )


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", sorted(SCALED))
def test_frequencies_equal_transformers(name: str, partial: float) -> None:
    config = _llama_config(SCALED[name], partial)
    want_freq, want_factor = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu")
    got = rope_frequencies(config, int(HEAD_DIM * partial))
    torch.testing.assert_close(got.inv_freq, want_freq.float(), rtol=0, atol=0)
    assert got.attention_factor == pytest.approx(want_factor, rel=1e-12)
    plain = rope_frequencies(_llama_config({"rope_type": "default"}), int(HEAD_DIM * partial))
    assert not torch.equal(got.inv_freq, plain.inv_freq)  # the scaling did something


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope", "made-up"])
def test_batch_dependent_and_unknown_types_are_refused(rope_type: str) -> None:
    config = _llama_config({"rope_type": "default"})
    config.rope_parameters = {"rope_type": rope_type, "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match=f"rope_type '{rope_type}'"):
        rope_frequencies(config, HEAD_DIM)


def test_yarn_model_generates_transformers_tokens_past_the_original_context() -> None:
    """LFM2 with YaRN over an original context of 16 positions: prompts of 40-70 tokens, so
    most positions are beyond it and the attention factor scales every attention layer."""
    config = dict(LFM2["lfm2-mqa"], max_position_embeddings=256)
    config["rope_parameters"] = {
        "rope_type": "yarn",
        "rope_theta": 1000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 16,
    }
    torch.manual_seed(0)
    hf_config = transformers.Lfm2Config(**config, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = transformers.Lfm2ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    path = make_tmp_dir("tiny-lfm2-yarn-")
    model.save_pretrained(path)
    copy_tokenizer(path)
    assert os.path.exists(os.path.join(path, "config.json"))

    rng = random.Random(0)
    prompts = [[rng.randrange(2, 50000) for _ in range(n)] for n in (40, 70)]
    want = HfRunner(path, "Lfm2ForCausalLM").generate_greedy_logprobs(prompts, 12)
    with VllmRunner(path, max_model_len=256, max_num_seqs=4) as runner:
        got = runner.generate_greedy([{"prompt_token_ids": p} for p in prompts], 12)
    assert got == [tokens for tokens, _ in want]
    # Plain RoPE at the same weights computes other logits there: the test sees the scaling.
    hf_config.rope_parameters = {"rope_type": "default", "rope_theta": 1000.0}
    plain = transformers.Lfm2ForCausalLM(hf_config).eval()
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        ids = torch.tensor([prompts[1]])
        gap = (plain(ids).logits[0, -1] - model(ids).logits[0, -1]).abs().max().item()
    assert gap > 0.1
