"""RWKV-4 beyond the family suite: the `rescale_every` decision, float32 WKV state under
bfloat16, a long prompt with large keys, a WKV narrower than the hidden size, and what a fresh
slot's zeros mean to the WKV ops.

The suite (`tests/models/test_families.py`, family `rwkv4`) runs the tiny checkpoints against
transformers' `generate` (each prompt alone at batch 1, as its one-token decode mixes the rows
of a larger batch) and every engine check.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.prompts import make_prompts
from tests.helpers.runners import HfRunner, VllmRunner
from tests.tiny_models import copy_tokenizer, tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.layers.rwkv4 import Rwkv4ChannelMix, Rwkv4TimeMix
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops import rwkv4 as rwkv4_ops
from vllm_mamba.ops.families import family_ops

STEPS = 8


def _save(path: str, seed: int = 0, key_scale: float = 1.0, **config: object) -> str:
    """A tiny transformers RWKV-4 with weights drawn as the registry does (std 0.3, the
    LayerNorms kept), its `attention.key` weights times `key_scale`, saved at `path`."""
    from transformers import RwkvConfig, RwkvForCausalLM

    base = dict(vocab_size=50280, hidden_size=32, intermediate_size=64, num_hidden_layers=4)
    torch.manual_seed(seed)
    model = RwkvForCausalLM(RwkvConfig(**{**base, **config}, bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not any(n in name for n in ("pre_ln", "ln1", "ln2", "ln_out")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            if name.endswith("attention.key.weight"):
                p.mul_(key_scale)
    model.save_pretrained(path)
    copy_tokenizer(path)
    return path


def _engine_logprobs(path: str, prompts: list[list[int]], **engine: object) -> list[torch.Tensor]:
    """Per prompt, the engine's logprob of each prompt token after the first `(n - 1,)`."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    with VllmRunner(path, **engine) as runner:
        outs = runner.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [
        torch.tensor([entry[t].logprob for entry, t in zip(o.prompt_logprobs[1:], p[1:])])
        for o, p in zip(outs, prompts)
    ]


def _hf_logprobs(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers' full forward (no state cache, which is sized by `hidden_size`)."""
    hf = HfRunner(path, "RwkvForCausalLM")
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = hf.model(torch.tensor([p]), use_cache=False).logits[0].float()
            lp = logits.log_softmax(-1)[:-1]  # (n - 1, V)
            out.append(lp[torch.arange(len(p) - 1), torch.tensor(p[1:])])
    return out


def test_rescale_is_reproduced(tmp_path) -> None:  # noqa: ANN001
    """`rescale_every` 1 over 4 blocks (the hidden states halved 4 times): the engine's
    weights are divided as transformers' in eval mode and its logprobs are transformers'; the
    same weights without rescaling differ only by LayerNorm's epsilon, far more than the
    engine and transformers do."""
    path = _save(str(tmp_path / "r1"), rescale_every=1)
    prompts = make_prompts()[3:6]
    got = _engine_logprobs(path, prompts)
    want = _hf_logprobs(path, prompts)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5)

    with VllmRunner(path) as runner:
        blocks = runner.engine.model.layers
        hf = HfRunner(path, "RwkvForCausalLM").model
        for i, block in enumerate(blocks):
            for ours, theirs in (
                (block.attention.output.weight, hf.rwkv.blocks[i].attention.output.weight),
                (block.feed_forward.value.weight, hf.rwkv.blocks[i].feed_forward.value.weight),
            ):
                torch.testing.assert_close(ours * 2**i, theirs, rtol=0, atol=0)

    plain = _save(str(tmp_path / "r0"), rescale_every=0)  # the same weights, seed and all
    unscaled = _hf_logprobs(plain, prompts)
    gap = max((u - w).abs().max().item() for u, w in zip(unscaled, want))
    ours = max((g - w).abs().max().item() for g, w in zip(got, want))
    assert 0 < gap < 1e-2, gap  # epsilon only
    assert ours < gap / 10, (ours, gap)


def test_narrow_wkv_matches_transformers(tmp_path) -> None:  # noqa: ANN001
    """`attention_hidden_size` below `hidden_size` (transformers' generate cannot run it)."""
    path = _save(str(tmp_path / "narrow"), attention_hidden_size=16, rescale_every=3)
    prompts = make_prompts()[2:5]
    for g, w in zip(_engine_logprobs(path, prompts), _hf_logprobs(path, prompts)):
        torch.testing.assert_close(g, w, rtol=0, atol=2e-5)


