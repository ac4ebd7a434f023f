"""Tiny models written as GGUF by llama.cpp's converter, run through `LLM`.

- F32 GGUF (mamba2, mamba, falcon-mamba, rwkv7): greedy tokens equal the safetensors
  model's, logprobs within 1e-5 (float32 rounding: `A_log` comes back through `log(-A)`,
  Mamba2's chunk length is not in the file).
- Q8_0 (the converter's), Q4_0 and Q4_1 (gguf-py's quantiser over the F32 file's weights): the
  tokens of the same checkpoint with every quantised weight replaced by gguf-py's
  dequantisation, logprobs within 1e-3; the model's integer layers hold exactly those values
  (Q4_0 in the engine's int4 kernel, Q4_1 in the grouped 4-bit one with offsets, as Q4_K).
- K-quants (Q4_K, Q6_K, Q5_K random blocks, which gguf-py cannot write, in a Mamba2 wide
  enough for blocks of 256) likewise, in the grouped 4-bit and 8-bit kernels (groups of 16).
- A directory holding a split set, and a directory holding one file.
- The file's tokenizer encodes a corpus as the Hugging Face tokenizer does; its chat template
  renders as the checkpoint's; RWKV's World vocabulary as the engine's World tokenizer.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.gguf.conftest import convert, dequantized_checkpoint, rewrite
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams

QUANTISED = ["q8_0", "q4_0", "q4_1", "k_quants"]
MAPPED = {  # variants whose config and tensors are compared -> the config keys compared
    "untied": ("hidden_size", "num_hidden_layers", "state_size", "conv_kernel", "expand",
               "intermediate_size", "time_step_rank", "use_bias", "use_conv_bias",
               "layer_norm_epsilon", "vocab_size", "tie_word_embeddings"),
    "mamba2-tied": ("hidden_size", "num_hidden_layers", "state_size", "conv_kernel", "expand",
                    "num_heads", "head_dim", "n_groups", "use_bias", "use_conv_bias",
                    "layer_norm_epsilon", "vocab_size", "tie_word_embeddings"),
}  # fmt: skip
K_QUANTS = {  # the wide Mamba2's layers as K-quants: (GGUF name, type, rows, columns)
    "backbone.layers.0.mixer.in_proj.weight": ("blk.0.ssm_in.weight", "Q4_K", 1072, 256),
    "backbone.layers.0.mixer.out_proj.weight": ("blk.0.ssm_out.weight", "Q6_K", 256, 512),
    "lm_head.weight": ("output.weight", "Q5_K", 50280, 256),
}
PROMPTS = ["Hello world, this is", "The quick brown fox", "def fibonacci(n):"]
CORPUS = [
    "Hello world",
    "  two  spaces\n\nnewlines\t tab   \n",
    "naïve café 日本語 🤖 Ünïcödé e\u0301 Ω≈ç√",
    "12345 3.14159 1,000,000 0x1F -42e-3",
    "def f(x):\n    return x**2  # comment\n\tif a != b: pass\n",
    "<|endoftext|> special <|padding|>",
    "                    many spaces",
    "",
]
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


_RUNS: dict[str, list] = {}


def _run(model: str, prompts: list, max_tokens: int = 6, **kwargs: object) -> list:
    """Greedy tokens and their logprobs for each prompt (one engine per model, prompts and
    options in this module)."""
    key = repr((model, prompts, max_tokens, sorted(kwargs.items())))
    if key not in _RUNS:
        _RUNS[key] = _generate(model, prompts, max_tokens, **kwargs)
    return _RUNS[key]


def _generate(model: str, prompts: list, max_tokens: int, **kwargs: object) -> list:
    llm = LLM(model=model, max_num_seqs=4, **kwargs)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.executor.shutdown()
    result = []
    for o in outs:
        c = o.outputs[0]
        result.append(
            (list(c.token_ids), [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)])
        )
    return result


def _wide_mamba2() -> str:
    """A one-layer Mamba2 whose projections' inputs (256, 512) fit K-quant blocks of 256."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    from tests.tiny_models import copy_tokenizer

    torch.manual_seed(0)
    config = Mamba2Config(
        hidden_size=256, num_hidden_layers=1, expand=2, num_heads=16, head_dim=32, n_groups=1,
        state_size=16, conv_kernel=4, chunk_size=16, vocab_size=50280, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=0, pad_token_id=1,
    )  # fmt: skip
    path = make_tmp_dir("gguf-wide-mamba2-")
    Mamba2ForCausalLM(config).save_pretrained(path)
    copy_tokenizer(path)
    return path


