"""Scaled RoPE (`layers/rope_scaling.py`, `layers/rotary_embedding.py`) against transformers:

- the frequencies and attention factor of each type (`linear`, `llama3`, `yarn` with its
  variants, `dynamic`, `longrope`) equal `ROPE_INIT_FUNCTIONS`' own, at the initial length and,
  for the two that follow the sequence's length, at lengths past the threshold;
- tiny LFM2s with each of `linear`, `yarn`, `dynamic` and `longrope` generate transformers'
  greedy tokens and logprobs (`generate` on each prompt alone, a fresh model each) for prompts
  before, across and past the original context, batched together and prefilled in chunks in
  the engine (`dynamic` and `longrope` also preempted and recomputed under KV pressure, and
  with speculative decoding);
- a tiny Qwen3.5 with M-RoPE sections (`mrope_section`, `mrope_interleaved`) and partial RoPE
  combined with `yarn` does the same for text;
- Qwen2-VL's `mrope` type is plain RoPE, as transformers reads it;
- an unknown type, or longrope factor lists of the wrong length, are refused naming the field."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tests.helpers.runners import HfRunner, VllmRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.helpers.tiny_configs import LFM2, QWEN3_5
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import MODEL_FAMILY, copy_tokenizer
from vllm_mamba import SamplingParams
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
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 64},
    "longrope-factors": {
        "rope_type": "longrope",
        "original_max_position_embeddings": 512,
        "factor": 6.0,
        "attention_factor": 1.1,
    },
}
LENGTH_TYPES = ("dynamic", "longrope", "longrope-factors")


def _longrope_lists(pairs: int) -> dict:
    """Distinct short and long factors per rotated pair (as Phi-3's rising lists)."""
    return {
        "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
        "long_factor": [1.0 + 0.9 * i for i in range(pairs)],
    }


def _llama_config(params: dict, partial: float = 1.0) -> transformers.LlamaConfig:
    rope = {"rope_theta": 10000.0, **params}
    if rope["rope_type"] == "longrope":
        rope.update(_longrope_lists(int(HEAD_DIM * partial) // 2))
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
    if name != "dynamic":  # dynamic starts from the plain frequencies (checked past it below)
        assert not torch.equal(got.inv_freq, plain.inv_freq)  # the scaling did something


@pytest.mark.parametrize("partial", [1.0, 0.5])
@pytest.mark.parametrize("name", LENGTH_TYPES)
def test_frequencies_past_the_threshold_equal_transformers(name: str, partial: float) -> None:
    """`dynamic` at sequence lengths past `max_position_embeddings` (8192), `longrope` past
    `original_max_position_embeddings`: transformers' frequencies at `seq_len`, row by row."""
    config = _llama_config(SCALED[name], partial)
    init = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]]
    rule = rope_frequencies(config, int(HEAD_DIM * partial)).by_length
    assert rule is not None
    lengths = [rule.threshold + 1, rule.threshold + 77, 3 * rule.threshold, 40000]
    got = rule.frequencies(torch.tensor(lengths))  # (N, R/2)
    for row, length in zip(got, lengths):
        want, _ = init(config, "cpu", seq_len=torch.tensor(length))
        torch.testing.assert_close(row, want.float(), rtol=0, atol=0)
    assert not torch.equal(got[0], rope_frequencies(config, int(HEAD_DIM * partial)).inv_freq)


def test_mrope_type_is_plain_rope() -> None:
    """Qwen2-VL's older `{"type": "mrope", "mrope_section": ...}`: transformers' config reads
    it as `default`; here the same plain frequencies (`base ** (-2i / R)`, no factor)."""
    rope = {"type": "mrope", "mrope_section": [16, 8, 8], "rope_theta": 1e4}
    hf = transformers.Qwen2VLTextConfig(
        hidden_size=4 * HEAD_DIM, num_attention_heads=4, rope_parameters=dict(rope)
    )
    assert hf.rope_parameters["rope_type"] == "default"
    config = _llama_config({"rope_type": "default"})
    config.rope_parameters = dict(rope)
    got = rope_frequencies(config, HEAD_DIM)
    want = 1.0 / 1e4 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    torch.testing.assert_close(got.inv_freq, want.float())
    assert got.attention_factor == 1.0 and got.by_length is None


def test_unknown_type_and_misshaped_longrope_are_refused() -> None:
    config = _llama_config({"rope_type": "default"})
    config.rope_parameters = {"rope_type": "made-up", "rope_theta": 10000.0, "factor": 2.0}
    with pytest.raises(ValueError, match="rope_type 'made-up'"):
        rope_frequencies(config, HEAD_DIM)
    config = _llama_config(SCALED["longrope"])
    config.rope_parameters["long_factor"] = [1.0, 2.0]
    with pytest.raises(ValueError, match="long_factor must list 32 numbers"):
        rope_frequencies(config, HEAD_DIM)


# LFM2 "lfm2-mqa" (heads of 16: 8 rotated pairs). The threshold of dynamic is
# `max_position_embeddings` (32 here), of the others `original_max_position_embeddings` (16).
LFM2_ROPE = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, 256),
    "yarn": ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}, 256),
    "dynamic": ({"rope_type": "dynamic", "factor": 4.0}, 32),
    "longrope": (
        {"rope_type": "longrope", "original_max_position_embeddings": 16, **_longrope_lists(8)},
        256,
    ),
}
# Prompts of 10 and 24 tokens cross the thresholds (16, 32) while decoding; 40 and 70 start past.
PROMPT_LENS = (10, 24, 40, 70)
MAX_TOKENS = 16


