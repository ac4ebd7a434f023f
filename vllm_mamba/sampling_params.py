"""`SamplingParams`: how one request is sampled and when it stops, validated on creation."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

MAX_LOGPROBS = 20
MAX_N = 1024
MAX_SEED = 2**63 - 1
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
class SamplingParams:
    """Sampling and stopping settings of one request, with vLLM's names and meanings.

    `temperature=0` is greedy. `seed` (0 to 2**63 - 1) makes a request's sampling
    reproducible whatever else is in the batch. `logprobs=k` returns the top-k
    log-probabilities (plus the sampled token) of each generated position; `prompt_logprobs=k`
    does so for the prompt.
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
    stop_list: list[str] = field(init=False, repr=False)

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

    def _validate_stops(self, bad: Callable[[str, str], ValueError]) -> None:
        if any(not isinstance(s, str) or not s for s in self.stop_list):
            raise bad("stop", "must be non-empty strings")
        for text in self.stop_list:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as err:
                raise bad("stop", "must be valid Unicode text") from err
        if any(not _is_int(t) for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be integers")

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
