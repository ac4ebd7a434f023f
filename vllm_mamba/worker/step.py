"""The step as plain data: what the engine sends a worker (`Step`) and what comes back
(`StepResult`).

A `Step` holds only ints, floats, bools, strings, None, lists, dicts, frozen dataclasses of
those and a few CPU tensors (a grammar's token bitmask, a saved hidden row), so it pickles and
runs in another process. It never refers to the engine's objects: a scheduled sequence is
its ids, the tokens to run, its state slot and KV blocks; a sampled sequence is a
`SamplingOptions` (the sampling parameters the sampler reads), its seed (the worker keeps the
sequence's generator, made from the seed when it first samples, until the step lists the
sequence as finished) and the grammar's bitmask the engine filled from the sequence's matcher.

Every state copy the step needs is in it, in the order the worker makes them:

1. `block_copies`: KV blocks, copy-on-write of shared blocks (before the forward);
2. `rollbacks`: the chains of the previous step that the engine cut short after the worker
   had rolled them back to their last emitted token (a stop string or token inside the
   accepted run, a grammar that starts there): each state back to its last kept token from
   the spare slot that saved it (the spare slots are only written by a forward);
3. `state_copies`: state slots before the forward, in order: the states of finished
   sequences saved into prefix-cache snapshots, then the prefix-cache hits (a snapshot into a
   sequence's slot);
4. after the forward: forks (`StepSeq.forks`, the parent's slot into each child's), then the
   prefix-cache snapshots the step takes (`snapshots`), then each chain's rollback to its
   last emitted token from the spare slot that saved it (the worker decides it from the
   verification).

`StepResult` is what the runner returns: the sampled tokens and logprobs, prompt logprobs,
verified chains, and the final hidden rows the engine keeps (prefix caching).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_mamba.layers.sampler import SamplerOutput
from vllm_mamba.sampling_params import SamplerFlags, SamplingParams
from vllm_mamba.spec_decode.rejection_sampler import GrammarPlan

__all__ = [
    "GrammarPlan",
    "HiddenLogprob",
    "MTPDraft",
    "PromptLogprobChunk",
    "PromptLogprobsWanted",
    "SampleSpec",
    "SamplingOptions",
    "SnapshotTake",
    "SpecResult",
    "Step",
    "StepImage",
    "StepResult",
    "StepSeq",
]


@dataclass(frozen=True)
class SamplingOptions(SamplerFlags):
    """The sampling parameters the sampler reads, as plain values (a request's
    `SamplingParams` without its stop strings, tokenizer-derived text and compiled grammar)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: int | None = None

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingOptions:
        """The options of a request's parameters."""
        return cls(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            min_tokens=params.min_tokens,
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            repetition_penalty=params.repetition_penalty,
            logit_bias=dict(params.logit_bias) if params.logit_bias else None,
            allowed_token_ids=list(params.allowed_token_ids) if params.allowed_token_ids else None,
            bad_words_token_ids=[list(w) for w in params.bad_words_token_ids],
            logprobs=params.logprobs,
        )


@dataclass(frozen=True)
class SampleSpec:
    """One sequence sampled at the end of its row (a forked child samples from its parent's
    last position), or a chain verified.

    Attributes:
        seq_id: the sequence (the key of its result and of its generator in the worker).
        index: its index in its request (`n > 1`): the seed of its generator is
            `(seed + 7919 * index) mod 2**63`.
        seed: the request's seed; None: the worker's engine-wide generator.
        options: the sampling parameters.
        num_output_tokens: tokens the sequence generated before this step (the step counter:
            `min_tokens` of a chain's positions counts from it).
        prompt_token_ids, output_token_ids: the sequence's tokens, sent only when the
            sampler reads them (penalties, bad words); empty otherwise.
        banned_token_ids: tokens banned at this position (EOS and stop tokens before
            `min_tokens`, unless a grammar decides when the output ends).
        min_tokens_banned: a chain's tokens banned at its positions before `min_tokens`.
        bitmask: the grammar's allowed tokens at this position, `(ceil(V / 32),)` int32, from
            the sequence's matcher; None without a grammar.
        grammar: a chain's grammar plan (its masks over the drafts the grammar allows, and
            which positions are verified); None without a grammar.
    """

    seq_id: int
    index: int
    seed: int | None
    options: SamplingOptions
    num_output_tokens: int
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    banned_token_ids: list[int] = field(default_factory=list)
    min_tokens_banned: list[int] = field(default_factory=list)
    bitmask: torch.Tensor | None = None
    grammar: GrammarPlan | None = None