def _save_tiny(variant: str, cls_name: str, config: dict, std: float, prefix: str) -> str:
    """A transformers model of `config` (tiny `variant` with its RoPE changed) with weights
    drawn at `std` (norms kept or, when zero-centred, drawn small), saved with the tokenizer."""
    torch.manual_seed(0)
    model_cls = getattr(transformers, cls_name)
    hf_config = model_cls.config_class(**config, bos_token_id=0, eos_token_id=0, pad_token_id=1)
    model = model_cls(hf_config).eval()
    norm_names = MODEL_FAMILY[variant].norm_names
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = any(part in name for part in norm_names)
            if is_norm and not p.any():
                p.normal_(0, 0.1)
            elif not is_norm and not name.endswith(("A_log", ".D")) and p.dim() > 1:
                p.normal_(0, std)
    path = make_tmp_dir(prefix)
    model.save_pretrained(path)
    copy_tokenizer(path)
    assert os.path.exists(os.path.join(path, "config.json"))
    return path


def _assert_engine_matches_transformers(
    path: str, cls_name: str, pressure: bool = False
) -> list[list[int]]:
    """Greedy tokens equal, logprobs of them within 1e-4: every prompt batched in the engine,
    prefilled in chunks of at most 24 tokens, against transformers' `generate` on each prompt
    alone in a freshly loaded model (dynamic RoPE keeps its longest length in the rotary module
    across calls). With `pressure`, once more in 8 KV blocks of 16 (the four sequences need 15:
    preempted sequences are recomputed from their prompt and generated tokens) and once with
    speculative decoding (chains of 3 drafts, partly right, verified in one step)."""
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 50000) for _ in range(n)] for n in PROMPT_LENS]
    want = [HfRunner(path, cls_name).generate_greedy_logprobs([p], MAX_TOKENS)[0] for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    engines = [dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=24)]
    if pressure:
        engines.append(dict(engines[0], block_size=16, num_gpu_blocks_override=8))
        spec = {"method": "ngram", "num_speculative_tokens": 3}
        engines.append(dict(engines[0], speculative_config=spec))
    for engine in engines:
        with VllmRunner(path, **engine) as runner:
            if "speculative_config" in engine:  # drafts from the reference, every third wrong
                refs = {tuple(p): tokens for p, (tokens, _) in zip(prompts, want)}
                runner.engine.spec_steps.proposer = OracleProposer(refs)
            outs = runner.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert (runner.engine.stats.preemptions > 0) == ("num_gpu_blocks_override" in engine)
            if "speculative_config" in engine:
                counters = runner.engine.spec_steps.counters
                assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        for out, (tokens, ref_lp) in zip(outs, want):
            got = out.outputs[0]
            assert got.token_ids == tokens
            lp = torch.tensor([got.logprobs[i][t].logprob for i, t in enumerate(tokens)])
            want_lp = ref_lp[torch.arange(len(tokens)), tokens]
            torch.testing.assert_close(lp, want_lp, rtol=0, atol=1e-4)
    return prompts


