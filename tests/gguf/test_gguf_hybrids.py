"""The hybrid families' GGUF architectures map llama.cpp's files back onto the checkpoints.

For each architecture llama.cpp's converter writes (`tests.gguf.hybrid_checkpoints`: a tiny
model of the registry, converted at F32), read with gguf-py's own `GGUFReader`:

- tensors: the mapping gives back every tensor of the safetensors checkpoint under its name,
  nothing more, bit for bit, except where the converter's transform is not exactly invertible
  in float32: norms written as `1 + w` come back as `(1 + w) - 1` (then `1 + w` again in the
  model), `A_log` written as `-exp(A_log)` within float32 rounding, and Falcon-H1's weights
  with its muP multipliers folded in as the converter folds them (the formulas written here
  from `conversion/*.py`);
- config: the transformers config built from `config(metadata)` equals the checkpoint's,
  key by key, apart from training-only keys and the differences each case states (values the
  file does not hold, and their class defaults);
- Q8_0 files (`Q8_0_CASES`): the mapping gives the same values from the engine's decoded
  blocks as from gguf-py's dequantisation, and every 2-D Q8_0 tensor keeps its integer
  layout (which dequantises to those values) through its renames, row permutations,
  concatenations and Qwen3.5's head-by-head column permutation;
- end to end: `LLM(model=file.gguf)` gives the safetensors model's greedy tokens.
"""

from __future__ import annotations

import functools
import json
import math
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.gguf.hybrid_checkpoints import CASES, Q8_0_CASES, checkpoints
from tests.helpers.tmp_dirs import make_tmp_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.gguf.arch import gguf_architecture
from vllm_mamba.gguf.blocks import decode_tensor
from vllm_mamba.gguf.metadata import TENSOR_NAMES, TENSOR_SHAPES
from vllm_mamba.layers.packed_weights import packed_of

pytestmark = pytest.mark.xdist_group("gguf_hybrids")

# Nemotron-H: chunk size and the time-step bounds are not written (llama.cpp does not clamp);
# the converter writes 2**20 as the context; transformers ignores Nemotron-H's tying.
_NEMOTRON_UNWRITTEN = {
    "chunk_size", "time_step_min", "time_step_max", "time_step_floor",
    "max_position_embeddings", "tie_word_embeddings",
}  # fmt: skip

# Config keys no GGUF holds and no model here reads (training and bookkeeping).
_TRAINING = {
    "transformers_version", "dtype", "initializer_range", "use_cache", "attention_dropout",
    "hidden_dropout", "output_router_logits", "router_aux_loss_coef", "z_loss_coefficient",
    "num_logits_to_keep", "rescale_prenorm_residual", "use_mamba_kernels", "_name_or_path",
    "mamba_ssm_cache_dtype", "residual_in_fp32", "mtp_layers_block_type",
}  # fmt: skip
# Per case: config keys that differ, and why.
_DIFFERENCES = {
    # Moonshot's spelling of `layer_types` / `mlp_layer_types` (compared under those names),
    # written for the converter only.
    "kimi-linear": {"linear_attn_config", "first_k_dense_replace"},
    # SSD chunk sizes are not in the file (class defaults): chunking changes rounding only.
    "granitehybrid": {"mamba_chunk_size", "max_position_embeddings"},  # NoPE: 2**20 written
    "bamba": {"mamba_chunk_size"},
    "falcon-h1": {"mamba_chunk_size"}
    | {
        # the multipliers are folded into the weights and written as 1.0
        "embedding_multiplier",
        "lm_head_multiplier",
        "mlp_multipliers",
        "key_multiplier",
        "attention_in_multiplier",
        "attention_out_multiplier",
        "ssm_in_multiplier",
        "ssm_out_multiplier",
        "ssm_multipliers",
    },  # fmt: skip
    "nemotron_h": _NEMOTRON_UNWRITTEN,
    # no layer is a dense MLP: its width is neither written nor used
    "nemotron_h_moe": _NEMOTRON_UNWRITTEN | {"intermediate_size"},
}