def _k_quant_blocks(hf_dir: str) -> dict:
    """Random Q4_K / Q6_K / Q5_K blocks for the wide Mamba2's in_proj, out_proj and head."""
    from tests.gguf.conftest import random_k_blocks

    return {
        name: (kind, random_k_blocks(kind, rows, cols, seed=i, scale=2e-4))
        for i, (name, kind, rows, cols) in enumerate(K_QUANTS.values())
    }


@pytest.fixture(scope="module")
def files() -> dict[str, str]:
    """The tiny checkpoints and their GGUFs: mamba2 (with a chat template) as F32, Q8_0, Q4_0
    and Q4_1; mamba, falcon-mamba and rwkv7 (with the World vocabulary) as F32."""
    import rwkv

    from tests.helpers.rwkv_checkpoints import save_rwkv7
    from tests.helpers.tiny_configs import RWKV7
    from vllm_mamba.gguf.reader import GGUFFile
    from vllm_mamba.rwkv_world_tokenizer import DEFAULT_VOCAB_FILE

    hf = make_tmp_dir("gguf-mamba2-hf-")
    shutil.copytree(tiny_model_dir("mamba2-groups"), hf, dirs_exist_ok=True)
    config_file = os.path.join(hf, "tokenizer_config.json")
    tok_config = json.load(open(config_file))
    json.dump({**tok_config, "chat_template": TEMPLATE}, open(config_file, "w"))
    rwkv_hf = make_tmp_dir("gguf-rwkv7-hf-")
    save_rwkv7(dict(RWKV7["rwkv7-h32"], vocab_size=65536), rwkv_hf, "hf")
    shutil.copy(os.path.join(os.path.dirname(rwkv.__file__), DEFAULT_VOCAB_FILE), rwkv_hf)
    out = make_tmp_dir("gguf-files-")
    wide = _wide_mamba2()
    f = {
        "hf": hf, "mamba_hf": tiny_model_dir("tied"), "rwkv7_hf": rwkv_hf,
        "f32": os.path.join(out, "m-f32.gguf"), "q8_0": os.path.join(out, "m-q8_0.gguf"),
        "mamba": os.path.join(out, "mamba-f32.gguf"), "rwkv7": os.path.join(out, "rwkv7.gguf"),
        "falcon_hf": tiny_model_dir("falcon-tied"), "falcon": os.path.join(out, "falcon.gguf"),
    }  # fmt: skip
    convert(
        (hf, "f32", f["f32"]),
        (hf, "q8_0", f["q8_0"]),
        (f["mamba_hf"], "f32", f["mamba"]),
        (rwkv_hf, "f32", f["rwkv7"]),
        (f["falcon_hf"], "f32", f["falcon"]),
        (wide, "f32", os.path.join(out, "wide-f32.gguf")),
        *((tiny_model_dir(v), "f32", os.path.join(out, f"{v}.gguf")) for v in MAPPED),
    )
    for v in MAPPED:
        f[v] = os.path.join(out, f"{v}.gguf")
    f["k_quants"] = rewrite(os.path.join(out, "wide-f32.gguf"), os.path.join(out, "k.gguf"), {},
                            raw=_k_quant_blocks(wide))  # fmt: skip
    quantised = [t.name for t in GGUFFile(f["q8_0"]).tensors if t.type_name == "Q8_0"]
    for kind in ("q4_0", "q4_1"):
        to = dict.fromkeys(quantised, kind.upper())
        f[kind] = rewrite(f["f32"], os.path.join(out, f"m-{kind}.gguf"), to)
    for kind in QUANTISED:
        source = wide if kind == "k_quants" else hf
        f[f"{kind}_ref"] = dequantized_checkpoint(source, f[kind], "mamba2", make_tmp_dir("deq-"))
    return f


