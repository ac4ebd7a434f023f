"""The engine's side of speculative decoding, around each step.

The proposer (`spec_decode`: n-gram lookup, a draft model, the target's MTP head) gives each
decoding sequence its draft tokens after a step (`Sequence.spec_token_ids`); the scheduler
schedules the last token and the drafts as one chain; the runner verifies the chain. This
module does what lies between, on the engine thread:

- `apply`: appends a chain's emitted tokens one by one with the usual stop checks (a stop
  string, stop token, EOS or `max_tokens` inside the accepted run ends the sequence there and
  drops the rest), then brings the sequence back to its last kept token: the worker already
  brought its state back to the chain's last emitted token (from the spare slot that saved
  it); when the engine kept fewer, the next step carries that rollback
  (`step_builder.StepBuilder.rollback`, made before anything else reads the state); its KV
  blocks are trimmed, its `num_computed_tokens` set. No prefix-cache snapshot is ever taken at
  a rejected position: a finished sequence's save is copied after this rollback.
- `propose`: new drafts for every sequence that decodes next, capped so that the chain fits
  `max_model_len` and never drafts past `max_tokens`; none while more requests run than
  `disable_by_batch_size`. A sequence whose chain was wholly rejected backs off: it decodes
  without drafts for the next 1, 3, 7, then `MAX_BACKOFF_STEPS` steps after each further
  wholly rejected chain, until a draft is accepted again. A verification step costs more than
  a plain decode (more rows, and the drafts' work), so drafts that keep failing (a draft
  model or MTP head that does not fit the text, prompt lookup on text that does not repeat)
  cost at most a small share of the decode rate, while drafts that pass keep running every
  step.
- the counters behind vLLM's `vllm:spec_decode_*` metrics and the stats line.

With speculation off, `NoSpecSteps` does nothing, so the engine calls the same hooks either
way.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from vllm_mamba.engine.output_processor import OutputProcessor
from vllm_mamba.engine.scheduler import Scheduler, SchedulerOutput
from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.engine.step_builder import StepBuilder
from vllm_mamba.spec_decode.config import SpeculativeConfig
from vllm_mamba.worker.step import StepResult


class Proposer(Protocol):
    """Proposes draft tokens for the sequences that decode next."""

    def propose(self, seqs: list[tuple[SequenceGroup, Sequence, int]]) -> list[list[int]]:
        """Drafts for each `(group, seq, k)`: at most `k` tokens to follow `seq`'s tokens."""
        ...

    def on_finished(self, seq: Sequence) -> None:
        """Forgets what the proposer holds for a sequence that left the engine."""
        ...

    # Optional: `on_step(result: StepResult) -> None`, called with every step's result before
    # `propose` (the MTP proposer takes the head's first drafts from it).


MAX_BACKOFF_STEPS = 15  # plain steps after wholly rejected chains, at most


