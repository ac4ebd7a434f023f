"""`SamplingParams`: how one request is sampled and when it stops, validated on creation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_mamba import request_limits as limits

MAX_LOGPROBS = 20
MAX_N = 1024
MAX_SEED = 2**63 - 1
MAX_LOGIT_BIAS = 100.0
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("n", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output, with vLLM's names: set exactly one of the fields.

    `json` is a JSON schema (a dict or its JSON text); `regex` a regular expression the whole
    output matches; `choice` a list of strings, one of which is the output; `grammar` an EBNF
    grammar (GBNF / xgrammar syntax, with a `root` rule); `json_object=True` any JSON object.
    """

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The grammar applies only after the output contains this text (the end of a reasoning
    # part, set by the server's reasoning parser); before it, the output is free.
    start_after: str | None = None
    # The compiled grammar, attached by a caller that compiled it elsewhere (the server).
    compiled: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        kinds = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "SamplingParams.structured_outputs must set exactly one of "
                f"{', '.join(_STRUCTURED_KINDS)}, got {kinds or 'none'}"
            )
        checks = {
            "json": isinstance(self.json, (str, dict)),
            "regex": isinstance(self.regex, str) and bool(self.regex),
            "choice": isinstance(self.choice, list)
            and bool(self.choice)
            and all(isinstance(c, str) and c for c in self.choice),
            "grammar": isinstance(self.grammar, str) and bool(self.grammar),
            "json_object": self.json_object is True,
        }
        if not checks[kinds[0]]:
            what = _STRUCTURED_WHAT[kinds[0]]
            raise ValueError(f"SamplingParams.structured_outputs.{kinds[0]} must be {what}")
        too_big = self._over_limit(kinds[0])
        if too_big:
            raise ValueError(f"SamplingParams.structured_outputs.{too_big}")

    def _over_limit(self, kind: str) -> str | None:
        """What is over the request limits, if anything (the message after the field)."""
        if kind == "choice":
            choices = self.choice or []
            return limits.over_count(
                "choice", len(choices), limits.MAX_CHOICES
            ) or limits.over_size("choice", sum(len(c) for c in choices), limits.MAX_CHOICE_CHARS)
        if kind == "json_object":
            return None
        value = getattr(self, kind)
        text = value if isinstance(value, str) else _json_text(value)
        size = len(text.encode("utf-8", "surrogatepass"))
        return limits.over_size(kind, size, limits.MAX_GRAMMAR_BYTES, "bytes")

    @property
    def kind(self) -> str:
        """The field that is set: `json`, `regex`, `choice`, `grammar` or `json_object`."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))


def _json_text(value: Any) -> str:
    import json

    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return ""  # not serializable: the compile step says so


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_WHAT = {
    "json": "a JSON schema (a dict or a JSON string)",
    "regex": "a non-empty string",
    "choice": "a non-empty list of non-empty strings",
    "grammar": "a non-empty string",
    "json_object": "true",
}


def _check_limits(name: str, message: str | None) -> None:
    """Raises the `ValueError` of a field over its request limit (`request_limits`)."""
    if message is not None:
        raise ValueError(f"SamplingParams.{message}")


def _check_unicode(name: str, texts: list[str], bad: Callable[[str, str], ValueError]) -> None:
    """Raises `bad(name, ...)` when a text is not valid Unicode (holds a lone surrogate)."""
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:
            raise bad(name, "must be valid Unicode text") from err


class SamplerFlags:
    """What the sampler asks of a set of sampling parameters (`SamplingParams` and the
    worker's plain `SamplingOptions` both have these fields)."""

    temperature: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: Any
    allowed_token_ids: Any
    bad_words_token_ids: Any

    @property
    def needs_logit_masks(self) -> bool:
        """True when logit bias, allowed token ids or bad words change the logits."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        """True when sampling is argmax."""
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        """True when any repetition-style penalty changes the logits."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class SamplingParams(SamplerFlags):
    """Sampling and stopping settings of one request, with vLLM's names and meanings.

    `temperature=0` is greedy. `seed` (0 to 2**63 - 1) makes a request's sampling
    reproducible whatever else is in the batch. `logprobs=k` returns the top-k
    log-probabilities (plus the sampled token) of each generated position; `prompt_logprobs=k`
    does so for the prompt.

    Output constraints: `logit_bias` (token id -> bias in [-100, 100], added to the logits),
    `allowed_token_ids` (only these may be sampled), `bad_words` (strings whose token
    sequences are never generated) and `structured_outputs` (a JSON schema, regex, choice or
    grammar the output follows). Log-probabilities stay those of the raw distribution.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    stop_list: list[str] = field(init=False, repr=False)
    # Token sequences of `bad_words`, set by the engine with its tokenizer.
    bad_words_token_ids: list[list[int]] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_list = [self.stop]
        else:
            self.stop_list = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            value = getattr(self, name)
            return ValueError(f"SamplingParams.{name} {why}, got {value!r}")

        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not _is_number(value) or not math.isfinite(value):
                raise bad(name, "must be a finite number")
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if value is not None and not _is_int(value):
                raise bad(name, "must be an integer")
        if self.n < 1 or self.n > MAX_N:
            raise bad("n", f"must be in [1, {MAX_N}]")
        if self.temperature < 0:
            raise bad("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == 0 or self.top_k < -1:
            raise bad("top_k", "must be -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise bad(name, f"must be between 0 and {MAX_LOGPROBS}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise bad("seed", "must be in [0, 2**63 - 1]")
        self._validate_stops(bad)
        self._validate_constraints(bad)

    def _validate_stops(self, bad: Callable[[str, str], ValueError]) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise bad("stop", "must be non-empty strings")
        _check_limits(
            "stop",
            limits.over_count("stop", len(self.stop_list), limits.MAX_STOP)
            or limits.over_size("stop", sum(map(len, self.stop_list)), limits.MAX_STOP_CHARS),
        )
        _check_limits(
            "stop_token_ids",
            limits.over_count(
                "stop_token_ids", len(self.stop_token_ids), limits.MAX_STOP_TOKEN_IDS
            ),
        )
        _check_unicode("stop", self.stop_list, bad)
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be integers")

    def _validate_constraints(self, bad: Callable[[str, str], ValueError]) -> None:
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, dict) or any(not _is_int(t) for t in bias):
                raise bad("logit_bias", "must map integer token ids to numbers")
            for value in bias.values():
                if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", "values must be numbers in [-100, 100]")
        allowed = self.allowed_token_ids
        if allowed is not None and (
            not isinstance(allowed, list) or not allowed or any(not _is_int(t) for t in allowed)
        ):
            raise bad("allowed_token_ids", "must be a non-empty list of token ids")
        words = self.bad_words
        if words is not None and (
            not isinstance(words, list)
            or any(not isinstance(w, str) or not w.strip() for w in words)
        ):
            raise bad("bad_words", "must be a list of non-empty strings")
        if words is not None:
            _check_unicode("bad_words", words, bad)  # a lone surrogate fails the tokenizer
            _check_limits(
                "bad_words",
                limits.over_count("bad_words", len(words), limits.MAX_BAD_WORDS)
                or limits.over_size("bad_words", sum(map(len, words)), limits.MAX_BAD_WORDS_CHARS),
            )
        if bias is not None:
            _check_limits(
                "logit_bias",
                limits.over_count("logit_bias", len(bias), limits.MAX_LOGIT_BIAS_ENTRIES),
            )
        if allowed is not None:
            _check_limits(
                "allowed_token_ids",
                limits.over_count("allowed_token_ids", len(allowed), limits.MAX_ALLOWED_TOKEN_IDS),
            )
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams")

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenizes `bad_words`, each with and without a leading space (as vLLM does)."""
        seqs: dict[tuple[int, ...], None] = {}  # insertion-ordered set: linear in the words
        for word in self.bad_words or []:
            for prefix in ("", " "):
                ids = tuple(tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids:
                    seqs[ids] = None
        self.bad_words_token_ids = [list(ids) for ids in seqs]
