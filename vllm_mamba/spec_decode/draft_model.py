"""The `draft_model` method: a smaller model with the same tokenizer proposes the drafts.

The draft is any model the engine runs (a Mamba drafting for a hybrid included). It lives in
the engine's process (on rank 0 under tensor parallelism) with caches of its own: a state
slot per sequence plus a backup slot, and KV blocks when it has attention layers. Per step,
for every sequence that decodes next:

1. the draft's state is brought back to the sequence's last committed token (the backup
   taken in the previous round, which holds the tokens the target has since confirmed or
   not), and the tokens since then (the accepted drafts and the target's own token; at first
   the whole prompt) run as one chunk; the last row's argmax is draft 1, and the state after
   the chunk (every token in it is known) is saved as the new backup;
2. k - 1 one-token steps over all sequences at once give drafts 2 .. k.

Proposals are the draft's argmax (a one-hot draft distribution), so the target's rejection
sampling keeps the target's distribution exactly. The draft's own numbers only change how
many drafts are accepted, never the output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.selector import select_attention_backend
from vllm_mamba.config import record_quantization, text_config
from vllm_mamba.engine.block_manager import BlockManager
from vllm_mamba.engine.sequence import Sequence, SequenceGroup
from vllm_mamba.kv_cache import KVCache, plan_num_blocks
from vllm_mamba.layers.cache_layers import kv_cache_layers
from vllm_mamba.spec_decode.config import SpeculativeConfig
from vllm_mamba.state_cache import SlotAllocator, StateCache, state_specs_of

logger = logging.getLogger(__name__)


@dataclass
class _Draft:
    """What the draft holds for one sequence: its slots and how many tokens its backup holds."""

    slot: int
    backup: int
    committed: int = 0  # tokens whose effect is in `backup` (all known to be right)
    blocks: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)  # the drafts it proposed last


class DraftModelProposer:
    """Proposes with a draft model (see the module docstring).

    Args:
        config: the speculative config (`model`, `revision`, `quantization`).
        engine_config: the target engine's config (device, dtype, limits).
        num_tokens: the tokenizer's size: both models' vocabularies (which checkpoints pad
            to different sizes) must hold it; drafts are drawn from the ids both have.

    Raises:
        ValueError: the draft's vocabulary does not hold the tokenizer's tokens.
        FileNotFoundError: the draft model is not there.
    """

    def __init__(self, config: SpeculativeConfig, engine_config: Any, num_tokens: int) -> None:
        from vllm_mamba.model_loader import build_model, load_hf_config, resolve_model_path

        mc = engine_config.model_config
        assert config.model is not None
        self.k = config.num_speculative_tokens
        self.device = engine_config.device
        path = resolve_model_path(config.model, config.revision)
        hf_config = load_hf_config(path)
        draft_vocab = int(text_config(hf_config).vocab_size)
        if draft_vocab < num_tokens:
            raise ValueError(
                f"speculative_config.model {config.model!r} has a vocabulary of {draft_vocab} "
                f"tokens, fewer than the target's tokenizer ({num_tokens}): a draft model must "
                "share the target's tokenizer"
            )
        self.vocab = min(draft_vocab, mc.vocab_size)  # drafts are ids both models have
        record_quantization(hf_config, config.quantization)
        self.model, self.architecture = build_model(path, hf_config, mc.dtype, self.device)
        max_seqs = engine_config.scheduler_config.max_num_seqs
        specs = state_specs_of(self.model, mc.dtype, engine_config.ssm_state_dtype)
        self.cache = StateCache(specs, 2 * max_seqs, self.device)
        self.cache.bind(self.model)
        self.slots = SlotAllocator(2 * max_seqs)
        self.kv_cache: KVCache | None = None
        self.blocks: BlockManager | None = None
        kv_specs = [layer.kv_spec(mc.dtype) for layer in kv_cache_layers(self.model)]
        if kv_specs:
            cc = engine_config.cache_config
            sizing = plan_num_blocks(
                kv_specs, cc.block_size, max_seqs, mc.max_model_len, self.device,
                cc.kv_cache_memory_bytes,
            )  # fmt: skip
            self.kv_cache = KVCache(kv_specs, sizing, self.device)
            self.kv_cache.bind(self.model)
            windows = self.kv_cache.groups.windows
            self.blocks = BlockManager(sizing.num_blocks, sizing.block_size, windows)
        self.backend = select_attention_backend(has_kv_cache=self.kv_cache is not None)
        self._drafts: dict[int, _Draft] = {}
        logger.info(
            "Draft model %s (%s) for speculative decoding: %d tokens per step, %.2f MiB of "
            "state per sequence",
            config.model,
            self.architecture,
            self.k,
            self.cache.bytes_per_slot() / 2**20,
        )

    @torch.inference_mode()
    def propose(self, seqs: list[tuple[SequenceGroup, Sequence, int]]) -> list[list[int]]:
        """Drafts for each `(group, seq, k)`: at most `k` tokens (fewer when the draft's
        slots or KV blocks run out)."""
        runs: list[tuple[int, Sequence, _Draft, list[int]]] = []
        fixed: dict[int, list[int]] = {}
        for index, (_, seq, k) in enumerate(seqs):
            draft = self._draft(seq)
            if draft is None:
                continue
            tokens = seq.prompt_token_ids + seq.output_token_ids
            chunk = tokens[draft.committed :]
            if not chunk:  # not scheduled since its last proposal: nothing new
                fixed[index] = draft.last[:k]
                continue
            if not self._grow(seq.seq_id, draft, len(tokens) + k):
                continue
            runs.append((index, seq, draft, chunk))
        out: list[list[int]] = [list(fixed.get(i, [])) for i in range(len(seqs))]
        if not runs:
            return out
        # Round start: every draft from its backup, then its unconfirmed tokens as one chunk.
        self.cache.copy_slots([d.backup for _, _, d, _ in runs], [d.slot for _, _, d, _ in runs])
        chunks = [(d, d.committed, c) for _, _, d, c in runs]
        next_ids = self._forward(chunks)
        for (index, _, draft, chunk), token in zip(runs, next_ids):
            draft.committed += len(chunk)
            out[index].append(token)
        self.cache.copy_slots([d.slot for _, _, d, _ in runs], [d.backup for _, _, d, _ in runs])
        # Drafts 2 .. k: one token per sequence per step, all sequences together.
        live = [(index, draft, seqs[index][2]) for index, _, draft, _ in runs]
        for step in range(1, max(k for _, _, k in live)):
            live = [(i, d, k) for i, d, k in live if k > step]
            if not live:
                break
            chunks = [(d, d.committed + step - 1, [out[i][-1]]) for i, d, _ in live]
            for (i, _, _), token in zip(live, self._forward(chunks)):
                out[i].append(token)
        for index, _, draft, _ in runs:
            draft.last = out[index]
        return out

    def on_finished(self, seq: Sequence) -> None:
        """Frees the sequence's draft slots and blocks."""
        draft = self._drafts.pop(seq.seq_id, None)
        if draft is None:
            return
        self.slots.free(draft.slot)
        self.slots.free(draft.backup)
        if self.blocks is not None:
            self.blocks.free(seq.seq_id)

    def _draft(self, seq: Sequence) -> _Draft | None:
        """The sequence's draft record, new (with two slots) on its first proposal; None when
        the slots are all taken."""
        draft = self._drafts.get(seq.seq_id)
        if draft is None:
            if self.slots.num_free < 2:
                return None
            draft = _Draft(self.slots.allocate(), self.slots.allocate())
            self._drafts[seq.seq_id] = draft
        return draft

    def _grow(self, seq_id: int, draft: _Draft, length: int) -> bool:
        """Makes the draft's KV blocks cover `length` tokens; False when the pool is short."""
        if self.blocks is None:
            return True
        work = [(seq_id, draft.committed, length - draft.committed)]
        if not self.blocks.can_allocate(work):
            return False
        self.blocks.allocate(*work[0])
        draft.blocks = self.blocks.block_table(seq_id)
        return True

    def _forward(self, chunks: list[tuple[_Draft, int, list[int]]]) -> list[int]:
        """Runs `(draft, start, tokens)` chunks (one-token ones as decodes) in one forward;
        returns each chunk's argmax next token."""
        decodes = [c for c in chunks if len(c[2]) == 1 and c[1] > 0]
        prefills = [c for c in chunks if not (len(c[2]) == 1 and c[1] > 0)]
        layout = StepLayout(
            decode_slots=[d.slot for d, _, _ in decodes],
            prefill_lens=[len(t) for _, _, t in prefills],
            prefill_slots=[d.slot for d, _, _ in prefills],
            prefill_context_lens=[s for _, s, _ in prefills],
        )
        if self.kv_cache is not None:
            layout.block_size = self.kv_cache.block_size
            layout.kv_groups = self.kv_cache.groups.num_groups
            layout.decode_context_lens = [s for _, s, _ in decodes]
            layout.decode_block_tables = [d.blocks for d, _, _ in decodes]
            layout.prefill_block_tables = [d.blocks for d, _, _ in prefills]
        ordered = decodes + prefills
        token_ids = [t for _, _, tokens in ordered for t in tokens]
        ends = torch.tensor([len(t) for _, _, t in ordered]).cumsum(0) - 1
        meta = self.backend.build_metadata(layout, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, meta)  # (T, H)
        logits = self.model.compute_logits(hidden[ends.to(self.device)])  # (chunks, V)
        best = logits[:, : self.vocab].argmax(-1).tolist()
        by_draft = {id(d): b for (d, _, _), b in zip(ordered, best)}
        return [by_draft[id(d)] for d, _, _ in chunks]