class SpecCounters:
    """vLLM's speculative-decoding counters (monotonic, written on the engine thread)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0  # chains verified
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k  # drafts accepted at position i of a chain


class SpecDecodeSteps:
    """Speculative-decoding work of the engine's steps (see the module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        proposer: Proposer,
        builder: StepBuilder,
        scheduler: Scheduler,
        outputs: OutputProcessor,
        max_model_len: int,
    ) -> None:
        self.config = config
        self.proposer = proposer
        self.builder = builder
        self.scheduler = scheduler
        self.outputs = outputs
        self.max_model_len = max_model_len
        self.counters = SpecCounters(config.num_speculative_tokens)
        self._misses: dict[int, tuple[int, int]] = {}  # seq id -> (rejected chains, wait)

    def reset(self) -> None:
        """Zeroes the counters (after the warm-up)."""
        self.counters = SpecCounters(self.config.num_speculative_tokens)

    def apply(
        self, step: SchedulerOutput, result: StepResult, now: float
    ) -> tuple[dict[int, torch.Tensor | None], int]:
        """Appends every verified chain's tokens and rolls its sequence back to the last kept
        one (see the module docstring).

        Returns:
            Per speculating sequence id, the final hidden row `(H,)` of its last kept
            position (None unless the runner keeps hidden rows): what a finished sequence's
            prefix-cache snapshot saves; and the number of tokens appended.
        """
        on_step = getattr(self.proposer, "on_step", None)  # optional: proposers that read
        if on_step is not None:  # what the step computed for them (the MTP head's drafts)
            on_step(result)
        appended = 0
        hidden: dict[int, torch.Tensor | None] = {}
        c = self.counters
        for item in step.scheduled:
            if not item.is_spec:
                continue
            seq, spec = item.seq, result.spec[item.seq.seq_id]
            m = 0
            grammar_started = seq.grammar_started
            for row in range(len(spec.token_ids)):
                self.outputs.append_token(item.group, seq, row, spec.out, now)
                m += 1
                # A grammar that starts here did not constrain the chain's later rows.
                if seq.status.finished or seq.grammar_started != grammar_started:
                    break
            appended += m
            c.num_drafts += 1
            c.num_draft_tokens += spec.num_drafts
            c.num_accepted_tokens += spec.num_accepted
            for pos in range(spec.num_accepted):
                c.accepted_per_pos[pos] += 1
            if spec.num_accepted:
                self._misses.pop(seq.seq_id, None)
            else:
                streak = self._misses.get(seq.seq_id, (0, 0))[0] + 1
                self._misses[seq.seq_id] = (streak, min(2**streak - 1, MAX_BACKOFF_STEPS))
            if m < len(spec.token_ids):  # cut short here: the worker kept more
                assert seq.slot is not None
                self.builder.rollback(item.group.request_id, seq.slot, spec.chain, m)
            seq.num_computed_tokens += m
            self.scheduler.block_manager.trim(seq.seq_id, seq.num_computed_tokens)
            hidden[seq.seq_id] = spec.hidden[m - 1] if spec.hidden is not None else None
        return hidden, appended

    def propose(self, running: Seq[SequenceGroup]) -> None:
        """Sets the drafts of every sequence that decodes in the next step."""
        limit = self.config.disable_by_batch_size
        busy = limit is not None and sum(not g.paused for g in running) > limit
        wanted: list[tuple[SequenceGroup, Sequence, int]] = []
        for group in running:
            for seq in group.unfinished_seqs():
                seq.spec_token_ids = []
                if busy or group.paused:
                    continue
                if seq.num_uncomputed_tokens != 1 or not seq.num_computed_tokens:
                    continue
                streak, wait = self._misses.get(seq.seq_id, (0, 0))
                if wait:
                    self._misses[seq.seq_id] = (streak, wait - 1)
                    continue
                k = min(
                    self.config.num_speculative_tokens,
                    group.max_tokens - len(seq.output_token_ids) - 1,  # the bonus is free
                    self.max_model_len - seq.num_tokens,
                )
                if k > 0:
                    wanted.append((group, seq, k))
        if not wanted:
            return
        for (_, seq, k), drafts in zip(wanted, self.proposer.propose(wanted)):
            seq.spec_token_ids = list(drafts[:k])

    def on_finished(self, seq: Sequence) -> None:
        """Lets the proposer forget a finished sequence."""
        seq.spec_token_ids = []
        self._misses.pop(seq.seq_id, None)
        self.proposer.on_finished(seq)


class NoSpecSteps:
    """The engine's speculative-decoding work when speculation is off: none."""

    counters = None

    def reset(self) -> None:
        """No counters."""

    def apply(
        self, step: SchedulerOutput, result: StepResult, now: float
    ) -> tuple[dict[int, torch.Tensor | None], int]:
        """No chains."""
        return {}, 0

    def propose(self, running: Seq[SequenceGroup]) -> None:
        """No drafts."""

    def on_finished(self, seq: Sequence) -> None:
        """Nothing held."""


NGRAM_WINDOW = 4096  # the last tokens of a sequence its n-gram lookup searches


class NgramDrafts:
    """The `ngram` method as a `Proposer`: prompt lookup in each sequence's own tokens, its
    last `NGRAM_WINDOW` (the lookup runs on the engine thread every step: bounded work per
    sequence, whatever its length; `propose` caps the drafts at `max_model_len`)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        from vllm_mamba.spec_decode.ngram import NgramProposer

        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.lookup = NgramProposer(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, seqs: list[tuple[SequenceGroup, Sequence, int]]) -> list[list[int]]:
        """Drafts from the last `NGRAM_WINDOW` of the sequence's prompt and output tokens."""
        windows = [(seq.token_slice(max(seq.num_tokens - NGRAM_WINDOW, 0), seq.num_tokens), k)
                   for _, seq, k in seqs]  # fmt: skip
        return [self.lookup.propose(tokens)[:k] for tokens, k in windows]

    def on_finished(self, seq: Sequence) -> None:
        """Holds nothing per sequence."""


def make_proposer(config: SpeculativeConfig, engine: Any) -> Proposer:
    """The proposer of `config.method` for `engine` (a draft model is loaded here).

    Raises:
        ValueError: the method cannot run with this model.
    """
    max_model_len = engine.config.model_config.max_model_len
    if config.method == "ngram":
        return NgramDrafts(config, max_model_len)
    if config.method == "draft_model":
        from vllm_mamba.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer(config, engine.config, len(engine.tokenizer))
    if config.method == "mtp":
        from vllm_mamba.spec_decode.mtp_proposer import MTPProposer

        # The runner was built with the model's MTP head (`Worker.init_runner`): each step's
        # result brings the first drafts; further drafts are steps of their own.
        return MTPProposer(engine.executor, engine.scheduler.block_manager)
    raise ValueError(f"speculative_config.method {config.method!r} is unknown")
