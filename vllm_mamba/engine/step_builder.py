"""The engine's half of the step seam: the scheduler's output turned into a `worker.step.Step`.

`StepBuilder.build` reads the scheduled sequences (live `Sequence` objects) and writes only
plain data: per sequence the tokens to run, positions, slot, block table, the sampling rows of
the sequences sampled (the request's seed and the sequence's index, never a generator), the
grammar's bitmask (or, for a chain, its plan over the drafts) filled from the sequence's
matcher, which lives here, on the engine's side; the state copies and snapshots to make.

Between steps the engine queues here what the next step carries for it:

- `rollback`: a chain the engine cut short (a stop condition inside its accepted run, a
  grammar that starts there) after the worker had rolled it back to its last emitted token;
- `copy`: a state copy before the next forward (a finished sequence saved into a prefix-cache
  snapshot);
- `finish`: a sequence that left the engine (the worker drops its generator);
- `reset`: after the warm-up, the engine-wide generator restarts from the configured seed.

A request with images (`SequenceGroup.mm`) sends each image with every chunk that covers one
of its embedding positions (`StepImage`: the worker encodes it once and keeps the output),
and, on an M-RoPE model, the rotary positions of every token it runs.
"""

from __future__ import annotations

from vllm_mamba.engine.scheduler import ScheduledSeq, SchedulerOutput
from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.engine.structured_outputs import StructuredOutputs
from vllm_mamba.spec_decode.rejection_sampler import grammar_plan
from vllm_mamba.worker.step import (
    HiddenLogprob,
    PromptLogprobsWanted,
    SampleSpec,
    SamplingOptions,
    SnapshotTake,
    Step,
    StepImage,
    StepSeq,
)


def _images(group: SequenceGroup, start: int, end: int) -> list[StepImage]:
    """The request's images with an embedding position in `[start, end)`."""
    if group.mm is None:
        return []
    out = []
    for placed in group.mm.images:
        positions = placed.positions
        if positions and positions[0] < end and positions[-1] >= start:
            image = placed.image
            out.append(StepImage(image.content_hash, image.features, positions))
    return out


