"""The RWKV "World" tokenizer: reading its vocabulary file, greedy longest-match encoding,
and a transformers (slow) tokenizer built on it.

RWKV checkpoints (BlinkDL's `.pth` releases, fla-hub's Hugging Face repos) ship no
`tokenizer.json`: they use a vocabulary file `rwkv_vocab_v20230424.txt` whose lines are
`ID REPR LEN`, REPR a Python `str` or `bytes` literal of the token's bytes (a `str` stands for
its UTF-8 bytes). Id 0 is not in the file: it is the end-of-text token. Text is encoded by
walking its UTF-8 bytes left to right and taking, at each point, the longest vocabulary entry
that starts there (every single byte is an entry, so this always advances).

This module owns:

- `WorldVocab`: the parsed vocabulary and the greedy encoder (linear in the input: at most
  `longest token + 1` dictionary look-ups per emitted token). It is immutable and shared by
  every copy of a tokenizer (`copy.deepcopy` returns it as is).
- `RwkvWorldTokenizer`: a `transformers.PreTrainedTokenizer`. Its tokens are the vocabulary's
  byte strings written with the GPT-2 byte-to-unicode alphabet (as byte-level BPE vocabularies
  are), so `get_vocab`, `convert_ids_to_tokens` and `convert_tokens_to_string` round-trip any
  bytes. `decode` replaces bytes that are not valid UTF-8 by U+FFFD, as byte-level tokenizers
  do (the incremental detokenizer waits for the rest of a character on it). `token_bytes()`
  gives the raw bytes of every id, which the structured outputs use.
- `find_vocab_file`: where a model directory keeps its vocabulary.

Special tokens: id 0 is `<|rwkv_tokenizer_end_of_text|>` (the name fla-hub's repos give it),
and it is the bos, eos, unk and pad token. fla-hub's `special_tokens_map.json` names `"\\n\\n"`
as eos; that is not followed: registering `"\\n\\n"` as a special token would add an id past
the vocabulary and change how every blank line is encoded. RWKV chat models end a turn with
`"\\n\\n"`; pass `stop=["\\n\\n"]` in the request (or the server's request defaults) to stop
there. The literal text `<|rwkv_tokenizer_end_of_text|>` in a prompt encodes to id 0, as with
any Hugging Face tokenizer's special tokens (fla-hub's chat template starts with it).
"""

from __future__ import annotations

import ast
import codecs
import functools
import glob
import hashlib
import json
import logging
import os
import shutil
from typing import Any

from transformers import AddedToken, PreTrainedTokenizer

logger = logging.getLogger(__name__)

DEFAULT_VOCAB_FILE = "rwkv_vocab_v20230424.txt"
VOCAB_FILE_GLOB = "rwkv_vocab_*.txt"
END_OF_TEXT = "<|rwkv_tokenizer_end_of_text|>"

# RWKV World's chat format: `Role: content` turns separated by a blank line; the model
# writes its answer after "Assistant:" (its answer starts with a space).
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ 'System: ' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' }}"
    "{%- elif message['role'] == 'assistant' -%}{{ 'Assistant: ' }}"
    "{%- else -%}{{ message['role'] | capitalize + ': ' }}"
    "{%- endif -%}"
    "{{ message['content'] + '\\n\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)


