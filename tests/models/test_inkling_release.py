"""Inkling's checkpoints as released: image-text models served text-only.

`thinkingmachines/Inkling`, `Inkling-2-Small` and `Inkling-2-Mini` ship as
`Inkling*ForConditionalGeneration` checkpoints: the language model under `model.llm.*` in its
own names (Inkling 1's gate and up rows interleaved in one tensor), beside vision (and for
Inkling 1 audio) towers. transformers' own converter writes those names back
(`save_pretrained` of its conditional-generation class). A release checkpoint holding the text
weights of a tiny Inkling must load into exactly the parameters the text checkpoint loads into,
with the towers skipped, and generate what the text checkpoint generates.
"""

from __future__ import annotations

import os

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

# text variant -> (transformers' release class, its config class, the towers it carries)
RELEASES = {
    "inkling-gqa": ("InklingForConditionalGeneration", "InklingConfig", ("visual", "audio")),
    "inkling-mqa": ("InklingForConditionalGeneration", "InklingConfig", ("visual", "audio")),
    "inkling2-gqa": ("Inkling2ForConditionalGeneration", "Inkling2Config", ("visual",)),
    "inkling2-loop-gqa": (
        "Inkling2LoopForConditionalGeneration",
        "Inkling2LoopConfig",
        ("visual",),
    ),
}


def _towers(text: str, hidden: int) -> dict:
    """Tiny vision (and audio) tower configs for the release class of `text`."""
    vision = dict(text_hidden_size=hidden, hidden_size=16, num_hidden_layers=1,
                  num_attention_heads=2, patch_size=4)  # fmt: skip
    if text.startswith("inkling2"):
        return dict(vision_config=dict(vision, posemb_grid_size=4, projection_hidden_dim=32))
    audio = dict(text_hidden_size=hidden, n_mel_bins=4, mel_vocab_size=8)
    return dict(vision_config=vision, audio_config=audio)


def _release_checkpoint(text: str) -> str:
    """The text model's weights in transformers' release class, saved in the release's names,
    plus an MTP tensor for Inkling 1 (its release ships them, skipped here)."""
    import transformers

    cls, config_cls, towers = RELEASES[text]
    source = build_hf_model(text)
    text_config = dict(MODEL_FAMILY[text].configs[text], bos_token_id=0, eos_token_id=0,
                       pad_token_id=1)  # fmt: skip
    config = getattr(transformers, config_cls)(
        text_config=text_config, **_towers(text, text_config["hidden_size"])
    )
    torch.manual_seed(0)
    model = getattr(transformers, cls)(config).eval()
    own = model.state_dict()
    with torch.no_grad():
        for name, tensor in source.state_dict().items():
            own[name.replace("model.", "model.language_model.", 1)].copy_(tensor)
    path = make_tmp_dir(f"tiny-{text}-release-")
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert all(any(n.startswith(f"model.{t}.") for n in tensors) for t in towers)
    assert any(n.startswith("model.llm.layers.") for n in tensors)
    if "audio" in towers:
        assert any(n.endswith("w13_weight") for n in tensors)
        tensors["model.mtp.0.eh_proj.weight"] = torch.randn(8, 8)
    save_file(tensors, file, metadata={"format": "pt"})
    copy_tokenizer(path)
    return path


@pytest.mark.parametrize("text", sorted(RELEASES))
def test_release_checkpoint_loads_the_text_parameters(text: str) -> None:
    source, path = tiny_model_dir(text), _release_checkpoint(text)
    cpu = torch.device("cpu")
    want, _ = build_model(source, load_hf_config(source), torch.float32, cpu)
    got, _ = build_model(path, load_hf_config(path), torch.float32, cpu)
    assert type(got).__name__ == RELEASES[text][0]
    want_params = dict(want.named_parameters())
    got_params = dict(got.named_parameters())
    assert got_params.keys() == want_params.keys()
    for name, param in got_params.items():
        assert torch.equal(param, want_params[name]), name


def test_inkling_release_generates_what_the_text_model_generates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    text = "inkling-gqa"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()[:4]]
    with VllmRunner(tiny_model_dir(text)) as runner:
        want = runner.generate(prompts, params)
    path = _release_checkpoint(text)
    with captured(caplog, "vllm_mamba.model_loader"), VllmRunner(path) as runner:
        got = runner.generate(prompts, params)
    skipped = " ".join(r.getMessage() for r in caplog.records if "Skipped" in r.getMessage())
    assert all(f"'model.{t}.'" in skipped for t in ("visual", "audio", "mtp"))
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_step, w_step in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_step.keys() == w_step.keys()
            for token, lp in g_step.items():
                assert lp.logprob == w_step[token].logprob


def _microscaled(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The release's experts as the Inkling 2 releases store them: random NVFP4 `w13` (E2M1
    pairs, float8 scales per 16, a per-expert amax over a denominator) and MXFP8 `w2` (float8
    values, E8M0 scales per 32)."""
    g = torch.Generator().manual_seed(3)
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("mlp.experts.w13_weight"):
            e, rows, cols = tensor.shape
            out[name] = torch.randint(0, 256, (e, rows, cols // 2), generator=g, dtype=torch.uint8)
            scale = torch.rand(e, rows, cols // 16, generator=g) * 0.5 + 0.01
            out[name + "_scale"] = scale.to(torch.float8_e4m3fn)
            out[name + "_amax"] = torch.rand(e, generator=g) * 4 + 1
            out[name + "_outer_scale_denominator"] = torch.full((e,), 6.0 * 448.0)
        elif name.endswith("mlp.experts.w2_weight"):
            e, rows, cols = tensor.shape
            values = torch.randn(e, rows, cols, generator=g) * 4
            out[name] = values.to(torch.float8_e4m3fn)
            exponents = torch.randint(118, 126, (e, rows, cols // 32), generator=g)
            out[name + "_scale"] = exponents.to(torch.uint8)
        else:
            out[name] = tensor
    return out


def test_microscaled_release_experts_load_as_transformers_dequantises_them() -> None:
    import transformers

    text = "inkling2-loop-gqa"
    path = _release_checkpoint(text)
    file = os.path.join(path, "model.safetensors")
    tensors = _microscaled(load_file(file))
    save_file(tensors, file, metadata={"format": "pt"})
    want = transformers.Inkling2LoopForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32
    ).state_dict()
    got, _ = build_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    checked = 0
    for name, param in got.named_parameters():
        head, sep, tail = name.partition(".mlp.experts.")
        if not sep:
            continue
        index, kind = tail.split(".")[:2]
        stacked = head.replace("model.", "model.language_model.", 1) + ".mlp.experts."
        if kind == "down_proj":
            ref = want[stacked + "down_proj"][int(index)]
        else:
            gate, up = want[stacked + "gate_up_proj"][int(index)].chunk(2, 0)
            ref = gate if kind == "gate_proj" else up
        assert torch.equal(param, ref), name
        checked += 1
    assert checked > 0
    del tensors[next(n for n in tensors if n.endswith("w13_weight_amax"))]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="_amax"):
        build_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