def _assert_same(got: list, want: list, atol: float) -> None:
    """The same greedy tokens (not all the same); their logprobs finite and within `atol`."""
    assert [t for t, _ in got] == [t for t, _ in want]
    assert len({tuple(t) for t, _ in got}) == len(got)
    assert all(torch.isfinite(torch.tensor(lp)).all() for _, lp in got)
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=atol, rtol=0)


def test_f32_gguf_equals_safetensors(files: dict[str, str]) -> None:
    """Within float32 rounding: the file keeps `-exp(A_log)` (A_log comes back through a
    log) and not the SSD chunk length (the default 256 here, 16 in the checkpoint)."""
    _assert_same(_run(files["f32"], PROMPTS), _run(files["hf"], PROMPTS), atol=1e-5)


@pytest.mark.parametrize("kind", QUANTISED)
def test_quantised_gguf_equals_its_dequantised_weights(files: dict[str, str], kind: str) -> None:
    ref_dir = files[f"{kind}_ref"]
    got = _run(files[kind], PROMPTS, dtype="float32")
    _assert_same(got, _run(ref_dir, PROMPTS, dtype="float32"), atol=1e-4)


@pytest.mark.parametrize("kind", QUANTISED)
def test_integer_layers_hold_the_gguf_values(files: dict[str, str], kind: str) -> None:
    from safetensors.torch import load_file

    from vllm_mamba.layers.linear import Linear
    from vllm_mamba.layers.packed_weights import GroupedEmbedding
    from vllm_mamba.model_loader import build_model, load_hf_config
    from vllm_mamba.ops.grouped_linear import GroupedWeight

    want = load_file(os.path.join(files[f"{kind}_ref"], "model.safetensors"))
    path = files[kind]
    model, _ = build_model(path, load_hf_config(path), torch.float32, torch.device("cpu"))
    integer = 0
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight.dtype == torch.float32:
            continue
        integer += 1
        if kind == "q4_0":  # the engine's int4: float16 scales, offset -8 scale
            assert hasattr(module, "int4_op"), name
            scales = module.weight_scale.float()
            layout = GroupedWeight(module.weight, scales, -8 * scales, 4, 32)
        else:
            if kind == "k_quants":
                bits, group = {"Q4_K": (4, 32), "Q5_K": (8, 32), "Q6_K": (8, 16)}[
                    K_QUANTS[f"{name}.weight"][1]
                ]
            else:
                bits, group = (8 if kind == "q8_0" else 4), 32
            assert (module.bits, module.group) == (bits, group), name
            assert module.weight.dtype == (torch.int8 if bits == 8 else torch.uint8), name
            layout = GroupedWeight(
                module.weight, module.weight_scale, module.weight_offset, module.bits, module.group
            )
        assert torch.equal(layout.dequantize(), want[f"{name}.weight"]), name
    if kind == "k_quants":
        assert integer == len(K_QUANTS)
    else:
        assert integer == 2 * 2 + 1  # in_proj and out_proj of 2 layers, and the head
        # The quantised token_embd is looked up from its codes, not widened to a float table.
        tables = [(n, m) for n, m in model.named_modules() if isinstance(m, GroupedEmbedding)]
        assert len(tables) == 1
        name, table = tables[0]
        every = torch.arange(table.codes.shape[0])
        assert torch.equal(table(every), want[f"{name}.weight"])


def test_tokenizer_and_chat_template_from_the_gguf(files: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    from vllm_mamba.tokenizer import load_tokenizer

    hf = AutoTokenizer.from_pretrained(files["hf"])
    ours = load_tokenizer(files["q8_0"])
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text)), text
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Yo"}]
    for gen in (True, False):
        kw = {"tokenize": False, "add_generation_prompt": gen}
        assert ours.apply_chat_template(messages, **kw) == hf.apply_chat_template(messages, **kw)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 0, 1)