@functools.cache
def _metadata(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """The file's metadata (with the two keys `GGUFFormat` adds) and its tensors (PyTorch
    order), read by gguf-py."""
    reader = gguf.GGUFReader(path)
    # The vocabulary's arrays by their length only (the mappings count the tokens; decoding
    # 50k strings takes seconds).
    metadata = {
        key: [None] * len(field.data)
        if key.startswith("tokenizer.ggml.") and len(field.data) > 1000
        else field.contents()
        for key, field in reader.fields.items()
    }
    tensors = {  # F32 as stored; quantised blocks dequantised by gguf-py
        t.name: torch.from_numpy(
            np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
        ).reshape([int(s) for s in reversed(t.shape)])
        for t in reader.tensors
    }
    metadata[TENSOR_SHAPES] = {name: tuple(t.shape) for name, t in tensors.items()}
    metadata[TENSOR_NAMES] = frozenset(tensors)
    return metadata, tensors


def _falcon_folded(name: str, w: torch.Tensor, config: dict) -> torch.Tensor:
    """Falcon-H1's tensor as `FalconH1Model.modify_tensors` writes it (multipliers folded)."""
    m = config
    if "down_proj" in name:
        return w * m["mlp_multipliers"][1]
    if "gate_proj" in name:
        return w * m["mlp_multipliers"][0]
    if "k_proj" in name:
        return w * m["key_multiplier"] * m["attention_in_multiplier"]
    if "q_proj" in name or "v_proj" in name:
        return w * m["attention_in_multiplier"]
    if "o_proj" in name:
        return w * m["attention_out_multiplier"]
    if "out_proj" in name:
        return w * m["ssm_out_multiplier"]
    if "in_proj" in name:
        w = w * m["ssm_in_multiplier"]
        d, gn = m["mamba_d_ssm"], m["mamba_n_groups"] * m["mamba_d_state"]
        bounds = [0, d, 2 * d, 2 * d + gn, 2 * d + 2 * gn, w.shape[0]]
        for i, factor in enumerate(m["ssm_multipliers"]):
            w[bounds[i] : bounds[i + 1]] *= factor
        return w
    if "lm_head" in name:
        return w * m["lm_head_multiplier"]
    if "embed_tokens" in name:
        return w * m["embedding_multiplier"]
    return w


@pytest.mark.parametrize("case", list(CASES))
def test_tensors_map_back_to_the_checkpoint(case: str) -> None:
    hf_dir, path = checkpoints()[case]
    metadata, tensors = _metadata(path)
    assert metadata["general.architecture"] == CASES[case].arch
    arch = gguf_architecture(CASES[case].arch)
    config = arch.config(metadata)
    got: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        for hf_name, value in arch.tensors(name, tensor, config):
            assert hf_name not in got, f"{name} gives {hf_name} twice"
            got[hf_name] = value
    want = load_file(f"{hf_dir}/model.safetensors")
    assert sorted(got) == sorted(want)
    with open(f"{hf_dir}/config.json") as f:
        original = json.load(f)
    plus_one = CASES[case].arch in ("qwen35", "qwen35moe", "qwen3next")
    for name, w in want.items():
        value = got[name]
        assert value.shape == w.shape, name
        if name.endswith("A_log"):  # -exp(A_log) back through log: float32 rounding
            torch.testing.assert_close(value, w, rtol=1e-6, atol=1e-7, msg=name)
            continue
        zero_centred = name.endswith("norm.weight") or ".pre_fc_norm_" in name
        if plus_one and zero_centred and "linear_attn" not in name:
            w = (w + 1.0) - 1.0  # written as 1 + w (Qwen's zero-centred norms, MTP's too)
        if case == "falcon-h1":
            w = _falcon_folded(name, w.clone(), original)
        assert torch.equal(value.float(), w), name


@pytest.mark.parametrize("case", list(CASES))
def test_config_equals_the_checkpoint_config(case: str) -> None:
    from transformers import AutoConfig

    hf_dir, path = checkpoints()[case]
    metadata, _ = _metadata(path)
    mapped = gguf_architecture(CASES[case].arch).config(metadata)
    want = AutoConfig.from_pretrained(hf_dir).to_dict()
    got = AutoConfig.for_model(**mapped).to_dict()
    assert got["architectures"] == want["architectures"]
    skip = _TRAINING | _DIFFERENCES.get(case, set())
    if case == "lfm2":  # the SwiGLU width comes as the adjusted one (160 = the model's)
        skip |= {"intermediate_size", "block_auto_adjust_ff_dim", "block_ffn_dim_multiplier",
                 "block_multiple_of"}  # fmt: skip
        assert mapped["intermediate_size"] == 160 and not mapped["block_auto_adjust_ff_dim"]
    differ = {
        key: (got.get(key), want[key])
        for key in want
        if key not in skip and not _same(got.get(key), want[key])
    }
    assert not differ, differ


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isinf(a) and math.isinf(b))
    return a == b