def _assert_scaling_changes_logits(path: str, cls_name: str, prompt: list[int]) -> None:
    """Plain RoPE at the same weights computes other logits on `prompt`: the test sees the
    scaling (the engine would fail it by ignoring `rope_parameters`)."""
    scaled = HfRunner(path, cls_name).model
    config = copy.deepcopy(scaled.config)
    config.rope_parameters = {
        k: v
        for k, v in config.rope_parameters.items()
        if k in ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved")
    }
    config.rope_parameters["rope_type"] = "default"
    plain = type(scaled)(config).eval()
    plain.load_state_dict(scaled.state_dict())
    with torch.no_grad():
        ids = torch.tensor([prompt])
        gap = (plain(ids).logits[0, -1] - scaled(ids).logits[0, -1]).abs().max().item()
    assert gap > 0.1


@pytest.mark.parametrize("rope_type", sorted(LFM2_ROPE))
def test_lfm2_generates_transformers_tokens_past_the_original_context(rope_type: str) -> None:
    """LFM2 (transformers applies every type through `dynamic_rope_update`); the types that
    follow the sequence's length also under KV pressure (preemption by recompute) and with
    speculative decoding."""
    rope, max_positions = LFM2_ROPE[rope_type]
    config = dict(LFM2["lfm2-mqa"], max_position_embeddings=max_positions)
    config["rope_parameters"] = {"rope_theta": 1000.0, **rope}
    path = _save_tiny("lfm2-mqa", "Lfm2ForCausalLM", config, 0.3, f"tiny-lfm2-{rope_type}-")
    by_length = rope_type in ("dynamic", "longrope")
    prompts = _assert_engine_matches_transformers(path, "Lfm2ForCausalLM", pressure=by_length)
    _assert_scaling_changes_logits(path, "Lfm2ForCausalLM", prompts[-1])


def test_qwen3_5_mrope_sections_with_yarn() -> None:
    """Qwen3.5 "qwen3_5-mqa" (heads of 32, RoPE on 8 dims: 4 pairs in sections [2, 1, 1],
    interleaved): for text all three position rows are equal, so transformers' M-RoPE is the
    plain partial RoPE, here scaled by YaRN (its ramp and attention factor over the 4 pairs)."""
    scaling = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16}
    config = dict(QWEN3_5["qwen3_5-mqa"], max_position_embeddings=256)
    config["rope_parameters"] = {
        **config["rope_parameters"],
        **scaling,
        "mrope_section": [2, 1, 1],
        "mrope_interleaved": True,
    }
    std = MODEL_FAMILY["qwen3_5-mqa"].weight_std
    path = _save_tiny("qwen3_5-mqa", "Qwen3_5ForCausalLM", config, std, "tiny-qwen35-yarn-")
    prompts = _assert_engine_matches_transformers(path, "Qwen3_5ForCausalLM")
    _assert_scaling_changes_logits(path, "Qwen3_5ForCausalLM", prompts[-1])


def test_cpu_table_starts_small_and_grows_with_the_positions() -> None:
    """A config naming ten million positions (MiniMax-Text-01) builds no 5 GB table: the CPU
    table starts at 8192 rows and grows to cover the positions it meets, with the values of a
    direct cos / sin at each position (angles in float32, as transformers computes them)."""
    from vllm_mamba.layers.rotary_embedding import DEFAULT_TABLE_POSITIONS, RotaryEmbedding
    from vllm_mamba.ops.rotary_embedding import rotary_embedding_ref

    config = transformers.LlamaConfig(
        hidden_size=64, num_attention_heads=4, max_position_embeddings=10_240_000
    )
    rope = RotaryEmbedding.from_config(config, 16)
    q, k = torch.randn(3, 16), torch.randn(3, 16)
    for positions in (torch.tensor([0, 5, 100]), torch.tensor([9000, 20000, 3])):
        got_q, got_k = rope(positions, q, k)
        table = rope.table(positions)
        assert DEFAULT_TABLE_POSITIONS <= table.shape[0] <= 2 * 20001
        inv = rope.freqs.inv_freq
        angles = positions.float()[:, None] * inv.float()[None, :]  # (3, 8)
        direct = torch.cat([angles.cos(), angles.sin()], -1)
        want_q, want_k = rotary_embedding_ref(torch.arange(3), q[:, None], k[:, None], direct, True)
        torch.testing.assert_close(got_q, want_q[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_k, want_k[:, 0], atol=1e-5, rtol=1e-5)
    assert rope.positions == 10_240_000