def test_mamba_split_set_and_single_file_directories(files: dict[str, str]) -> None:
    from vllm_mamba.gguf.format import FORMAT
    from vllm_mamba.models.formats import detect_format

    hf_dir, f32 = files["mamba_hf"], files["mamba"]
    split_dir, one_dir = make_tmp_dir("gguf-split-"), make_tmp_dir("gguf-one-")
    rewrite(f32, os.path.join(split_dir, "mamba.gguf"), {}, split_max_tensors=8)
    assert len(os.listdir(split_dir)) == 3  # 22 tensors, 8 per part
    shutil.copy(f32, one_dir)
    _assert_same(_run(split_dir, PROMPTS[:2]), _run(hf_dir, PROMPTS[:2]), atol=1e-5)
    assert detect_format(one_dir) is FORMAT
    assert FORMAT.weight_files(one_dir) == ([os.path.join(one_dir, "mamba-f32.gguf")], "gguf")


@pytest.mark.parametrize("variant", sorted(MAPPED))
def test_config_and_tensors_map_back_to_the_checkpoint(files: dict[str, str], variant: str) -> None:
    """Biases, no conv bias, an explicit time-step rank, a tied head, a padded vocabulary:
    the config the engine reads and every tensor (A_log within float32 rounding) as saved."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from vllm_mamba.model_loader import iterate_weights, load_hf_config

    hf_dir = tiny_model_dir(variant)
    want, got = AutoConfig.from_pretrained(hf_dir), load_hf_config(files[variant])
    for key in MAPPED[variant]:
        assert getattr(got, key) == getattr(want, key), key
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    if want.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    tensors = dict(iterate_weights(files[variant]))
    assert sorted(tensors) == sorted(state)
    for name, value in state.items():
        if name.endswith("A_log"):
            torch.testing.assert_close(tensors[name], value, atol=1e-6, rtol=0)
        else:
            assert torch.equal(tensors[name], value), name


def test_falcon_mamba_f32_gguf_equals_safetensors(files: dict[str, str]) -> None:
    """llama.cpp writes FalconMamba as `mamba` with `ssm.dt_b_c_rms`."""
    from vllm_mamba.model_loader import load_hf_config

    assert load_hf_config(files["falcon"]).architectures == ["FalconMambaForCausalLM"]
    _assert_same(_run(files["falcon"], PROMPTS[:2]), _run(files["falcon_hf"], PROMPTS[:2]), 1e-5)


def test_rwkv7_f32_gguf_and_world_vocabulary(files: dict[str, str]) -> None:
    from vllm_mamba.rwkv_world_tokenizer import RwkvWorldTokenizer
    from vllm_mamba.tokenizer import load_tokenizer

    hf_dir, f32 = files["rwkv7_hf"], files["rwkv7"]
    prompts = [{"prompt_token_ids": [1, 300, 5000, 20000, 65000]}, {"prompt_token_ids": [42]}]
    _assert_same(_run(f32, prompts), _run(hf_dir, prompts), atol=1e-5)
    ours, world = load_tokenizer(f32), RwkvWorldTokenizer.from_directory(hf_dir)
    for text in CORPUS:
        assert ours.encode(text) == world.encode(text), text


def test_unsupported_block_type_and_tensor_parallel_are_clear_errors(
    files: dict[str, str],
) -> None:
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    from vllm_mamba.gguf.format import FORMAT
    from vllm_mamba.model_loader import load_hf_config

    path = os.path.join(make_tmp_dir("gguf-q2k-"), "q2k.gguf")
    w = GGUFWriter(path, "mamba2")
    w.add_tensor(
        "blk.0.ssm_in.weight", np.zeros((4, 84), np.uint8), raw_dtype=GGMLQuantizationType.Q2_K
    )
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"blk\.0\.ssm_in\.weight: block type Q2_K"):
        load_hf_config(path)
    with pytest.raises(ValueError, match="one rank only"):
        list(FORMAT.read_file(files["q8_0"], "gguf", lazy=True))


def test_served_by_the_openai_server(files: dict[str, str]) -> None:
    """`vllm-mamba serve file.gguf` answers the official client with `LLM`'s greedy text,
    detokenised by the file's own tokenizer."""
    from tests.entrypoints.conftest import greedy_completions, launch_server
    from vllm_mamba.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(files["q8_0"])
    want = [tokenizer.decode(t) for t, _ in _run(files["q8_0"], PROMPTS, dtype="float32")]
    with launch_server("--dtype", "float32", model_dir=files["q8_0"]) as server:
        assert greedy_completions(server.url, PROMPTS, 6) == want


