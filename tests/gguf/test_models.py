"""Tiny models written as GGUF by llama.cpp's converter, run through `LLM`.

- F32 GGUF (mamba2, mamba, rwkv7): greedy tokens and logprobs equal the safetensors model's.
- Q8_0 (the converter's) and Q4_0 (gguf-py's quantiser over the F32 file's weights): the
  tokens of the same checkpoint with every quantised weight replaced by gguf-py's
  dequantisation, logprobs within 1e-3; the model's integer layers hold exactly those values
  (Q4_0 in the engine's int4 kernel).
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


def _run(model: str, prompts: list, max_tokens: int = 6, **kwargs: object) -> list:
    """Greedy tokens and their logprobs for each prompt."""
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


@pytest.fixture(scope="module")
def mamba2() -> dict[str, str]:
    """The tiny Mamba2 checkpoint (with a chat template) and its F32, Q8_0 and Q4_0 GGUFs."""
    hf_dir = make_tmp_dir("gguf-mamba2-hf-")
    shutil.copytree(tiny_model_dir("mamba2-groups"), hf_dir, dirs_exist_ok=True)
    config_file = os.path.join(hf_dir, "tokenizer_config.json")
    tok_config = json.load(open(config_file))
    json.dump({**tok_config, "chat_template": TEMPLATE}, open(config_file, "w"))
    out = make_tmp_dir("gguf-mamba2-")
    f32 = convert(hf_dir, "f32", os.path.join(out, "m-f32.gguf"))
    q8 = convert(hf_dir, "q8_0", os.path.join(out, "m-q8_0.gguf"))
    from vllm_mamba.gguf.reader import GGUFFile

    quantised = {t.name: "Q4_0" for t in GGUFFile(q8).tensors if t.type_name == "Q8_0"}
    q4 = rewrite(f32, os.path.join(out, "m-q4_0.gguf"), quantised)
    return {"hf": hf_dir, "f32": f32, "q8_0": q8, "q4_0": q4}


def test_f32_gguf_equals_safetensors(mamba2: dict[str, str]) -> None:
    assert _run(mamba2["f32"], PROMPTS) == _run(mamba2["hf"], PROMPTS)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantised_gguf_equals_its_dequantised_weights(mamba2: dict[str, str], kind: str) -> None:
    ref_dir = dequantized_checkpoint(mamba2["hf"], mamba2[kind], "mamba2", make_tmp_dir("deq-"))
    got = _run(mamba2[kind], PROMPTS, dtype="float32")
    want = _run(ref_dir, PROMPTS, dtype="float32")
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-3, rtol=0)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_integer_layers_hold_the_gguf_values(mamba2: dict[str, str], kind: str) -> None:
    from safetensors.torch import load_file

    from vllm_mamba.layers.linear import Linear
    from vllm_mamba.model_loader import build_model, load_hf_config
    from vllm_mamba.ops.grouped_linear import GroupedWeight

    ref_dir = dequantized_checkpoint(mamba2["hf"], mamba2[kind], "mamba2", make_tmp_dir("deq-"))
    want = load_file(os.path.join(ref_dir, "model.safetensors"))
    path = mamba2[kind]
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
            assert module.weight.dtype == torch.int8, name
            layout = GroupedWeight(
                module.weight, module.weight_scale, module.weight_offset, module.bits, module.group
            )
        assert torch.equal(layout.dequantize(), want[f"{name}.weight"]), name
    assert integer == 2 * 2 + 1  # in_proj and out_proj of 2 layers, and the head


def test_tokenizer_and_chat_template_from_the_gguf(mamba2: dict[str, str]) -> None:
    from transformers import AutoTokenizer

    from vllm_mamba.tokenizer import load_tokenizer

    hf = AutoTokenizer.from_pretrained(mamba2["hf"])
    ours = load_tokenizer(mamba2["q8_0"])
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text)), text
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Yo"}]
    for gen in (True, False):
        kw = {"tokenize": False, "add_generation_prompt": gen}
        assert ours.apply_chat_template(messages, **kw) == hf.apply_chat_template(messages, **kw)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (0, 0, 1)


def test_mamba_split_set_and_single_file_directories() -> None:
    hf_dir = tiny_model_dir("tied")
    out = make_tmp_dir("gguf-mamba-")
    f32 = convert(hf_dir, "f32", os.path.join(out, "mamba-f32.gguf"))
    split_dir, one_dir = make_tmp_dir("gguf-split-"), make_tmp_dir("gguf-one-")
    rewrite(f32, os.path.join(split_dir, "mamba.gguf"), {}, split_max_tensors=8)
    assert len(os.listdir(split_dir)) == 3  # 22 tensors, 8 per part
    shutil.copy(f32, one_dir)
    want = _run(hf_dir, PROMPTS[:2])
    assert _run(split_dir, PROMPTS[:2]) == want
    assert _run(one_dir, PROMPTS[:2]) == want


def test_rwkv7_f32_gguf_and_world_vocabulary() -> None:
    import rwkv

    from tests.helpers.rwkv_checkpoints import save_rwkv7
    from tests.helpers.tiny_configs import RWKV7
    from vllm_mamba.rwkv_world_tokenizer import DEFAULT_VOCAB_FILE, RwkvWorldTokenizer
    from vllm_mamba.tokenizer import load_tokenizer

    hf_dir = make_tmp_dir("gguf-rwkv7-hf-")
    save_rwkv7(dict(RWKV7["rwkv7-h32"], vocab_size=65536), hf_dir, "hf")
    shutil.copy(os.path.join(os.path.dirname(rwkv.__file__), DEFAULT_VOCAB_FILE), hf_dir)
    f32 = convert(hf_dir, "f32", os.path.join(make_tmp_dir("gguf-rwkv7-"), "rwkv7.gguf"))
    prompts = [{"prompt_token_ids": [1, 300, 5000, 20000, 65000]}, {"prompt_token_ids": [42]}]
    assert _run(f32, prompts) == _run(hf_dir, prompts)
    ours, world = load_tokenizer(f32), RwkvWorldTokenizer.from_directory(hf_dir)
    for text in CORPUS:
        assert ours.encode(text) == world.encode(text), text


def test_unsupported_block_type_and_tensor_parallel_are_clear_errors(
    mamba2: dict[str, str],
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
        list(FORMAT.read_file(mamba2["q8_0"], "gguf", lazy=True))
