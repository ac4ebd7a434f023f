"""The RWKV World tokenizer (`vllm_mamba.rwkv_world_tokenizer`) against the `rwkv` package's
`TRIE_TOKENIZER`, its use by the engine (incremental detokenisation, chat, structured outputs)
and how `load_tokenizer` finds it in fla-hub's and BlinkDL's directory layouts."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Iterator

import pytest
import torch
from rwkv import rwkv_tokenizer  # the reference (a dev dependency)

from tests.helpers.tmp_dirs import make_tmp_dir
from vllm_mamba.engine.detokenizer import IncrementalDetokenizer
from vllm_mamba.rwkv_world_tokenizer import (
    DEFAULT_CHAT_TEMPLATE,
    END_OF_TEXT,
    RwkvWorldTokenizer,
    find_vocab_file,
)
from vllm_mamba.tokenizer import default_tokenizer_source, load_tokenizer

VOCAB = os.path.join(os.path.dirname(rwkv_tokenizer.__file__), "rwkv_vocab_v20230424.txt")
NEWLINES = 261  # "\n\n"

FLA_TEMPLATE = (
    "{{ '<|rwkv_tokenizer_end_of_text|>' }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{'User: ' + message['content'] + '\\n\\n'}}"
    "{% elif message['role'] == 'system' %}{{'System: ' + message['content'] + '\\n\\n'}}"
    "{% elif message['role'] == 'assistant' %}"
    "{{'Assistant: ' + message['content'] + '\\n\\n'}}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{'Assistant:'}}{% endif %}"
)


@pytest.fixture(scope="module")
def ref() -> object:
    return rwkv_tokenizer.TRIE_TOKENIZER(VOCAB)


@pytest.fixture(scope="module")
def tok() -> RwkvWorldTokenizer:
    return RwkvWorldTokenizer(VOCAB)


def _texts() -> list[str]:
    rng = random.Random(0)
    texts = [
        "",
        "a",
        "Hello world!",
        "The quick brown fox jumps over the lazy dog.\n\nUser: hi\n\nAssistant:",
        "你好，世界。機械学習は楽しい。한국어 텍스트",
        "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧 end",
        " \t\n\r\n\n\n   \t\t  x\u00a0y\u3000z ",
        "def f(x):\n    return x ** 2  # comment\n",
        "-" * 300 + " " * 200,
        "café naïve façade Ωμέγα Привет مرحبا שלום",
    ]
    for _ in range(30):  # random bytes read as Latin-1, and random code points
        texts.append(
            bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))).decode("latin-1")
        )
        texts.append("".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(40))))
    texts.append("".join(rng.choice(texts[1:10]) for _ in range(400)))  # long mixed text
    return texts


def test_encode_and_decode_equal_the_rwkv_package(tok: RwkvWorldTokenizer, ref: object) -> None:
    table = tok.token_bytes()
    assert table[0] == b"" and len(table) == 65530
    assert {i: table[i] for i in range(1, len(table))} == ref.idx2token
    for text in _texts():
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.encode_text(text) == ids
        assert tok.decode(ids) == ref.decode(ids) == text
        tokens = tok.convert_ids_to_tokens(ids)
        assert tok.convert_tokens_to_string(tokens) == text
        assert tok.convert_tokens_to_ids(tokens) == ids
    assert tok(["ab", "c"])["input_ids"] == [ref.encode("ab"), ref.encode("c")]
    assert tok.batch_decode([[33155], [0, 33155, 0]], skip_special_tokens=True) == ["Hello"] * 2


def test_special_tokens_and_partial_characters(tok: RwkvWorldTokenizer) -> None:
    assert (tok.eos_token_id, tok.bos_token_id, tok.pad_token_id) == (0, 0, 0)
    assert tok.all_special_ids == [0] and tok.eos_token == END_OF_TEXT
    assert tok.vocab_size == len(tok) == len(tok.get_vocab()) == 65530
    assert tok.get_vocab()[END_OF_TEXT] == 0
    assert tok.decode([0, 33155]) == END_OF_TEXT + "Hello"
    assert tok.decode([0, 33155], skip_special_tokens=True) == "Hello"
    assert tok.encode(END_OF_TEXT + "Hello") == [0, 33155]  # as fla-hub's template needs
    assert tok.encode("\n\n") == [NEWLINES]  # "\n\n" stays a plain token
    # Bytes of a character split across tokens decode as U+FFFD until it is complete.
    ids = tok.encode("😀")
    assert len(ids) > 1 and tok.decode(ids[:-1]).endswith("\ufffd")
    assert tok.decode([65535]) == ""  # ids past the vocabulary (padded embeddings) add nothing
    assert tok.token_bytes()[NEWLINES] == b"\n\n"


def test_incremental_detokenisation_equals_whole_decode(tok: RwkvWorldTokenizer) -> None:
    for text in _texts()[1:12]:
        prompt = tok.encode("Prompt: 😀")
        ids = tok.encode(text)
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
        assert "".join(detok.add(i) for i in ids) == text
    rng = random.Random(1)
    ids = [rng.randrange(1, 65536) for _ in range(300)]  # any ids, even invalid UTF-8
    detok = IncrementalDetokenizer(tok, [0], skip_special_tokens=True)
    streamed = "".join(detok.add(i) for i in ids)
    whole = tok.decode(ids)
    assert whole.startswith(streamed) and len(whole) - len(streamed) <= 3


@pytest.mark.whole_machine  # a wall-clock bound
def test_encode_100kb_is_linear(tok: RwkvWorldTokenizer, ref: object) -> None:
    text = ("The quick brown fox 你好 😀 jumps.\n\n" * 4000)[:100_000]
    start = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - start
    assert ids == ref.encode(text)
    assert elapsed < 2.0, f"100 KB took {elapsed * 1000:.0f} ms"
    spaces = " " * 100_000  # the longest tokens (128 spaces) repeated
    assert tok.decode(tok.encode(spaces)) == spaces


def test_default_chat_template(tok: RwkvWorldTokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "2+2?"},
    ]
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "System: Be brief.\n\nUser: Hi\n\nAssistant: Hello!\n\nUser: 2+2?\n\nAssistant:"
    )
    ids = tok.apply_chat_template(messages[1:2], tokenize=True, add_generation_prompt=False)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tok.decode(ids) == "User: Hi\n\n"


def _fla_hub_dir() -> str:
    """fla-hub's layout: vocab file, remote-code tokenizer config naming "\\n\\n" as eos."""
    path = make_tmp_dir("rwkv-fla-")
    shutil.copy(VOCAB, path)
    with open(os.path.join(path, "hf_rwkv_tokenizer.py"), "w") as f:
        f.write("raise RuntimeError('remote code must never run')\n")
    special = {
        "bos_token": END_OF_TEXT,
        "eos_token": "\n\n",
        "unk_token": END_OF_TEXT,
        "pad_token": END_OF_TEXT,
    }
    config = {
        "auto_map": {"AutoTokenizer": ["hf_rwkv_tokenizer.RwkvTokenizer", None]},
        "tokenizer_class": "RwkvTokenizer",
        "added_tokens_decoder": {"0": {"content": END_OF_TEXT, "special": True}},
        "chat_template": FLA_TEMPLATE,
        **special,
    }
    for name, data in (
        ("tokenizer_config.json", config),
        ("special_tokens_map.json", special),
        ("added_tokens.json", {END_OF_TEXT: 0}),
    ):
        with open(os.path.join(path, name), "w") as f:
            json.dump(data, f)
    return path


