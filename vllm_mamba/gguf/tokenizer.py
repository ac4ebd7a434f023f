"""The tokenizer a GGUF file carries (`tokenizer.ggml.*`, `tokenizer.chat_template`), rebuilt
as a transformers tokenizer.

- `gpt2` (byte-level BPE): `tokens` (spelled in GPT-2's byte alphabet) and `merges` make the
  BPE model; tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added
  tokens (stored as their text, e.g. GPT-NeoX's runs of spaces), each at its own id; the split
  regex is chosen by `tokenizer.ggml.pre` (transformers' table of llama.cpp's names; GPT-2's
  own regex otherwise), with NFC normalisation for the vocabularies whose Hugging Face
  tokenizer has it (`olmo`: GPT-NeoX-20B's, which llama.cpp names after OLMo). transformers'
  own GGUF converter drops the USER_DEFINED tokens that are not in the byte alphabet and the
  NFC step, so this one is built here.
- `llama` (SentencePiece BPE with scores and byte fallback): transformers' converter
  (`convert_gguf_tokenizer`), whose `LlamaTokenizer` rebuilds the merges from the scores,
  with SentencePiece's own space handling (`tokenizer.ggml.add_space_prefix`: " hi" is
  `▁▁hi`, as sentencepiece and llama.cpp split it).
- `rwkv` (the RWKV World vocabulary: token bytes written as Python escapes): the engine's
  `RwkvWorldTokenizer` over those bytes.

Special tokens come from `bos/eos/unknown/padding_token_id`; `add_bos_token` / `add_eos_token`
add them when encoding; the chat template is the file's (none when it has none).
"""

from __future__ import annotations

import codecs
import hashlib
import os
import tempfile
from typing import Any

__all__ = ["gguf_tokenizer"]

_CONTROL, _USER_DEFINED = 3, 4
_NFC_PRE = ("olmo",)


def _special(meta: dict[str, Any], tokens: list[str], key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return tokens[token_id] if isinstance(token_id, int) and 0 <= token_id < len(tokens) else None


def _byte_level(meta: dict[str, Any]) -> Any:
    """The `tokenizers.Tokenizer` of a `gpt2` vocabulary (see the module docstring)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {}
    for i, token in enumerate(tokens):
        vocab.setdefault(token, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    kind = meta.get("tokenizer.ggml.pre")
    if kind in _NFC_PRE:
        tok.normalizer = normalizers.NFC()
    split = GGUF_PRE_TOKENIZER_SPLITS.get(kind)
    if split is not None:
        tok.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(split), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens(
        [
            AddedToken(t, special=ty == _CONTROL, normalized=ty != _CONTROL)
            for t, ty in zip(tokens, types)
            if ty in (_CONTROL, _USER_DEFINED)
        ]
    )
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types)
            if ty == _CONTROL
        ]
    )
    return tok


def _with_bos_eos(tok: Any, meta: dict[str, Any], tokens: list[str]) -> None:
    """Adds the file's BOS / EOS when encoding, as `add_bos_token` / `add_eos_token` ask."""
    from tokenizers import processors

    bos = (
        _special(meta, tokens, "bos_token_id") if meta.get("tokenizer.ggml.add_bos_token") else None
    )
    eos = (
        _special(meta, tokens, "eos_token_id") if meta.get("tokenizer.ggml.add_eos_token") else None
    )
    if bos is None and eos is None:
        return
    single = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else [])])
    pair = " ".join([*([bos] if bos else []), "$A", *([eos] if eos else []), "$B:1"])
    specials = [(t, tokens.index(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )


def _spm_spaces(tok: Any, add_space_prefix: bool) -> None:
    """SentencePiece's spaces, as sentencepiece and llama.cpp apply them: every space becomes
    `▁` and, with `add_space_prefix`, one more `▁` is put before the text (so " hi" is
    `▁▁hi`; transformers' `Metaspace` skips the prefix when the text starts with a space);
    decoding drops that one leading space."""
    from tokenizers import decoders, normalizers

    steps = [normalizers.Replace(" ", "\u2581")]
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend("\u2581"))
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = None
    strip = [decoders.Strip(" ", 1, 0)] if add_space_prefix else []
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), *strip]
    )


def _rwkv_world(meta: dict[str, Any], template: str | None) -> Any:
    """The RWKV World tokenizer of a `rwkv` vocabulary (token 0 `<s>`, then the vocabulary
    file's tokens as the text of their Python bytes literal)."""
    from vllm_mamba.rwkv_world_tokenizer import DEFAULT_VOCAB_FILE, RwkvWorldTokenizer

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    lines = []
    for i, (token, ty) in enumerate(zip(tokens, types)):
        if i == 0 or ty != 1:  # <s> and the [PAD] fillers are not vocabulary entries
            continue
        data = codecs.escape_decode(token.encode("utf-8"))[0]
        lines.append(f"{i} {data!r} {len(data)}\n")
    text = "".join(lines)
    # The World tokenizer reads a vocabulary file: one per vocabulary, kept under the temp dir.
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
    folder = os.path.join(tempfile.gettempdir(), f"vllm-mamba-gguf-rwkv-{digest}")
    path = os.path.join(folder, DEFAULT_VOCAB_FILE)
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(partial, path)
    if template == "rwkv-world":  # llama.cpp's name for its built-in template, not Jinja
        template = None
    return RwkvWorldTokenizer(path, chat_template=template)


def gguf_tokenizer(meta: dict[str, Any]) -> Any:
    """The transformers tokenizer of a GGUF file's metadata (see the module docstring).

    Raises:
        ValueError: the file has no vocabulary, or one of a kind not read here (named).
    """
    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    template = meta.get("tokenizer.chat_template")
    if not isinstance(kind, str) or not tokens:
        raise ValueError(
            "the GGUF file has no tokenizer (tokenizer.ggml.model / tokens); pass --tokenizer"
        )
    if kind == "rwkv":
        return _rwkv_world(meta, template)
    if kind == "gpt2":
        backend = _byte_level(meta)
    elif kind == "llama":
        from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

        fields = {
            "tokenizer_type": kind,
            "tokens": tokens,
            "scores": meta.get("tokenizer.ggml.scores"),
            "token_type": meta.get("tokenizer.ggml.token_type"),
        }
        if meta.get("tokenizer.ggml.merges"):
            fields["merges"] = meta["tokenizer.ggml.merges"]
        backend, _ = convert_gguf_tokenizer(meta.get("general.architecture", ""), fields)
        _spm_spaces(backend, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        raise ValueError(
            f"GGUF tokenizer.ggml.model {kind!r} is not supported (gpt2, llama, rwkv); pass "
            "--tokenizer"
        )
    _with_bos_eos(backend, meta, tokens)
    from transformers import PreTrainedTokenizerFast

    names = {
        name: _special(meta, tokens, key)
        for name, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template if isinstance(template, str) else None,
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in names.items() if v is not None},
    )