@pytest.mark.parametrize("case", Q8_0_CASES)
def test_q8_0_layouts_survive_the_mapping(case: str) -> None:
    _, path = checkpoints()[f"{case}-q8_0"]
    metadata, _ = _metadata(path)
    arch = gguf_architecture(CASES[case].arch)
    config = arch.config(metadata)
    reference_config = dict(config)  # a second model's state (tensors split in two are held)
    kept = 0
    for t in gguf.GGUFReader(path).tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        values = np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
        reference = arch.tensors(t.name, torch.from_numpy(values).reshape(shape), reference_config)
        decoded = arch.tensors(t.name, decode_tensor(t.name, t.tensor_type.name, shape, t.data),
                               config)  # fmt: skip
        for (name, want), (got_name, got) in zip(reference, decoded, strict=True):
            assert got_name == name and torch.equal(got.float(), want.float()), name
            layout = packed_of(got)
            if t.tensor_type.name == "Q8_0" and len(shape) == 2:  # (3-D experts come as float)
                assert layout is not None, f"{name} lost its integer layout"
                assert torch.equal(layout.dequantize(), want), name
                kept += 1
    assert kept > 0


@pytest.fixture(scope="module")
def end_to_end() -> dict[str, tuple[str, str]]:
    return checkpoints()


def _greedy(model: str, **kwargs: object) -> list[list[int]]:
    llm = LLM(model=model, max_num_seqs=2, dtype="float32", **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=6)
        outs = llm.generate(["Hello world, this is", "def f(x):"], params, use_tqdm=False)
        spec = llm.llm_engine.spec_steps
        counters = None if spec is None else spec.counters
        drafts = None if counters is None else (counters.num_draft_tokens,
                                                counters.num_accepted_tokens)  # fmt: skip
    finally:
        llm.llm_engine.executor.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], drafts


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_greedy_tokens_equal_safetensors(end_to_end: dict, case: str) -> None:
    hf_dir, path = end_to_end[case]
    assert _greedy(path) == _greedy(hf_dir)


@pytest.mark.parametrize("case", Q8_0_CASES)
def test_q8_0_gguf_equals_its_dequantised_checkpoint(end_to_end: dict, case: str) -> None:
    """LLM on the Q8_0 file (integer layers) gives the greedy tokens of the checkpoint holding
    gguf-py's dequantisation of the same blocks (named back by the mapping, whose names the
    F32 test checks)."""
    hf_dir, path = end_to_end[f"{case}-q8_0"]
    metadata, tensors = _metadata(path)
    arch = gguf_architecture(CASES[case].arch)
    config = arch.config(metadata)
    weights = {
        hf_name: value.float().contiguous()
        for name, tensor in tensors.items()
        for hf_name, value in arch.tensors(name, tensor, config)
    }
    ref_dir = make_tmp_dir(f"gguf-{case}-q8_0-dequantised-")
    shutil.copytree(hf_dir, ref_dir, dirs_exist_ok=True)
    save_file(weights, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    assert _greedy(path) == _greedy(ref_dir)
    llm = LLM(model=path, max_num_seqs=2, dtype="float32")
    try:  # the projections run on their Q8_0 blocks (integer weights), not widened to float
        integer = [
            m for m in llm.llm_engine.model.modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor)
            and m.weight.dtype in (torch.int8, torch.uint8)
        ]  # fmt: skip
    finally:
        llm.llm_engine.executor.shutdown()
    assert len(integer) >= config["num_hidden_layers"]


def test_gguf_mtp_head_drafts_as_the_safetensors_one(end_to_end: dict) -> None:
    """The Qwen3.5 MTP head mapped back from the GGUF's extra block loads for MTP speculation
    (a missing or misnamed tensor fails the load) and drafts as the checkpoint's does."""
    hf_dir, path = end_to_end["qwen35-mtp"]
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    got = _greedy(path, speculative_config=spec)
    assert got == _greedy(hf_dir, speculative_config=spec)
    assert got[0] == _greedy(hf_dir)[0] and got[1][0] > 0


def test_unknown_tensor_and_missing_metadata_are_named() -> None:
    _, path = checkpoints()["qwen3next"]
    metadata, _ = _metadata(path)
    arch = gguf_architecture("qwen3next")
    config = arch.config(metadata)
    with pytest.raises(ValueError, match=r"blk\.0\.ssm_bogus\.weight"):
        list(arch.tensors("blk.0.ssm_bogus.weight", torch.zeros(2, 2), config))
    missing = {k: v for k, v in metadata.items() if k != "qwen3next.ssm.group_count"}
    with pytest.raises(ValueError, match=r"qwen3next\.ssm\.group_count"):
        arch.config(missing)