def test_loading_from_fla_hub_and_blinkdl_layouts(ref: object) -> None:
    fla = _fla_hub_dir()
    assert default_tokenizer_source(fla) is None
    tok = load_tokenizer(fla)
    assert isinstance(tok, RwkvWorldTokenizer)
    assert tok.eos_token_id == 0 and tok.encode("a\n\nb") == ref.encode("a\n\nb")
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == END_OF_TEXT + "User: Hi\n\nAssistant:"
    assert tok.encode(text)[0] == 0

    blink = make_tmp_dir("rwkv-blink-")  # a bare .pth release: weights and a renamed vocab
    shutil.copy(VOCAB, os.path.join(blink, "rwkv_vocab_v20250101.txt"))
    open(os.path.join(blink, "model.pth"), "wb").close()
    assert find_vocab_file(blink).endswith("rwkv_vocab_v20250101.txt")
    assert default_tokenizer_source(blink) is None
    tok = load_tokenizer(blink)
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE and tok.encode("hé") == ref.encode("hé")

    empty = make_tmp_dir("rwkv-none-")
    with pytest.raises(FileNotFoundError, match="rwkv_vocab"):
        load_tokenizer(empty)


@pytest.fixture(scope="module")
def rwkv_llm() -> Iterator[object]:
    """A tiny Mamba with a 65536-row vocabulary, saved with the RWKV vocab and no
    tokenizer.json."""
    from transformers import MambaConfig, MambaForCausalLM

    from tests.helpers.runners import VllmRunner

    torch.manual_seed(0)
    config = MambaConfig(
        vocab_size=65536,
        hidden_size=16,
        num_hidden_layers=1,
        state_size=4,
        expand=2,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    model = MambaForCausalLM(config).eval()
    path = make_tmp_dir("tiny-rwkv-vocab-")
    model.save_pretrained(path)
    shutil.copy(VOCAB, path)
    assert not os.path.exists(os.path.join(path, "tokenizer.json"))
    with VllmRunner(path, max_num_seqs=4) as runner:
        yield runner


def test_end_to_end_generate_chat_and_choice(rwkv_llm: object) -> None:
    from vllm_mamba import SamplingParams
    from vllm_mamba.sampling_params import StructuredOutputsParams

    llm = rwkv_llm.llm
    tok = llm.get_tokenizer()
    assert isinstance(tok, RwkvWorldTokenizer)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True)
    outs = rwkv_llm.generate(["Hello 你好", "😀 emoji"], params)
    for out in outs:
        comp = out.outputs[0]
        assert len(comp.token_ids) == 24
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
    chat = llm.chat(
        [{"role": "user", "content": "Hi"}],
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        use_tqdm=False,
    )
    assert chat[0].prompt_token_ids == tok.encode("User: Hi\n\nAssistant:")
    comp = chat[0].outputs[0]
    assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)

    choices = ["yes", "no", "maybe 你好"]
    choice = SamplingParams(
        temperature=1.0,
        seed=5,
        max_tokens=16,
        structured_outputs=StructuredOutputsParams(choice=choices),
    )
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "ü"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    as_json = SamplingParams(
        temperature=0.7,
        seed=6,
        max_tokens=60,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    outs = rwkv_llm.generate(["Pick: ", "Pick again: ", "JSON: "], [choice, choice, as_json])
    for out in outs[:2]:
        assert out.outputs[0].text in choices
        assert out.outputs[0].finish_reason == "stop"
    comp = outs[2].outputs[0]
    if comp.finish_reason == "stop":
        data = json.loads(comp.text)
        assert set(data) == {"a", "b"} and data["b"] in ("x", "ü")
    else:  # a random model may write a long integer; still a valid JSON prefix
        assert comp.text.startswith('{"a":')