@dataclass(frozen=True)
class PromptLogprobsWanted:
    """The prompt logprobs a chunk owes: positions `first ..` of its prompt (each scoring the
    token after it, up to the prompt's last token), with the top `k`."""

    first: int
    k: int


@dataclass(frozen=True)
class StepImage:
    """One image of a request, as a step carries it to the worker.

    Attributes:
        content_hash: identifies the image (the worker caches its encoder output by it).
        features: the encoder's inputs (`multimodal.inputs.ProcessedImage.features`: CPU
            tensors).
        positions: the absolute positions in the sequence whose input embeddings are the
            encoder's output rows, in row order.
    """

    content_hash: str
    features: dict[str, Any]
    positions: tuple[int, ...]


@dataclass(frozen=True)
class StepSeq:
    """One scheduled sequence's share of the step.

    Attributes:
        seq_id, request_id: the sequence and its request.
        slot: its state slot.
        num_computed_tokens: its tokens already in the state (the position of `token_ids[0]`).
        token_ids: the tokens to run: a prefill chunk, a decode's last token, or a chain's last
            token followed by its `num_drafts` draft tokens.
        num_drafts: draft tokens at the end of `token_ids` (a chain when more than 0).
        next_token_id: the token after `token_ids` when it is known (a prompt chunk that is not
            the last): the target of the last position's prompt logprob and MTP row.
        num_prompt_tokens: the request's prompt length.
        block_table: its KV blocks (empty for attention-free models).
        sample: the last position is sampled (for a chain: verified).
        samples: the sequences sampled at the last position: this one, then its forks (empty
            unless `sample`); a chain: this one, verified.
        forks: `(child seq id, child slot)` of the sequences forked from this one after the
            forward (`n > 1`: the prompt's last chunk).
        prompt_logprobs: the prompt logprobs this chunk owes; None when none.
        images: the images whose encoder output some of `token_ids` take as their input
            embeddings (empty for a text request, and for chunks outside its images).
        rope_positions: M-RoPE models: the `(time, height, width)` rotary positions of each of
            `token_ids`, three rows of `num_tokens` (image tokens differ per row; text tokens
            after an image sit at their index plus the request's shift); None where each
            token rotates at its index.
    """

    seq_id: int
    request_id: str
    slot: int
    num_computed_tokens: int
    token_ids: list[int]
    num_drafts: int = 0
    next_token_id: int | None = None
    num_prompt_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    sample: bool = False
    samples: list[SampleSpec] = field(default_factory=list)
    forks: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: PromptLogprobsWanted | None = None
    images: list[StepImage] = field(default_factory=list)
    rope_positions: list[list[int]] | None = None

    @property
    def num_tokens(self) -> int:
        """Positions the step runs for this sequence."""
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """One token on top of an existing state."""
        return len(self.token_ids) == 1 and self.num_computed_tokens > 0

    @property
    def is_spec(self) -> bool:
        """The last token and draft tokens to verify, as a chain of decode rows."""
        return self.num_drafts > 0

    def token_at(self, position: int) -> int | None:
        """The token at absolute `position` when the step knows it, else None."""
        offset = position - self.num_computed_tokens
        if 0 <= offset < len(self.token_ids):
            return self.token_ids[offset]
        if offset == len(self.token_ids):
            return self.next_token_id
        return None


@dataclass(frozen=True)
class SnapshotTake:
    """A prefix-cache snapshot the step takes after its forward: the final hidden row of the
    sequence's last position comes back (`StepResult.snapshot_hidden`) and, unless `slot` is
    None (the snapshot exists; only its prompt logprobs are added), the sequence's state is
    copied from `seq_slot` into `slot`."""

    seq_id: int
    seq_slot: int
    slot: int | None


