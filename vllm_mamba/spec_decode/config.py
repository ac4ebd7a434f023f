"""`SpeculativeConfig`: the `speculative_config` option, with vLLM's names and defaults.

`LLM(..., speculative_config={...})` and `--speculative-config '{...}'` (JSON) take the same
keys:

- `method`: `ngram` (prompt lookup), `draft_model` (a smaller model with the same tokenizer;
  implied when `model` is given without a method) or `mtp` (the target's own multi-token
  prediction head: Qwen3.5 / Qwen3.6, Qwen3-Next, Nemotron 3 and Ling 3; vLLM's per-model
  names such as `qwen3_next_mtp`, `nemotron_h_mtp` are accepted as `mtp`).
- `num_speculative_tokens` (k): draft tokens proposed per step, 1 to `MAX_SPECULATIVE_TOKENS`.
- `prompt_lookup_min` / `prompt_lookup_max` (ngram): the n-gram lengths tried, longest first;
  one given alone sets both, neither gives 5 and 5 (vLLM's defaults).
- `model` (draft_model): a directory, shipped name or hub id; `revision`, `quantization`
  (`int8` / `int4`) and `max_model_len` of the draft are optional.
- `disable_by_batch_size`: no speculation in a step with more running requests than this
  (batched decode is compute-bound on a CPU, where verifying drafts costs more than it saves).

Any other key is a `ValueError` that names it, never silently ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")
MTP_ALIASES = (
    "qwen3_next_mtp",
    "qwen3_5_mtp",
    "nemotron_h_mtp",
    "glm5_next_mtp",
    "qwen4_exp_mtp",
    "mtp",
)
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_PROMPT_LOOKUP = 5


@dataclass
class SpeculativeConfig:
    """A validated `speculative_config` (see the module docstring)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    revision: str | None = None
    quantization: str | None = None
    max_model_len: int | None = None
    disable_by_batch_size: int | None = None

    @classmethod
    def from_value(cls, value: Any) -> SpeculativeConfig | None:
        """Parses a dict, a JSON object string, a `SpeculativeConfig` or None.

        Raises:
            ValueError: naming the key that is unknown, missing or out of range.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from err
        if not isinstance(value, dict):
            raise ValueError(
                f"speculative_config must be a JSON object, got {type(value).__name__}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(
                f"speculative_config has unsupported keys {unknown} (supported: {sorted(known)})"
            )
        args = dict(value)
        method = args.get("method")
        if method is None and args.get("model") is not None:
            method = "draft_model"
        if method in MTP_ALIASES:
            method = "mtp"
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method {args.get('method')!r} is not one of "
                f"{', '.join(METHODS)}"
            )
        args["method"] = method
        if "num_speculative_tokens" not in args:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        config = cls(**args)
        config.validate()
        return config

    def validate(self) -> None:
        """Range checks; fills the n-gram defaults.

        Raises:
            ValueError: naming the key.
        """
        _int_in("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        for name in ("max_model_len", "disable_by_batch_size"):
            if getattr(self, name) is not None:
                _int_in(name, getattr(self, name), 1, None)
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            if lo is None and hi is None:
                lo = hi = DEFAULT_PROMPT_LOOKUP
            lo = hi if lo is None else lo
            hi = lo if hi is None else hi
            _int_in("prompt_lookup_min", lo, 1, None)
            _int_in("prompt_lookup_max", hi, 1, None)
            if hi < lo:
                raise ValueError(
                    f"speculative_config.prompt_lookup_max ({hi}) must be >= "
                    f"prompt_lookup_min ({lo})"
                )
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        else:
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config.{name} applies to method ngram only")
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not self.model:
                raise ValueError("speculative_config.model (the draft model) is required")
        elif self.model is not None:
            raise ValueError(
                f"speculative_config.model applies to method draft_model, not {self.method}"
            )
        from vllm_mamba.config import QUANTIZATION_CHOICES  # that module imports this one

        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"speculative_config.quantization {self.quantization!r} is not one of "
                f"{', '.join(QUANTIZATION_CHOICES)}"
            )


def _int_in(name: str, value: Any, lo: int, hi: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"speculative_config.{name} must be an integer >= {lo}, got {value!r}")
    if hi is not None and value > hi:
        raise ValueError(f"speculative_config.{name} must be <= {hi}, got {value}")