def test_q4_0_layers_run_in_the_fused_decode_layer(files: dict[str, str]) -> None:
    """Q4_0 blocks are the engine's own int4 `Linear`s, so the fused decode layers take them
    (as they take `quantization="int4"`), with the same tokens as the dequantised weights."""
    from vllm_mamba.layers.decode_plan import planned_layers
    from vllm_mamba.layers.quantization import is_int4_linear

    llm = LLM(model=files["q4_0"], max_num_seqs=4, dtype="float32")
    try:
        model = llm.llm_engine.executor.model
        layers = planned_layers(model)
        assert layers and all(layer.decode_plan is not None for layer in layers)
        assert all(is_int4_linear(layer.mixer.in_proj) for layer in model.backbone.layers)
        params = SamplingParams(temperature=0, max_tokens=6)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.llm_engine.executor.shutdown()
    want = _run(files["q4_0_ref"], PROMPTS, dtype="float32")
    assert [list(o.outputs[0].token_ids) for o in got] == [t for t, _ in want]


@pytest.mark.parametrize(("kind", "method"), [("k_quants", "w4a8_k"), ("q4_0", "w4a8")])
def test_4bit_layers_take_integer_dots_on_their_own_codes(
    files: dict[str, str], kind: str, method: str
) -> None:
    """Under `quantization="w4a8_k"` a Q4_K layer (under w4a8 and w4a8_k a Q4_0 one) runs the
    integer-dot kernels on the file's own codes and scales, repacked: its weight dequantises
    to exactly the GGUF's values. Other layouts keep their grouped kernels, and a head tied to
    the token table stays weight-only (the table held once). The engine generates with it."""
    from safetensors.torch import load_file

    from vllm_mamba.config import record_quantization
    from vllm_mamba.layers.linear import Linear
    from vllm_mamba.layers.quantization import uses_int_dot
    from vllm_mamba.model_loader import build_model, load_hf_config
    from vllm_mamba.ops.int_dot_linear import dequantize_w4a8

    want = load_file(os.path.join(files[f"{kind}_ref"], "model.safetensors"))
    path = files[kind]
    hf_config = load_hf_config(path)
    record_quantization(hf_config, method)
    model, _ = build_model(path, hf_config, torch.float32, torch.device("cpu"))
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    dots = set()
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or module.weight.dtype != torch.uint8:
            continue
        if id(module.weight) in tables or getattr(module, "bits", None) is not None:
            assert not uses_int_dot(module), name
            continue
        assert uses_int_dot(module), name
        weight = dequantize_w4a8(module.weight, module.weight_scale)
        assert torch.equal(weight, want[f"{name}.weight"]), name
        assert (module.weight_scale.dtype == torch.uint8) == (kind == "k_quants"), name
        dots.add(name)
    if kind == "k_quants":
        assert dots == {"backbone.layers.0.mixer.in_proj"}
    else:
        layers = {f"backbone.layers.{i}.mixer.{p}" for i in (0, 1) for p in ("in_proj", "out_proj")}
        assert dots == {*layers, "lm_head"}  # the file's head is its own tensor
    llm = LLM(model=path, max_num_seqs=4, dtype="float32", quantization=method)
    try:
        out = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    finally:
        llm.llm_engine.executor.shutdown()
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)