@dataclass(frozen=True)
class HiddenLogprob:
    """A prompt logprob a prefix-cache hit skipped: token `target` at prompt `position`,
    scored from the saved final hidden row `hidden (H,)` of position `position - 1`."""

    request_id: str
    hidden: torch.Tensor
    target: int
    k: int
    position: int


@dataclass(frozen=True)
class MTPDraft:
    """Further drafts of the MTP head (speculative method `mtp`) for a sequence whose first
    draft the last step returned (`StepResult.mtp_drafts`): `num_drafts` more, each a decode row
    of the head fed its own previous output row and the previous draft, the first at context
    length `position` (the sequence's last token), the next one further on; `block_table` holds
    the blocks of the KV the head writes there (reserved by the engine).
    """

    seq_id: int
    slot: int
    num_drafts: int
    position: int
    block_table: list[int]


@dataclass(frozen=True)
class Step:
    """One engine step as plain data (see the module docstring).

    Attributes:
        seqs: the scheduled sequences, decodes first, then chains, then prefill chunks.
        block_copies: `(src, dst)` KV blocks to copy before the forward.
        rollbacks: `(slot, chain, m)`: the previous step's chain `chain` keeps its first `m`
            positions; its state after position `m - 1` is copied back into `slot`.
        state_copies: `(src, dst)` state slots to copy before the forward.
        snapshots: prefix-cache snapshots to take after the forward.
        hidden_logprobs: prompt logprobs to score from saved hidden rows (prefix-cache hits).
        finished_seq_ids: sequences that left the engine since the last step: the worker
            forgets what it keeps for them (their generators).
        reset_generator: restart the engine-wide generator from the configured seed first
            (after the warm-up).
        mtp_drafts: further MTP drafts to make after the step's own work (a step of its own,
            with no `seqs`, between two engine steps: see `spec_decode.mtp_proposer`).
    """

    seqs: list[StepSeq]
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    rollbacks: list[tuple[int, int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[SnapshotTake] = field(default_factory=list)
    hidden_logprobs: list[HiddenLogprob] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    reset_generator: bool = False
    mtp_drafts: list[MTPDraft] = field(default_factory=list)


@dataclass
class PromptLogprobChunk:
    """Prompt logprobs of consecutive positions: entry j scores prompt token `start + j`."""

    start: int
    token_logprobs: list[float]
    token_ranks: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


@dataclass
class SpecResult:
    """One verified chain: the tokens it emits (its accepted drafts and one more), one
    sampler-output row each, and what a later rollback needs.

    Attributes:
        chain: the chain's index in the step (which spare slots hold its states).
        num_drafts: draft tokens verified; num_accepted: how many were accepted.
        hidden: `(L, H)` final hidden rows of the chain's positions, when kept.
    """

    token_ids: list[int]
    out: SamplerOutput
    chain: int
    num_drafts: int
    num_accepted: int
    hidden: torch.Tensor | None = None


@dataclass
class StepResult:
    """What a step gives back, all plain data.

    Attributes:
        samples: per sampled sequence id, its row in a sampler output.
        prompt_logprobs: per request, the prompt logprobs of its chunk.
        hidden_logprobs: per request, the prompt logprob scored from a saved hidden row
            (`Step.hidden_logprobs`); it comes before the request's chunk.
        sampled_hidden: per sampled sequence id, the final hidden row `(H,)` of its sampled
            position (when the runner keeps them: prefix caching).
        snapshot_hidden: per sequence of `Step.snapshots`, the final hidden row `(H,)` of its
            chunk's last position.
        spec: per speculating sequence id, its verified chain.
        mtp_drafts: with the MTP head, per sequence that drafts next, the head's first draft
            (its output row stays in the worker for `Step.mtp_drafts`).
        more_drafts: per `Step.mtp_drafts` entry, the further drafts.
    """

    samples: dict[int, tuple[int, SamplerOutput]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobChunk] = field(default_factory=dict)
    hidden_logprobs: dict[str, PromptLogprobChunk] = field(default_factory=dict)
    sampled_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    snapshot_hidden: dict[int, torch.Tensor] = field(default_factory=dict)
    spec: dict[int, SpecResult] = field(default_factory=dict)
    mtp_drafts: dict[int, int] = field(default_factory=dict)
    more_drafts: dict[int, list[int]] = field(default_factory=dict)
