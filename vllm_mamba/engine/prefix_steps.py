"""The engine's side of prefix caching, around each step.

The scheduler decides hits and where snapshots are due (`prefix_cache.PrefixCache`); the
step carries the copies and the worker's runner makes them (told to keep each sampled
position's final hidden row when it is built). This module does what lies between, on the
engine thread; it never calls the worker, it adds to the step:

- before the forward, it fills the prompt logprobs a hit skipped: those the snapshot kept
  (cut to the request's top-k) here, and the next prompt token's, which the step scores from
  the snapshot's saved final hidden row (`worker.step.HiddenLogprob`; its chunk comes back in
  `StepResult.hidden_logprobs`);
- after a successful forward, it registers the snapshots the runner took, with the hidden
  rows the result brought (a failed step registers none, so no half-written snapshot is ever
  found) and, when the step ends, unpins the snapshots its hits read;
- when a sequence finishes, it saves its state (prompt plus all but its last token, which was
  sampled but never run): the next chat turn starts there. The snapshot is registered at once
  (it shares the sequence's KV blocks before they are freed); its state copy is the next
  step's first state copy (`step_builder.StepBuilder.copy`, after any rollback of the
  sequence's chain), and if that step fails the snapshot is dropped.

The engine calls these unconditionally: `PrefixCacheSteps` with prefix caching on,
`NoPrefixSteps` (no-ops, no counters) when it is off.
"""

from __future__ import annotations

from typing import Any

from vllm_mamba.engine.output_processor import OutputProcessor
from vllm_mamba.engine.prefix_cache import PrefixCache, Snapshot
from vllm_mamba.engine.scheduler import SchedulerOutput
from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.engine.step_builder import StepBuilder
from vllm_mamba.outputs import PositionLogprobs
from vllm_mamba.worker.step import HiddenLogprob, StepResult

__all__ = ["PrefixCacheSteps", "NoPrefixSteps"]


class PrefixCacheSteps:
    """Prefix-cache work of the engine's steps (see the module docstring)."""

    def __init__(self, cache: PrefixCache, builder: StepBuilder, outputs: OutputProcessor) -> None:
        self.cache = cache
        self.builder = builder
        self.outputs = outputs
        self._saved: list[Snapshot] = []  # saved since the last step: copied by the next one
        self._saving: list[Snapshot] = []  # saved by the step in flight

    @property
    def queries(self) -> int:
        """Prompt tokens looked up in the cache (vLLM's counter)."""
        return self.cache.queries

    @property
    def hits(self) -> int:
        """Prompt tokens found in the cache."""
        return self.cache.hits

    def reset(self) -> None:
        """Forgets every snapshot and zeroes the counters (after the warm-up)."""
        self.cache.clear()
        self.cache.queries = self.cache.hits = 0
        self._saved, self._saving = [], []

    def before_forward(self, step: SchedulerOutput) -> list[HiddenLogprob]:
        """Fills the prompt logprobs the step's hits kept; returns those the step scores from
        saved hidden rows. The saves queued since the last step ride on this one."""
        self._saving, self._saved = self._saved, []
        scored = []
        for hit in step.hits:
            wanted = self._hit_prompt_logprobs(hit.group, hit.seq, hit.snapshot)
            if wanted is not None:
                scored.append(wanted)
        return scored

    def after_forward(self, step: SchedulerOutput, result: StepResult) -> None:
        """Registers the snapshots the runner took in this step's forward, with their hidden
        rows."""
        while step.snapshots:
            pending = step.snapshots.pop(0)
            pending.hidden = result.snapshot_hidden.get(pending.seq_id)
            group = pending.group
            lps = group.prompt_logprobs if pending.index == 0 else None
            self.cache.commit(pending, lps, group.params.prompt_logprobs or 0)

    def end_step(self, step: SchedulerOutput, failed: bool) -> None:
        """Unpins the hits' snapshots; after a failed step, drops its reserved snapshots and
        the saved ones whose copy it carried."""
        if failed:
            for pending in step.snapshots:
                self.cache.discard(pending)
            step.snapshots = []
            for snap in self._saving:
                self.cache.drop(snap)
        self._saving = []
        for hit in step.hits:
            self.cache.unpin(hit.snapshot)

    def on_finished(self, group: SequenceGroup, seq: Sequence, hidden: Any) -> None:
        """Saves a finished sequence's state unless that prefix is saved already.

        Args:
            hidden: the sequence's last final hidden row `(H,)` (of its sampled position),
                or None.
        """
        if seq.slot is None or seq.num_computed_tokens < 1:
            return
        tokens = seq.key_slice(0, seq.num_computed_tokens)
        if self.cache.has_snapshot(tokens):
            return
        pending = self.cache.reserve(seq.seq_id, seq.slot, tokens, group, seq.index)
        if pending is None:
            return
        pending.hidden = hidden.clone() if hidden is not None else None
        assert pending.slot is not None  # no snapshot of these tokens existed
        self.builder.copy(seq.slot, pending.slot)
        lps = group.prompt_logprobs if seq.index == 0 else None
        self._saved.append(self.cache.commit(pending, lps, group.params.prompt_logprobs or 0))

    def _hit_prompt_logprobs(
        self, group: SequenceGroup, seq: Sequence, snap: Snapshot
    ) -> HiddenLogprob | None:
        """Appends the kept prompt logprobs of a hit; the next one is the step's to score."""
        k = group.params.prompt_logprobs
        if k is None or seq.index != 0 or group.prompt_logprobs is None:
            return None
        depth, prompt = snap.num_tokens, group.prompt_token_ids
        if len(group.prompt_logprobs) > depth:  # already scored (a preempted request)
            return None
        assert snap.prompt_logprobs is not None  # `match` only returns such snapshots
        first = len(group.prompt_logprobs)  # the first token position still owed
        kept = snap.prompt_logprobs[first - 1 :]  # entries of tokens first .. depth - 1
        group.prompt_logprobs.extend(
            _trim_top(entry, k, prompt[first + i]) for i, entry in enumerate(kept)
        )
        # On the CPU in the step (it may travel to other processes).
        return HiddenLogprob(group.request_id, snap.hidden.cpu(), prompt[depth], k, depth)


class NoPrefixSteps:
    """The engine's prefix-cache work when prefix caching is off: none."""

    queries = 0
    hits = 0

    def reset(self) -> None:
        """Nothing to forget."""

    def before_forward(self, step: SchedulerOutput) -> list[HiddenLogprob]:
        """No hits to fill."""
        return []

    def after_forward(self, step: SchedulerOutput, result: StepResult) -> None:
        """No snapshots to register."""

    def end_step(self, step: SchedulerOutput, failed: bool) -> None:
        """Nothing pinned."""

    def on_finished(self, group: SequenceGroup, seq: Sequence, hidden: Any) -> None:
        """Nothing saved."""


def _trim_top(entry: PositionLogprobs, k: int, target: int) -> PositionLogprobs:
    """A prompt-logprob entry kept with a larger top-k, cut to the request's `k`."""
    return {t: lp for t, lp in entry.items() if lp.rank <= k or t == target}
