"""Qwen3.5's checkpoints as released, beyond the family suite: image-text checkpoints on text
(with the vision tower loaded, and served text-only), and MoE checkpoints with fused experts.

A `Qwen3_5ForConditionalGeneration` checkpoint (transformers' class, a tiny vision tower beside
the language model under `model.language_model.*`, plus a multi-token prediction tensor as the
releases ship) holding the text weights of the registry's `qwen3_5-gqa` must generate exactly
what the text model generates, with its vision tower loaded and, with `language_model_only`,
with the vision and MTP tensors skipped (one log line each). A Qwen3.5-MoE checkpoint whose
experts are fused (`experts.gate_up_proj`, `experts.down_proj`) must load into the same
parameters as the per-expert one transformers saves.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.logs import captured
from tests.helpers.prompts import MAX_TOKENS, make_prompts
from tests.helpers.runners import VllmRunner
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import MODEL_FAMILY, build_hf_model, copy_tokenizer, tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.model_loader import build_model, load_hf_config

TEXT_MODEL = "qwen3_5-gqa"
_VISION = dict(
    depth=1,
    hidden_size=16,
    intermediate_size=32,
    num_heads=2,
    patch_size=4,
    temporal_patch_size=1,
    spatial_merge_size=1,
    out_hidden_size=64,
    num_position_embeddings=16,
)


def _image_text_checkpoint() -> str:
    """The text model's weights in an image-text checkpoint with a vision tower and MTP."""
    import transformers

    text = build_hf_model(TEXT_MODEL)
    text_config = dict(MODEL_FAMILY[TEXT_MODEL].configs[TEXT_MODEL], bos_token_id=0,
                       eos_token_id=0, pad_token_id=1)  # fmt: skip
    config = transformers.Qwen3_5Config(
        text_config=text_config, vision_config=_VISION, tie_word_embeddings=False
    )
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(config).eval()
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in text.state_dict().items():
            target = name.replace("model.", "model.language_model.", 1)
            own[target].copy_(tensor)
    path = make_tmp_dir("tiny-qwen3_5-image-text-")
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert any(n.startswith("model.visual.") for n in tensors)
    tensors["mtp.fc.weight"] = torch.randn(64, 128)  # the releases' MTP head, skipped
    save_file(tensors, file, metadata={"format": "pt"})
    copy_tokenizer(path)
    return path


def test_image_text_checkpoint_serves_the_text_model(caplog: pytest.LogCaptureFixture) -> None:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:6]]
    with VllmRunner(tiny_model_dir(TEXT_MODEL)) as runner:
        want = runner.generate(prompts, params)
    path = _image_text_checkpoint()
    with VllmRunner(path) as runner:  # the vision tower loaded: the text unchanged
        assert runner.engine.executor.model.serves_images
        with_tower = runner.generate(prompts, params)
    with (
        captured(caplog, "vllm_mamba.model_loader"),
        VllmRunner(path, language_model_only=True) as runner,
    ):
        got = runner.generate(prompts, params)
    for g, w in zip(with_tower, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    skipped = [r.getMessage() for r in caplog.records if "Skipped" in r.getMessage()]
    assert len(skipped) == 2 and "'model.visual.'" in skipped[0] and "'mtp.'" in skipped[1]
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_step.keys() == w_step.keys()
            for token, lp in g_step.items():
                assert abs(lp.logprob - w_step[token].logprob) <= 1e-6


def _fused_experts(per_expert: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-expert tensors of a checkpoint stacked into `gate_up_proj` and `down_proj`."""
    fused, experts = {}, {}
    for name, tensor in per_expert.items():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            fused[name] = tensor
            continue
        index, kind = tail.split(".")[:2]  # "E", "gate_proj" / "up_proj" / "down_proj"
        experts.setdefault(head, {}).setdefault(kind, {})[int(index)] = tensor
    for head, kinds in experts.items():

        def stack(kind: str, parts: dict = kinds) -> torch.Tensor:
            return torch.stack([parts[kind][e] for e in sorted(parts[kind])])

        fused[f"{head}.mlp.experts.gate_up_proj"] = torch.cat(
            [stack("gate_proj"), stack("up_proj")], 1
        )
        fused[f"{head}.mlp.experts.down_proj"] = stack("down_proj")
    return fused


def test_fused_expert_checkpoint_loads_as_per_expert() -> None:
    source = tiny_model_dir("qwen3_5-moe-top2")
    path = make_tmp_dir("tiny-qwen3_5-moe-fused-")
    shutil.copy(os.path.join(source, "config.json"), path)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    fused = _fused_experts(tensors)
    assert any(n.endswith("experts.gate_up_proj") for n in fused) and len(fused) < len(tensors)
    save_file(fused, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    cpu = torch.device("cpu")
    want, _ = build_model(source, load_hf_config(source), torch.float32, cpu)
    got, _ = build_model(path, load_hf_config(path), torch.float32, cpu)
    want_params = dict(want.named_parameters())
    for name, param in got.named_parameters():
        assert torch.equal(param, want_params[name]), name
