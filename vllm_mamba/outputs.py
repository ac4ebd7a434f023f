"""Request outputs returned by `LLM.generate` and streamed by the engine and the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """The log-probability of one token at one position, its rank, and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


# One position: token id -> Logprob, holding the top-k tokens and the chosen one.
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    """One generated sequence of a request (there are `n`)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        """True once the sequence stopped."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request: its prompt and its `n` completions so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int | None = None  # prompt tokens served by the prefix cache