def bytes_to_unicode() -> list[str]:
    """The GPT-2 byte-level alphabet: one printable character for each byte value.

    Bytes that are printable Latin-1 stand for themselves; the others (controls, space, a few
    Latin-1 gaps) take the characters from U+0100 on, in byte order.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    table: list[str] = []
    extra = 0
    for byte in range(256):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(256 + extra))
            extra += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
_CHAR_TO_BYTE = {char: byte for byte, char in enumerate(_BYTE_TO_CHAR)}


def find_vocab_file(path: str) -> str | None:
    """The RWKV vocabulary file in directory `path`: `rwkv_vocab_v20230424.txt`, else the last
    `rwkv_vocab_*.txt` in name order; None when there is none (or `path` is no directory)."""
    if not os.path.isdir(path):
        return None
    default = os.path.join(path, DEFAULT_VOCAB_FILE)
    if os.path.isfile(default):
        return default
    found = sorted(f for f in glob.glob(os.path.join(glob.escape(path), VOCAB_FILE_GLOB)))
    found = [f for f in found if os.path.isfile(f)]
    return found[-1] if found else None


class WorldVocab:
    """An RWKV World vocabulary: the bytes of every id and the greedy longest-match encoder.

    Args:
        tokens: `{id: bytes}`; ids start at 1 (0 is the end-of-text token, not a byte string).

    Raises:
        ValueError: a byte value has no single-byte token, or two ids share bytes.
    """

    __slots__ = ("token_bytes", "_prefixes", "_single")

    def __init__(self, tokens: dict[int, bytes]) -> None:
        size = max(tokens, default=0) + 1
        self.token_bytes: list[bytes] = [b""] * size
        # Every prefix of every token: the token's id where the prefix is a token, else 0.
        prefixes: dict[bytes, int] = {}
        for token_id, data in tokens.items():
            if token_id <= 0 or not data:
                raise ValueError(f"RWKV vocabulary: bad entry {token_id} {data!r}")
            if prefixes.get(data):
                raise ValueError(f"RWKV vocabulary: {data!r} has two ids")
            self.token_bytes[token_id] = data
            prefixes[data] = token_id
            for end in range(1, len(data)):
                prefixes.setdefault(data[:end], 0)
        single = [prefixes.get(bytes([byte]), 0) for byte in range(256)]
        if not all(single):
            missing = [byte for byte in range(256) if not single[byte]]
            raise ValueError(f"RWKV vocabulary: no single-byte tokens for bytes {missing[:8]}")
        self._prefixes = prefixes
        self._single = single

    def __deepcopy__(self, memo: dict[int, Any]) -> WorldVocab:
        return self  # immutable: every tokenizer copy shares it

    def __len__(self) -> int:
        return len(self.token_bytes)

    def encode(self, data: bytes) -> list[int]:
        """The ids of `data`: at each point, the longest token that starts there."""
        get = self._prefixes.get
        single = self._single
        ids: list[int] = []
        append = ids.append
        i, n = 0, len(data)
        while i < n:
            best, best_end = single[data[i]], i + 1
            end = i + 2
            while end <= n:
                found = get(data[i:end])
                if found is None:
                    break
                if found:
                    best, best_end = found, end
                end += 1
            append(best)
            i = best_end
        return ids

    def decode(self, ids: list[int]) -> bytes:
        """The bytes of `ids` (id 0 and ids past the vocabulary add none)."""
        table = self.token_bytes
        size = len(table)
        return b"".join(table[i] for i in ids if 0 <= i < size)


def _parse_vocab_line(line: str, number: int, path: str) -> tuple[int, bytes]:
    """`(id, bytes)` of one `ID REPR LEN` line."""
    try:
        first, last = line.index(" "), line.rindex(" ")
        token_id, length = int(line[:first]), int(line[last + 1 :])
        data = _literal_bytes(line[first + 1 : last])
    except (ValueError, SyntaxError, UnicodeError) as err:
        raise ValueError(f"{path}:{number}: not an `ID REPR LEN` line: {line!r}") from err
    if len(data) != length:
        raise ValueError(f"{path}:{number}: {line!r}: the token is not {length} bytes")
    return token_id, data


def _literal_bytes(literal: str) -> bytes:
    """The bytes of a Python `'str'` (as UTF-8) or `b'bytes'` literal, never evaluated as code.

    The escapes of the quoted text are undone with the `unicode_escape` / `escape_decode`
    codecs (much faster than `ast.literal_eval` on 65k lines); anything else (prefixes other
    than `b`, triple quotes) goes through `ast.literal_eval`.
    """
    is_bytes = literal[:1] == "b"
    body = literal[1:] if is_bytes else literal
    if len(body) >= 2 and body[0] == body[-1] and body[0] in "'\"" and body[:3] != body[0] * 3:
        body = body[1:-1]
        if is_bytes:
            return codecs.escape_decode(body.encode("ascii"))[0]
        text = body.encode("latin-1", "backslashreplace").decode("unicode_escape")
        return text.encode("utf-8")
    value = ast.literal_eval(literal)
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes):
        return value
    raise ValueError(f"not a str or bytes literal: {literal!r}")


_VOCABS: dict[str, WorldVocab] = {}  # by the SHA-256 of the file: parsed once per process


def load_vocab(path: str) -> WorldVocab:
    """The vocabulary of file `path` (parsed once per process for the same file contents).

    Raises:
        OSError: the file cannot be read.
        ValueError: a malformed line.
    """
    with open(path, "rb") as f:
        raw = f.read()
    digest = hashlib.sha256(raw).hexdigest()
    vocab = _VOCABS.get(digest)
    if vocab is None:
        tokens: dict[int, bytes] = {}
        # Only "\n" ends a line: a token's text may hold other line separators.
        for number, line in enumerate(raw.decode("utf-8").split("\n"), 1):
            line = line.removesuffix("\r")
            if line.strip():
                token_id, data = _parse_vocab_line(line, number, path)
                tokens[token_id] = data
        vocab = _VOCABS.setdefault(digest, WorldVocab(tokens))
    return vocab


class RwkvWorldTokenizer(PreTrainedTokenizer):
    """The RWKV World tokenizer as a transformers slow tokenizer.

    Args:
        vocab_file: an `rwkv_vocab_*.txt` file.
        end_of_text: the name of id 0 (bos, eos, unk and pad).
        chat_template: a Jinja chat template; RWKV World's `User:`/`Assistant:` format when
            None.
        **kwargs: other `PreTrainedTokenizer` arguments (special-token names other than
            `end_of_text` are not accepted: every special token is id 0).
    """

    vocab_files_names = {"vocab_file": DEFAULT_VOCAB_FILE}
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(
        self,
        vocab_file: str,
        end_of_text: str = END_OF_TEXT,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_file = vocab_file
        self.end_of_text = end_of_text
        self._vocab = load_vocab(vocab_file)
        self._encoder = _token_encoder(self._vocab)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token", "added_tokens_decoder"):
            kwargs.pop(name, None)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        kwargs.setdefault("model_max_length", 1 << 60)
        eot = AddedToken(end_of_text, special=True, normalized=False)
        super().__init__(
            bos_token=eot,
            eos_token=eot,
            unk_token=eot,
            pad_token=eot,
            added_tokens_decoder={0: eot},
            chat_template=chat_template or DEFAULT_CHAT_TEMPLATE,
            **kwargs,
        )

    @classmethod
    def from_directory(cls, path: str) -> RwkvWorldTokenizer:
        """The tokenizer of a model directory holding an `rwkv_vocab_*.txt` file.

        A `tokenizer_config.json` there (fla-hub's layout) gives the name of id 0 and the chat
        template; its `auto_map` remote code is never run. A `chat_template.jinja` there
        overrides the config's template.

        Raises:
            FileNotFoundError: no vocabulary file in `path`.
        """
        vocab_file = find_vocab_file(path)
        if vocab_file is None:
            raise FileNotFoundError(f"no {VOCAB_FILE_GLOB} RWKV vocabulary in {path!r}")
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        special = _read_json(os.path.join(path, "special_tokens_map.json"))
        added = _read_json(os.path.join(path, "added_tokens.json"))
        names = {content: token_id for content, token_id in added.items()}
        for token_id, entry in (config.get("added_tokens_decoder") or {}).items():
            content = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(content, str) and str(token_id).isdigit():
                names[content] = int(token_id)
        end_of_text = next((c for c, i in names.items() if i == 0), END_OF_TEXT)
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = _token_name(config.get(key, special.get(key)))
            if value is not None and value != end_of_text:
                logger.info(
                    "%s: %s %r is not followed: every special token of the RWKV World "
                    "tokenizer is id 0 (%s)",
                    path,
                    key,
                    value,
                    end_of_text,
                )
        template = config.get("chat_template")
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                template = f.read()
        return cls(
            vocab_file,
            end_of_text=end_of_text,
            chat_template=template if isinstance(template, str) and template else None,
        )

    @property
    def vocab_size(self) -> int:
        """Ids 0 up to the largest id of the vocabulary file."""
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        """`{token: id}`: byte-level token strings, and the end-of-text name for id 0."""
        vocab = dict(self._encoder)
        vocab.update(self._added_tokens_encoder)
        return vocab

    def token_bytes(self) -> list[bytes]:
        """The bytes of every id, indexed by id (`b""` for id 0)."""
        return list(self._vocab.token_bytes)

    def encode_text(self, text: str) -> list[int]:
        """The ids of `text` as plain bytes: special-token names are not looked for."""
        return self._vocab.encode(text.encode("utf-8"))

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        tokens = self._vocab.token_bytes
        return [_to_token(tokens[i]) for i in self._vocab.encode(text.encode("utf-8"))]

    def _convert_token_to_id(self, token: str) -> int:
        return self._encoder.get(token, 0)

    def _convert_id_to_token(self, index: int) -> str:
        if 0 < index < len(self._vocab):
            return _to_token(self._vocab.token_bytes[index])
        return ""

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        added = self._added_tokens_encoder
        parts: list[bytes] = []
        for token in tokens:
            if token in added:
                parts.append(token.encode("utf-8"))
            else:
                parts.append(bytes(_CHAR_TO_BYTE.get(c, 0x3F) for c in token))
        return b"".join(parts).decode("utf-8", errors="replace")

    def _decode(
        self,
        token_ids: int | list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **kwargs: Any,
    ) -> str:
        ids = [token_ids] if isinstance(token_ids, int) else [int(i) for i in token_ids]
        added = self._added_tokens_decoder
        if not any(i in added for i in ids):
            return self._vocab.decode(ids).decode("utf-8", errors="replace")
        parts: list[bytes] = []
        run: list[int] = []
        for i in ids:
            if i not in added:
                run.append(i)
                continue
            parts.append(self._vocab.decode(run))
            run = []
            if not (skip_special_tokens and added[i].special):
                parts.append(added[i].content.encode("utf-8"))
        parts.append(self._vocab.decode(run))
        return b"".join(parts).decode("utf-8", errors="replace")

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple:
        name = (filename_prefix + "-" if filename_prefix else "") + os.path.basename(
            self.vocab_file
        )
        target = os.path.join(save_directory, name)
        if os.path.abspath(target) != os.path.abspath(self.vocab_file):
            shutil.copyfile(self.vocab_file, target)
        return (target,)


@functools.lru_cache(maxsize=4)
def _token_encoder(vocab: WorldVocab) -> dict[str, int]:
    """`{byte-level token string: id}` of a vocabulary (built once per vocabulary)."""
    return {_to_token(data): i for i, data in enumerate(vocab.token_bytes) if data}


def _to_token(data: bytes) -> str:
    return "".join([_BYTE_TO_CHAR[b] for b in data])


def _token_name(value: Any) -> str | None:
    """The text of a special token given as a string or an `AddedToken`-like dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: str) -> dict[str, Any]:
    """A JSON object file, or `{}` when it is missing or unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
