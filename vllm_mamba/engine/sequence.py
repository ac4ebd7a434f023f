"""Requests and their sequences: plain Python state that the scheduler moves through the engine.

A sequence never leaves the engine: a step carries what the worker needs of it as plain data
(`step_builder`), and the worker keeps the sequence's sampling generator itself.

A `SequenceGroup` is one request; it holds `n` `Sequence`s once its prompt is prefilled and
forked. Every sequence tracks `num_computed_tokens`: the tokens whose effect is already in its
state slot. What remains to compute (a prompt chunk, the last sampled token, or everything
after a preemption) is `num_tokens - num_computed_tokens`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_mamba.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vllm_mamba.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    """Where a sequence is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        """True for every finished status."""
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


@dataclass
class Sequence:
    """One completion of a request: its tokens, its state slot and its decoded text."""

    seq_id: int
    index: int
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    slot: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_text: str = ""
    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    # Engine-side helpers; a step never carries them (`step_builder` copies what it needs).
    detokenizer: object | None = None
    matcher: object | None = None  # grammar matcher of a request with structured outputs
    grammar_started: bool = False  # its `start_after` text has been generated
    spec_token_ids: list[int] = field(default_factory=list)  # draft tokens for the next step
    # The prefix cache's keys of the prompt when they are not its ids (a prompt with images:
    # `multimodal.prompt.MultiModalPrompt.cache_keys`); None: the ids.
    prompt_keys: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt plus output tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose effect is not yet in the state."""
        return self.num_tokens - self.num_computed_tokens

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of prompt + output."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        head = self.prompt_token_ids[start:] if start < prompt_len else []
        return head + self.output_token_ids[max(start - prompt_len, 0) : end - prompt_len]

    def key_slice(self, start: int, end: int) -> list[int]:
        """The prefix cache's keys of tokens `[start, end)`: `token_slice`, with an image's
        tokens keyed by its content (`prompt_keys`)."""
        if self.prompt_keys is None:
            return self.token_slice(start, end)
        prompt_len = len(self.prompt_token_ids)
        head = self.prompt_keys[start:end] if start < prompt_len else []
        return head + self.output_token_ids[max(start - prompt_len, 0) : end - prompt_len]

    def to_output(self, with_logprobs: bool) -> CompletionOutput:
        """A snapshot for `RequestOutput.outputs`."""
        return CompletionOutput(
            index=self.index,
            text=self.output_text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob if with_logprobs else None,
            logprobs=list(self.output_logprobs) if with_logprobs else None,
            finish_reason=self.status.value if self.status.finished else None,
            stop_reason=self.stop_reason,
        )


@dataclass
class SequenceGroup:
    """One request: its prompt, parameters and sequences (one until the prompt is forked)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    reserved_slots: list[int] = field(default_factory=list)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
    path_node: Any = None  # the prompt's node in the prefix cache's radix tree
    cache_points: list[int] = field(default_factory=list)  # prompt offsets to snapshot at
    cache_point_nodes: list[Any] = field(default_factory=list)  # their nodes in the tree
    paused: bool = False  # its consumer is not reading: not scheduled (see `Scheduler`)
    sampling_options: Any = None  # `params` as the step's plain copy, made once (`StepBuilder`)
    matching: Any = None  # its grammar matching work (`structured_outputs.RequestMatching`)
    mm: Any = None  # its images (`multimodal.prompt.MultiModalPrompt`); None for text

    @property
    def prompt_keys(self) -> list[int]:
        """The prefix cache's keys of the prompt (`Sequence.key_slice`)."""
        return self.mm.cache_keys if self.mm is not None else self.prompt_token_ids

    @property
    def pending_forks(self) -> int:
        """Children still to fork off the first sequence once its prompt is done."""
        return self.params.n - len(self.seqs)

    def unfinished_seqs(self) -> list[Sequence]:
        """Sequences still generating."""
        return [s for s in self.seqs if not s.status.finished]

    @property
    def finished(self) -> bool:
        """True when no sequence will produce more tokens."""
        return self.pending_forks == 0 and not self.unfinished_seqs()

    def to_output(self) -> RequestOutput:
        """A snapshot of the request for the caller."""
        with_logprobs = self.params.logprobs is not None
        metrics = {"arrival_time": self.arrival_time}
        if self.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = self.first_scheduled_time
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
            outputs=[s.to_output(with_logprobs) for s in sorted(self.seqs, key=lambda s: s.index)],
            finished=self.finished,
            metrics=metrics,
            num_cached_tokens=self.num_cached_tokens,
        )