def test_bfloat16_keeps_float32_wkv_state() -> None:
    path = tiny_model_dir("rwkv4-rescale")
    params = SamplingParams(temperature=0, max_tokens=STEPS, logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in make_prompts()]
    with VllmRunner(path, dtype="bfloat16") as runner:
        for layer in runner.engine.model.layers:
            attn, ffn = layer.attention, layer.feed_forward
            assert isinstance(attn, Rwkv4TimeMix) and isinstance(ffn, Rwkv4ChannelMix)
            assert attn.key.weight.dtype == torch.bfloat16
            for name in ("num", "den", "max"):
                assert attn.state[name].dtype == torch.float32, name
            assert attn.state["shift"].dtype == ffn.state["shift"].dtype == torch.bfloat16
            assert attn.w.dtype == attn.u.dtype == torch.float32
        low = runner.generate(prompts, params)
    with VllmRunner(path) as runner:
        full = runner.generate(prompts, params)
    same = 0
    for a, b in zip(low, full):
        got = a.outputs[0]
        assert all(math.isfinite(e[t].logprob) for e, t in zip(got.logprobs, got.token_ids))
        same += got.token_ids[0] == b.outputs[0].token_ids[0]
    assert same >= len(prompts) - 2, same  # bfloat16 rounding may swap a near tie


def test_long_prompt_with_large_keys_stays_finite(tmp_path) -> None:  # noqa: ANN001
    """Keys of hundreds (exp would overflow float32 without the running maximum) over a
    600-token prompt, whole and in chunks of 64: finite and transformers' logprobs."""
    path = _save(str(tmp_path / "keys"), key_scale=60.0, num_hidden_layers=2, rescale_every=0)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(2, 50277, (600,), generator=g).tolist()
    with VllmRunner(path) as runner:
        keys = runner.engine.model.layers[0].attention.key.weight
        assert keys.abs().max() > 50  # |k| reaches hundreds for LayerNorm-ed inputs
    whole = _engine_logprobs(path, [prompt])[0]
    chunked = _engine_logprobs(path, [prompt], max_num_batched_tokens=64)[0]
    assert torch.isfinite(whole).all() and torch.isfinite(chunked).all()
    want = _hf_logprobs(path, [prompt])[0]
    torch.testing.assert_close(whole, want, rtol=0, atol=1e-4)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-4)


@pytest.mark.parametrize("backend", ["ref", "cpp"])
def test_fresh_slot_zeros_are_never_read(backend: str) -> None:
    """The engine zero-fills a fresh slot (`max` 0, not `MAX_INIT`): without an initial state
    the ops start from `(0, 0, MAX_INIT)` whatever the slot holds, so very negative keys
    (whose `exp(k - max)` underflows against `max` 0) still give `v`; a decode row then reads
    what the prefill wrote."""
    if backend == "cpp" and not cpu_kernels.available():
        pytest.skip("the C++ extension is not built")
    ops = family_ops(rwkv4_ops.FAMILY, backend)
    c = 8
    w = -torch.exp(torch.randn(c))
    u = torch.randn(c)
    k = torch.full((3, c), -200.0)  # one sequence of 2 tokens, one of 1
    v = torch.randn(3, c)
    num, den, mx = torch.zeros(4, c), torch.zeros(4, c), torch.zeros(4, c)  # fresh slots
    qsl = torch.tensor([0, 2, 3], dtype=torch.int32)
    slots = torch.tensor([1, 3], dtype=torch.int32)
    fresh = torch.tensor([False, False])
    out = ops.varlen(w, u, k, v, num, den, mx, qsl, slots, fresh)
    torch.testing.assert_close(out[[0, 2]], v[[0, 2]])  # a first token's wkv is its value
    assert torch.isfinite(out).all() and torch.isfinite(num[[1, 3]]).all()
    assert (den[[1, 3]] > 0).all() and (mx[[1, 3]] < -100).all()
    assert (num[[0, 2]] == 0).all() and (mx[[0, 2]] == 0).all()  # other slots untouched
    step = ops.update(w, u, k[:2], v[:2], num, den, mx, torch.tensor([1, PAD_SLOT_ID]))
    assert torch.isfinite(step).all()
