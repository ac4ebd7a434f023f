"""What is Zamba2's own beyond the family checks (`tests/models/test_families.py`): shared
attention blocks reused at several depths, with one KV cache layer per use; both checkpoint
layouts of the shared blocks (stored once, or under every use); prompt logprobs of one-token
and 5-token prefill chunks close to whole prefill; config errors that name their field."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers import family_checks as checks
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.model_loader import load_hf_config
from vllm_mamba.models.zamba2 import Zamba2ForCausalLM
from vllm_mamba.ops.dispatch import get_mamba_ops

MODEL = "zamba2-lora-rope"  # two shared blocks, block 0 used twice, tied


def test_each_use_of_a_shared_block_has_its_own_kv_layer() -> None:
    """Three hybrid layers over two blocks: one weight set per block, three KV layers."""
    with VllmRunner(tiny_model_dir(MODEL)) as runner:
        model = runner.engine.executor.model
        hybrid = [layer for layer in model.model.layers if hasattr(layer, "shared_transformer")]
        assert hybrid[0].shared_transformer is hybrid[2].shared_transformer
        assert hybrid[0].shared_transformer is not hybrid[1].shared_transformer
        kv = {id(layer.attn.kv.k) for layer in hybrid}
        assert len(kv) == 3


def test_checkpoint_with_every_use_copied_loads_the_same() -> None:
    """Checkpoints may store a shared block under each use (tied copies), not only the first."""
    src = tiny_model_dir(MODEL)
    weights = load_file(os.path.join(src, "model.safetensors"))
    first, again = "model.layers.1.shared_transformer.", "model.layers.5.shared_transformer."
    copies = {again + k[len(first) :]: v.clone() for k, v in weights.items() if k.startswith(first)}
    assert copies and not any(k.startswith(again) for k in weights)
    path = make_tmp_dir("tiny-zamba2-copies-")
    for file in os.listdir(src):
        if file != "model.safetensors":
            shutil.copy(os.path.join(src, file), path)
    save_file({**weights, **copies}, os.path.join(path, "model.safetensors"))
    prompts = checks.prompts()[:4]
    with VllmRunner(path) as runner:
        assert checks.tokens(runner.generate(prompts, checks.GREEDY)) == checks.alone(src)[:4]


def test_chunked_prefill_logprobs_close_to_whole() -> None:
    """Prompt logprobs of one-token and 5-token chunks against one whole prefill (100 tokens:
    SSD chunks of 16 and KV blocks of 16 cut everywhere). They differ by float32 rounding only
    (about 4e-5: the SSD splits its sums at other chunk boundaries, attention its blocks). The
    time step clamp at `time_step_min` never binds here; where it binds, a one-token chunk runs
    as a decode, which does not clamp (transformers' and vLLM's decode step neither), and
    chunked prefill departs from whole prefill there."""
    path = tiny_model_dir(MODEL)
    prompt = checks.prompts()[6]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    ids = prompt["prompt_token_ids"]

    def prompt_logprobs(**kwargs: int) -> torch.Tensor:
        with VllmRunner(path, **kwargs) as runner:
            out = runner.generate(prompt, params)[0].prompt_logprobs
        return torch.tensor([out[i][t].logprob for i, t in enumerate(ids) if i])

    whole = prompt_logprobs()
    for budget in (1, 5):
        got = prompt_logprobs(max_num_batched_tokens=budget)
        torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (dict(num_key_value_heads=2), "use_shared_attention_adapter"),
        (dict(num_attention_heads=5), "num_attention_heads"),
        (dict(hidden_act="quick_gelu"), "hidden_act"),
        (dict(layers_block_type=["mamba", "attention"] * 3), "layers_block_type"),
    ],
)
def test_bad_config_names_the_field(change: dict, field: str) -> None:
    config = load_hf_config(tiny_model_dir(MODEL))
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=field), torch.device("meta"):
        Zamba2ForCausalLM(config, get_mamba_ops(torch.device("cpu")))