class StepBuilder:
    """Builds each step's plain data (see the module docstring).

    Args:
        structured_outputs: the grammars; makes each sequence's matcher when it first samples
            under its grammar.
        eos_token_id: banned (with the stop tokens) before `min_tokens`.
        vocab_size: the width of the model's logits (of a grammar's bitmask).
    """

    def __init__(
        self, structured_outputs: StructuredOutputs, eos_token_id: int | None, vocab_size: int
    ) -> None:
        self.structured_outputs = structured_outputs
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self._rollbacks: list[tuple[int, int, int]] = []
        self._rollback_requests: list[str] = []
        self._copies: list[tuple[int, int]] = []
        self._finished: list[int] = []
        self._reset = False

    # ----- what the next step carries ---------------------------------------------------
    def rollback(self, request_id: str, slot: int, chain: int, kept: int) -> None:
        """The last step's chain `chain` keeps its first `kept` positions: its state is
        brought back into `slot` before the next forward."""
        self._rollbacks.append((slot, chain, kept))
        self._rollback_requests.append(request_id)

    def copy(self, src: int, dst: int) -> None:
        """Copies state slot `src` into `dst` before the next forward."""
        self._copies.append((src, dst))

    def finish(self, seq: Sequence) -> None:
        """The sequence left the engine: the worker forgets it."""
        self._finished.append(seq.seq_id)

    def reset(self) -> None:
        """After the warm-up: the next step restarts the engine-wide generator; the warm-up's
        pending copies are dropped (its snapshots are gone)."""
        self._reset = True
        self._rollbacks, self._rollback_requests, self._copies = [], [], []

    @property
    def pending_rollback_requests(self) -> list[str]:
        """Requests whose rollback the next step carries (a failed step ends them too)."""
        return list(self._rollback_requests)

    # ----- the step -----------------------------------------------------------------------
    def build(self, out: SchedulerOutput, hidden_logprobs: list[HiddenLogprob]) -> Step:
        """The step of the scheduler's output, with what was queued since the last step."""
        step = Step(
            seqs=[self._seq(item) for item in out.scheduled],
            block_copies=list(out.block_copies),
            rollbacks=self._rollbacks,
            state_copies=self._copies + out.state_copies,
            snapshots=[SnapshotTake(p.seq_id, p.seq_slot, p.slot) for p in out.snapshots],
            hidden_logprobs=list(hidden_logprobs),
            finished_seq_ids=self._finished,
            reset_generator=self._reset,
        )
        self._rollbacks, self._rollback_requests, self._copies, self._finished = [], [], [], []
        self._reset = False
        return step

    def _seq(self, item: ScheduledSeq) -> StepSeq:
        seq, group = item.seq, item.group
        assert seq.slot is not None, "a scheduled sequence has a slot"
        start = seq.num_computed_tokens
        if item.is_spec:
            tokens = seq.token_slice(start, start + 1) + list(item.spec_token_ids)
            next_token = None
        else:
            end = start + item.num_tokens
            tokens = seq.token_slice(start, end)
            next_token = seq.token_slice(end, end + 1)[0] if end < seq.num_tokens else None
        samples: list[SampleSpec] = []
        if item.is_spec:
            samples = [self._sample(group, seq, item.spec_token_ids)]
        elif item.sample:
            samples = [self._sample(group, s, None) for s in [seq, *item.children]]
        return StepSeq(
            seq_id=seq.seq_id,
            request_id=group.request_id,
            slot=seq.slot,
            num_computed_tokens=start,
            token_ids=tokens,
            num_drafts=len(item.spec_token_ids),
            next_token_id=next_token,
            num_prompt_tokens=len(seq.prompt_token_ids),
            block_table=list(item.block_table),
            sample=item.sample,
            samples=samples,
            forks=[(c.seq_id, c.slot) for c in item.children],  # type: ignore[misc]
            prompt_logprobs=self._prompt_logprobs(item),
            images=_images(group, start, start + len(tokens)),
            rope_positions=(
                group.mm.rope_positions(start, start + len(tokens))
                if group.mm is not None and group.mm.rope_rows is not None
                else None
            ),
        )

    def _sample(self, group: SequenceGroup, seq: Sequence, drafts: list[int] | None) -> SampleSpec:
        """The sampling row of `seq` (a chain's with `drafts`): EOS and stop tokens are banned
        before `min_tokens` unless a grammar decides when the output ends."""
        params = group.params
        so = params.structured_outputs
        if so is not None and seq.matcher is None and (not so.start_after or seq.grammar_started):
            if group.matching is None:
                group.matching = self.structured_outputs.new_request(params)
            seq.matcher = self.structured_outputs.new_matcher(params, group.matching)
        stops = list(params.stop_token_ids or [])
        if self.eos_token_id is not None and not params.ignore_eos:
            stops.append(self.eos_token_id)
        if group.sampling_options is None:  # once per request, not every step
            group.sampling_options = SamplingOptions.of(params)
        options = group.sampling_options
        num_output = len(seq.output_token_ids)
        banned: list[int] = []
        min_tokens_banned: list[int] = []
        bitmask = grammar = None
        if drafts is not None:  # a chain: the bans depend on the position
            if seq.matcher is None:
                min_tokens_banned = stops
            else:
                grammar = grammar_plan(seq.matcher, list(drafts), self.vocab_size)
        elif seq.matcher is not None:
            import xgrammar as xgr

            mask = xgr.allocate_token_bitmask(1, self.vocab_size)  # (1, ceil(V / 32))
            seq.matcher.fill_next_token_bitmask(mask, 0)
            bitmask = mask[0]
        elif num_output < params.min_tokens:
            banned = stops
        return SampleSpec(
            seq_id=seq.seq_id,
            index=seq.index,
            seed=params.seed,
            options=options,
            num_output_tokens=num_output,
            prompt_token_ids=list(seq.prompt_token_ids) if options.needs_penalties else [],
            output_token_ids=(
                list(seq.output_token_ids)
                if options.needs_penalties or options.bad_words_token_ids
                else []
            ),
            banned_token_ids=banned,
            min_tokens_banned=min_tokens_banned,
            bitmask=bitmask,
            grammar=grammar,
        )

    @staticmethod
    def _prompt_logprobs(item: ScheduledSeq) -> PromptLogprobsWanted | None:
        """The first position of this chunk whose prompt logprob is still owed, if any."""
        group, seq = item.group, item.seq
        k = group.params.prompt_logprobs
        if k is None or seq.index != 0:
            return None
        done = len(group.prompt_logprobs or [None]) - 1  # positions already scored
        first = max(seq.num_computed_tokens, done)
        last = min(seq.num_computed_tokens + item.num_tokens, len(seq.prompt_token_ids) - 1)
        return PromptLogprobsWanted(first, k) if first < last else None
