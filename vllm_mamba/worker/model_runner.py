"""Runs one engine step on a rank's model: the only code that builds a step's tensors.

The runner consumes a `step.Step` (plain data) and returns a `step.StepResult` (plain data);
it never sees the engine's requests or sequences. It lays the step's sequences out as one flat
batch (decodes first, then prefill chunks), with the chains of speculating sequences (last
token + draft tokens) among the decodes, wave by wave (`attention.mamba_metadata`), builds the
step metadata with the selected backend (with block tables and context lengths when the model
has a KV cache), makes the step's copy-on-write KV block copies, the rollbacks the engine asked
for and the state copies before the forward (prefix-cache saves and hits), runs one forward,
forks states for `n > 1`, copies the states of the step's new snapshots into their snapshot
slots, applies the LM head to the sampled positions (and to prompt positions whose logprobs
were asked for) and samples; a chain's positions are verified against its drafts
(`spec_decode.rejection_sampler`) and its state brought to its last emitted token: copied
from the spare slot that saved it, or, for a layer that logged the chain (`layers.chain_log`),
replayed in place from the start state it left in the sequence's slot. With the MTP head it
runs the head over the step's rows (first drafts in the result) and, in a step of their own,
the further drafts (`Step.mtp_drafts`).

What the runner keeps per sequence across steps is its sampling generator: made from the
request's seed (and the sequence's index) when the sequence is first sampled, dropped when a
step lists the sequence as finished. Requests without a seed draw from the engine-wide
generator, restarted from the configured seed when a step asks (after the warm-up).

The runner is built by its `Worker` with everything it needs, once (`RunnerConfig`: the spare
slots, whether hidden rows are kept; the MTP head; CUDA graphs): nothing sets its fields
afterwards. It calls the model and makes its slot and block copies through what the worker
hands it (`StepModel`, `caches.CacheCopies`). Under tensor parallelism every rank's runner runs
the same step: the same layout, copies and calls (the model's collectives join them), the
same samples from the same generators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from vllm_mamba.attention.backend import AttentionBackend, StepLayout
from vllm_mamba.kv_cache import KVCache
from vllm_mamba.layers.sampler import SamplingRow, sample
from vllm_mamba.mamba_cache import MambaCache
from vllm_mamba.spec_decode.rejection_sampler import Chain, rejection_sample
from vllm_mamba.worker.caches import CacheCopies
from vllm_mamba.worker.cuda_graphs import DecodeCudaGraphs
from vllm_mamba.worker.image_embeds import ImageEmbeddings
from vllm_mamba.worker.step import (
    MTPDraft,
    PromptLogprobChunk,
    SampleSpec,
    SpecResult,
    Step,
    StepResult,
    StepSeq,
)

__all__ = [
    "ModelRunner",
    "PromptLogprobChunk",
    "RunnerConfig",
    "SpecResult",
    "StepModel",
    "StepResult",
]


class StepModel(Protocol):
    """What the runner calls: the model (under tensor parallelism, this rank's shard)."""

    def __call__(self, input_ids: torch.Tensor, meta: Any, mm_embeds: Any = None) -> torch.Tensor:
        """Final hidden rows `(T, H)` of the step's flat batch `input_ids (T,)` (image rows'
        input embeddings replaced by `mm_embeds`: `CausalLM.forward`)."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits `(R, V)` of rows `hidden (R, H)`."""
        ...


@dataclass(frozen=True)
class RunnerConfig:
    """What the engine decides about the runner, given when it is built.

    Attributes:
        eos_token_id: the tokenizer's (else the model config's) EOS token, banned before
            `min_tokens` and in drafts' verification.
        spare_slot_base: the first spare state slot of speculative decoding: chain c saves
            its state after position w in slot `spare_slot_base + c * max_drafts + w`.
        max_drafts: draft tokens per chain at most (`num_speculative_tokens`; 0: none).
        keep_sampled_hidden: keep each sampled position's final hidden row in the result
            (prefix caching saves finished sequences with it).
    """

    eos_token_id: int | None
    spare_slot_base: int = 0
    max_drafts: int = 0
    keep_sampled_hidden: bool = False


def in_order(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """`(src, dst)` copies cut into batches that one gathered copy each makes as if the copies
    ran one by one: a copy that reads or writes a slot an earlier copy of the batch wrote
    starts the next batch (a finished sequence's save, then a hit on that snapshot)."""
    batches: list[list[tuple[int, int]]] = []
    written: set[int] = set()
    for src, dst in pairs:
        if not batches or src in written or dst in written:
            batches.append([])
            written = set()
        batches[-1].append((src, dst))
        written.add(dst)
    return batches


class ModelRunner:
    """Runs the steps on this rank's model and caches; owns the sampling generators.

    Args:
        model: the model (`StepModel`).
        cache, kv_cache: this rank's caches (the KV cache of a hybrid, else None).
        backend: the attention backend of the built model (builds each step's metadata).
        config: the engine's decisions (`RunnerConfig`).
        seed: the engine-wide generator's seed (requests without their own seed).
        copies: makes the slot and block copies.
        mtp: the model's multi-token prediction head, run after every forward over the
            step's rows (speculative method `mtp`); None otherwise.
        cuda_graph_max_num_seqs: capture decode CUDA graphs for batches up to this size
            (None: run every step eagerly).
        images: an image-text model's encoder outputs (`image_embeds`); None for a model
            served text-only.
    """

    def __init__(
        self,
        model: StepModel,
        cache: MambaCache,
        backend: type[AttentionBackend],
        device: torch.device,
        config: RunnerConfig,
        *,
        seed: int,
        copies: CacheCopies,
        kv_cache: KVCache | None = None,
        mtp: torch.nn.Module | None = None,
        cuda_graph_max_num_seqs: int | None = None,
        images: ImageEmbeddings | None = None,
    ) -> None:
        self.model = model
        self.images = images
        self.cache = cache
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.config = config
        self.copies = copies
        self.eos_token_id = config.eos_token_id
        self.seed = seed
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # Per sequence id, the generator of a seeded request's sequence (see the module
        # docstring).
        self.generators: dict[int, torch.Generator] = {}
        self.mtp = mtp
        # Per sequence sampled, its first MTP draft and the head's output row that further
        # drafts start from (a drafting step, `Step.mtp_drafts`, continues from them).
        self.mtp_next: dict[int, tuple[int, torch.Tensor]] = {}
        self.cuda_graphs: DecodeCudaGraphs | None = None
        if cuda_graph_max_num_seqs is not None:
            self.cuda_graphs = DecodeCudaGraphs(model, cache, backend, cuda_graph_max_num_seqs)

    def make_generator(self, seed: int, index: int) -> torch.Generator:
        """A per-sequence generator, so seeded requests do not depend on the batch."""
        # Wrapped into [0, 2**63): any valid request seed gives a valid sequence seed.
        return torch.Generator(device=self.device).manual_seed((seed + 7919 * index) % 2**63)

    @torch.inference_mode()
    def execute(self, step: Step) -> StepResult:
        """Runs the step's copies, forward and sampling (see the module docstring)."""
        if step.reset_generator:
            self.generator.manual_seed(self.seed)
        for seq_id in step.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if self.kv_cache is not None and step.block_copies:
            src, dst = zip(*step.block_copies)
            self.copies.copy_blocks(list(src), list(dst))
        self.rollback(step.rollbacks)
        for batch in in_order(step.state_copies):
            self.copy_states([s for s, _ in batch], [d for _, d in batch])
        result = StepResult()
        for h in step.hidden_logprobs:
            result.hidden_logprobs[h.request_id] = self._prompt_logprobs(
                h.hidden.to(self.device)[None], [h.target], h.k, h.position
            )
        if step.seqs:
            self._run_seqs(step, result)
        if step.mtp_drafts:
            self._more_mtp_drafts(step.mtp_drafts, result)
        return result

    def _run_seqs(self, step: Step, result: StepResult) -> None:
        """The step's forward over its sequences, its copies after the forward, sampling,
        verification, the MTP head's pass and prompt logprobs."""
        items = step.seqs
        layout, token_ids, rows = self._layout(items)
        last_row = {seq_id: r[-1] for seq_id, r in rows.items()}  # its chunk's last token
        sampled = [i for i in items if i.sample and not i.is_spec]
        sample_pos = [last_row[i.seq_id] for i in sampled]
        meta = None
        mm = None
        if any(item.images for item in items):
            if self.images is None:
                raise ValueError("this model is served text-only: a step carries images")
            mm = self.images.step_rows(items, rows, self.device)
        plain = mm is None and layout.rope_positions is None
        if (
            self.cuda_graphs is not None
            and plain
            and not layout.prefill_lens
            and not layout.decode_waves
        ):
            hidden = self.cuda_graphs.run(token_ids, layout.decode_slots)  # (T, H)
        else:
            input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
            meta = self.backend.build_metadata(layout, self.device)
            hidden = (
                self.model(input_ids, meta, mm) if mm is not None else self.model(input_ids, meta)
            )

        forks = [(item.slot, slot) for item in items for _, slot in item.forks]
        self.copy_states([s for s, _ in forks], [d for _, d in forks])
        for snap in step.snapshots:
            result.snapshot_hidden[snap.seq_id] = hidden[last_row[snap.seq_id]].clone()  # (H,)
        takes = [p for p in step.snapshots if p.slot is not None]
        self.copy_states([p.seq_slot for p in takes], [p.slot for p in takes])  # type: ignore[misc]

        if sample_pos:
            self._sample(hidden, sample_pos, sampled, result)
            if self.config.keep_sampled_hidden:
                for item, pos in zip(sampled, sample_pos):
                    row = hidden[pos].clone()  # (H,)
                    for spec in item.samples:
                        result.sampled_hidden[spec.seq_id] = row
        chains = [i for i in items if i.is_spec]
        if chains:
            self._verify(hidden, chains, rows, result)
        if self.mtp is not None:
            self._mtp_pass(hidden, meta, items, rows, result)
        for item in items:
            wanted = item.prompt_logprobs
            if wanted is None:
                continue
            first = wanted.first
            flat_start = rows[item.seq_id][0] + first - item.num_computed_tokens
            end = min(item.num_computed_tokens + item.num_tokens, item.num_prompt_tokens - 1)
            targets = [item.token_at(pos) for pos in range(first + 1, end + 1)]
            assert None not in targets, "a prompt logprob's target is not in the step"
            result.prompt_logprobs[item.request_id] = self._prompt_logprobs(
                hidden[flat_start : flat_start + end - first],
                targets,  # type: ignore[arg-type]
                wanted.k,
                first + 1,
            )

    def spare_slot(self, chain: int, position: int) -> int:
        """The spare slot that saves chain `chain`'s state after its position `position`."""
        return self.config.spare_slot_base + chain * self.config.max_drafts + position

    def rollback(self, kept: list[tuple[int, int, int]]) -> None:
        """Brings speculating sequences' states back to a position of the previous step's
        chain that the engine cut short (after this runner's `_verify` had kept more).

        Args:
            kept: `(slot, chain, m)` per sequence whose chain's first `m` positions (its last
                token and `m - 1` accepted drafts) stay computed, `m` less than the chain's
                length; the state after position `m - 1` is copied back from its spare slot
                (or replayed from the start state the chain copied into its first spare slot:
                `layers.chain_log`).
        """
        if not kept:
            return
        self.copies.rollback_slots(
            [
                (self.spare_slot(chain, 0), [self.spare_slot(chain, w) for w in range(m)], slot)
                for slot, chain, m in kept
            ]
        )

    def copy_states(self, src: list[int], dst: list[int]) -> None:
        """Copies every state of slots `src[i]` into `dst[i]` (forks, prefix-cache hits and
        snapshots, rollbacks)."""
        self.copies.copy_slots(src, dst)

    def _layout(self, items: list[StepSeq]) -> tuple[StepLayout, list[int], dict[int, list[int]]]:
        """The step's flat batch: its layout (block tables and context lengths with a KV
        cache), its token ids, and each sequence's rows in it, in token order.

        Decode rows come in waves: wave w holds position w of every chain (a plain decode is
        a chain of one). Chain c's position w writes spare slot `spare_slot(c, w)` (its last
        position the sequence's slot) and reads what its position w - 1 wrote.
        """
        chains = [s for s in items if s.is_decode or s.is_spec]
        prefills = [s for s in items if not (s.is_decode or s.is_spec)]
        tokens: list[int] = []
        rows: dict[int, list[int]] = {s.seq_id: [] for s in items}
        decode_slots: list[int] = []
        chain_src: list[int] = []
        chain_dst: list[int] = []
        contexts: list[int] = []
        tables: list[list[int]] = []
        shifted = any(s.rope_positions is not None for s in items)
        rope: list[list[int]] = [[], [], []]  # M-RoPE rows of every token, when shifted
        chain_index = {s.seq_id: c for c, s in enumerate(i for i in chains if i.is_spec)}
        longest = max((s.num_tokens for s in chains), default=0)
        waves = []
        for wave in range(longest):
            first = len(tokens)
            for item in chains:
                chain = item.token_ids
                if wave >= len(chain):
                    continue
                slot = item.slot
                rows[item.seq_id].append(len(tokens))
                tokens.append(chain[wave])
                decode_slots.append(slot)
                contexts.append(item.num_computed_tokens + wave)
                if shifted:
                    _add_rope(rope, item, wave, wave + 1)
                tables.append(item.block_table)
                if longest > 1:  # position w writes spare slot w, the last one the sequence's
                    c = chain_index.get(item.seq_id, -1)  # -1: a plain decode, one row
                    last = wave + 1 == len(chain)
                    chain_dst.append(slot if last else self.spare_slot(c, wave))
                    chain_src.append(slot if wave == 0 else self.spare_slot(c, wave - 1))
            waves.append(len(tokens) - first)
        for item in prefills:
            rows[item.seq_id] = list(range(len(tokens), len(tokens) + item.num_tokens))
            tokens.extend(item.token_ids)
            if shifted:
                _add_rope(rope, item, 0, item.num_tokens)
        layout = StepLayout(
            decode_slots=decode_slots,
            prefill_lens=[s.num_tokens for s in prefills],
            prefill_slots=[s.slot for s in prefills],
            prefill_context_lens=[s.num_computed_tokens for s in prefills],
        )
        if shifted:
            layout.rope_positions = rope
        if longest > 1:
            layout.decode_waves = waves
            layout.decode_chain_src, layout.decode_chain_dst = chain_src, chain_dst
        if self.kv_cache is not None:
            layout.block_size = self.kv_cache.block_size
            layout.kv_groups = self.kv_cache.groups.num_groups
            layout.decode_context_lens = contexts
            layout.decode_block_tables = tables
            layout.prefill_block_tables = [s.block_table for s in prefills]
            layout.prefill_prompt_lens = [s.num_prompt_tokens for s in prefills]
        return layout, tokens, rows

    def _sample(
        self,
        hidden: torch.Tensor,
        positions: list[int],
        items: list[StepSeq],
        result: StepResult,
    ) -> None:
        """LM head on the sampled positions, one row per sequence (forks share their parent's)."""
        pairs = [(spec, r) for r, item in enumerate(items) for spec in item.samples]
        logits = self.model.compute_logits(hidden[positions])  # (len(items), V)
        rows = [r for _, r in pairs]
        if len(rows) != len(items):  # forks sample from their parent's row: (R, V)
            logits = logits[rows]
        out = sample(logits, [self._row(spec) for spec, _ in pairs])
        for i, (spec, _) in enumerate(pairs):
            result.samples[spec.seq_id] = (i, out)

    def _verify(
        self,
        hidden: torch.Tensor,
        chains: list[StepSeq],
        rows: dict[int, list[int]],
        result: StepResult,
    ) -> None:
        """Verifies every chain's drafts against the target's logits at its positions, then
        brings each chain's state back to its last emitted token."""
        flat = [r for item in chains for r in rows[item.seq_id]]
        logits = self.model.compute_logits(hidden[flat])  # (sum L, V)
        specs, start = [], 0
        for item in chains:
            spec = item.samples[0]
            row = self._row(spec)
            row.banned_token_ids = []
            specs.append(
                Chain(start, item.token_ids[1:], row, list(spec.min_tokens_banned), spec.grammar)
            )
            start += item.num_tokens
        outs = rejection_sample(logits, specs)
        kept: list[tuple[int, list[int], int]] = []
        for index, (item, out) in enumerate(zip(chains, outs)):
            seq_id = item.seq_id
            result.spec[seq_id] = SpecResult(
                token_ids=out.token_ids,
                out=out,
                chain=index,
                num_drafts=item.num_drafts,
                num_accepted=out.num_accepted,
                hidden=hidden[rows[seq_id]].clone() if self.config.keep_sampled_hidden else None,
            )
            n, m = item.num_tokens, len(out.token_ids)
            positions = [item.slot if w == n - 1 else self.spare_slot(index, w) for w in range(m)]
            kept.append((item.slot, positions, item.slot))
        # Each chain's state to its last kept position: copied from that position's spare
        # slot, or replayed in place from the start state (a logged layer's chain writes none).
        self.copies.rollback_slots(kept)

    def _mtp_pass(
        self,
        hidden: torch.Tensor,
        meta: object,
        items: list[StepSeq],
        rows: dict[int, list[int]],
        result: StepResult,
    ) -> None:
        """The MTP head over every row of the step (its KV at every position the target
        computed, prompts included, so prefix-cache hits find it), each row with the token
        that follows it; each sampled sequence's first draft from its last kept row."""
        self.mtp_next = {}
        assert self.mtp is not None
        next_ids = [0] * hidden.shape[0]  # rows past a chain's emitted tokens: overwritten later
        last: dict[int, int] = {}  # seq id -> the row whose MTP output drafts its next token
        for item in items:
            seq_id, seq_rows = item.seq_id, rows[item.seq_id]
            if item.is_spec:
                emitted = result.spec[seq_id].token_ids
                for row, token in zip(seq_rows, emitted):
                    next_ids[row] = token
                last[seq_id] = seq_rows[len(emitted) - 1]
                continue
            start = item.num_computed_tokens
            for j, row in enumerate(seq_rows):
                token = item.token_at(start + j + 1)
                if token is not None:
                    next_ids[row] = token
            if item.sample:
                index, out = result.samples[seq_id]
                next_ids[seq_rows[-1]] = out.token_ids[index]
                if not item.forks:  # forks draft from their second step on
                    last[seq_id] = seq_rows[-1]
        ids = torch.tensor(next_ids, dtype=torch.long, device=self.device)
        out_rows = self.mtp(self.mtp.from_target(hidden), ids, meta)  # (T, H) or (T, N * H)
        if not last:
            return
        picked = list(last.values())
        drafts = self.mtp.compute_logits(out_rows[picked]).argmax(-1).tolist()
        for (seq_id, row), draft in zip(last.items(), drafts):
            self.mtp_next[seq_id] = (draft, out_rows[row])
            result.mtp_drafts[seq_id] = draft

    def _more_mtp_drafts(self, wanted: list[MTPDraft], result: StepResult) -> None:
        """Further drafts from the MTP head (`Step.mtp_drafts`): one decode row per sequence,
        one position further each time, fed the head's previous output row (the first from the
        last step's pass) and the previous draft, as vLLM's MTP proposer. The rows write the
        head's KV at positions the target has not computed yet (in blocks the engine
        reserved); the target's next step overwrites them."""
        assert self.mtp is not None and self.kv_cache is not None
        chains = [(w, *self.mtp_next[w.seq_id]) for w in wanted]  # (wanted, draft, row)
        self.mtp_next = {}
        for w, _, _ in chains:
            result.more_drafts[w.seq_id] = []
        for step in range(1, max(w.num_drafts for w, _, _ in chains) + 1):
            chains = [c for c in chains if c[0].num_drafts >= step]
            hidden = torch.stack([row for _, _, row in chains])  # (B, H)
            ids = torch.tensor([draft for _, draft, _ in chains], device=hidden.device)
            layout = StepLayout(
                decode_slots=[w.slot for w, _, _ in chains],
                prefill_lens=[],
                prefill_slots=[],
                prefill_context_lens=[],
                decode_context_lens=[w.position + step - 1 for w, _, _ in chains],
                block_size=self.kv_cache.block_size,
                decode_block_tables=[w.block_table for w, _, _ in chains],
                kv_groups=self.kv_cache.groups.num_groups,
            )
            meta = self.backend.build_metadata(layout, hidden.device)
            hidden = self.mtp(hidden, ids, meta, spec_step=step)  # (B, H)
            drafts = self.mtp.compute_logits(hidden).argmax(-1).tolist()
            chains = [(w, d, hidden[j]) for j, ((w, _, _), d) in enumerate(zip(chains, drafts))]
            for w, draft, _ in chains:
                result.more_drafts[w.seq_id].append(draft)

    def _row(self, spec: SampleSpec) -> SamplingRow:
        """Sampling inputs of one sequence, with its generator (made from its request's seed
        when it first samples)."""
        generator = self.generator
        if spec.seed is not None:
            generator = self.generators.get(spec.seq_id)  # type: ignore[assignment]
            if generator is None:
                generator = self.generators[spec.seq_id] = self.make_generator(
                    spec.seed, spec.index
                )
        return SamplingRow(
            params=spec.options,
            generator=generator,
            prompt_token_ids=spec.prompt_token_ids,
            output_token_ids=spec.output_token_ids,
            banned_token_ids=list(spec.banned_token_ids),
            bitmask=spec.bitmask,
            num_output_tokens=spec.num_output_tokens,
        )

    def _prompt_logprobs(
        self, hidden: torch.Tensor, targets: list[int], k: int, start: int
    ) -> PromptLogprobChunk:
        """Log-probabilities of `targets` under the rows `hidden (P, H)` and their top-k."""
        logprobs = self.model.compute_logits(hidden).log_softmax(-1)  # (P, V)
        tgt = torch.tensor(targets, device=self.device)[:, None]
        tgt_lp = logprobs.gather(1, tgt)  # (P, 1)
        ranks = ((logprobs > tgt_lp).sum(-1) + 1).tolist()
        topk_lp, topk_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0],) * 2
        return PromptLogprobChunk(
            start=start,
            token_logprobs=tgt_lp[:, 0].tolist(),
            token_ranks=ranks,
            topk_ids=topk_ids.tolist(),
            topk_logprobs=topk_lp.tolist(),
        )


def _add_rope(rope: list[list[int]], item: StepSeq, start: int, end: int) -> None:
    """Appends the M-RoPE rows of `item`'s tokens `[start, end)` to `rope` (its own rows, or
    its positions in all three)."""
    if item.rope_positions is None:
        first = item.num_computed_tokens
        for row in rope:
            row.extend(range(first + start, first + end))
        return
    for row, own in zip(rope, item.rope_positions):
        row.extend(own[start:end])
