"""`PerLayerEmbedding` (Qwen4-Exp's per-layer n-gram embedding) against transformers 5.24's
`Qwen4ExpTextPLELayer`.

A tiny config (H 32, 3 streams, E 32, trigrams with 2 heads per order, head vocabularies the
primes from 50 on, so a 64-token vocabulary collides in every head, conv of 3 taps dilated by
3), random weights, HF's state dict loaded into the engine layer by name. Token sequences hold
EOS ids (0) at their start, inside, and twice in a row, so the EOS cut of the n-grams is
exercised across chunk and decode boundaries. Checked:

- the hash constants, parameter names and shapes equal transformers' (the saved buffers are
  the ones `CHECKPOINT_BUFFERS` names), also after a build on the meta device;
- (a) one whole prefill equals HF's uncached forward (float32, and bfloat16 loosely);
- (b) chunked prefill at odd cuts, then decodes token by token, equal the whole, and leave
  the state of the whole prefill;
- (c) one step of decode rows and prefill chunks (fresh and continued) of several sequences
  equals each alone (HF's forward over the whole sequence), with padding rows and chunks
  touching no state;
- (d) speculative decode waves (metadata from the engine's builder): every chain position's
  output equals HF's and its state, in the slot `decode_chain_dst` names, equals that of a
  prefill of the sequence up to it;
- padding decode rows beside a written slot (the sync-free write) and an all-padding step.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextPLELayer  # noqa: E402

from vllm_mamba.attention.backend import StepLayout  # noqa: E402
from vllm_mamba.attention.mamba_metadata import build_mamba_metadata  # noqa: E402
from vllm_mamba.cache_specs import PAD_SLOT_ID  # noqa: E402
from vllm_mamba.layers.ngram_embedding import CHECKPOINT_BUFFERS, PerLayerEmbedding  # noqa: E402
from vllm_mamba.models.layer_stream import to_empty  # noqa: E402
from vllm_mamba.ops.dispatch import REF_OPS  # noqa: E402
from vllm_mamba.state_cache import StateCache  # noqa: E402

H, N, E, VOCAB, EOS = 32, 3, 32, 64, 0
NGRAM, KERNEL = 3, 3
S = 9  # state slots
CPU = torch.device("cpu")
ATOL, RTOL = 2e-5, 1e-5


def hf_config(**overrides: object) -> transformers.Qwen4ExpTextConfig:
    fields = dict(
        vocab_size=VOCAB, hidden_size=H, hc_count=N, hc_lowrank=8, ple_embed_dim=E,
        ngram_size=NGRAM, heads_per_ngram=2, ngram_vocab_size_base=50,
        make_ngram_vocab_size_divisible_by=16, split_ngram_parts=1,
        ple_conv_kernel_size=KERNEL, eos_token_id=EOS, seed=1234, num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"], ple_layer_ids=[1, 2, 3],
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=8,
        shared_expert_intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8,
    )  # fmt: skip
    fields.update(overrides)
    return transformers.Qwen4ExpTextConfig(**fields)


def ours_for(cfg: transformers.Qwen4ExpTextConfig, ple_layer_index: int) -> PerLayerEmbedding:
    return PerLayerEmbedding(
        hidden_size=cfg.hidden_size, streams=cfg.hc_count, embed_dim=cfg.ple_embed_dim,
        vocab_size=cfg.vocab_size, ngram_size=cfg.ngram_size,
        heads_per_ngram=cfg.heads_per_ngram, ngram_vocab_size_base=cfg.ngram_vocab_size_base,
        make_ngram_vocab_size_divisible_by=cfg.make_ngram_vocab_size_divisible_by,
        seed=cfg.seed, ple_layer_index=ple_layer_index,
        conv_kernel_size=cfg.ple_conv_kernel_size, eos_token_id=cfg.eos_token_id,
        norm_eps=cfg.rms_norm_eps, ops=REF_OPS,
    )  # fmt: skip


def randomize(layer: torch.nn.Module, seed: int) -> None:
    """Weights N(0, 0.3^2); the zero-centred norm weights small."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.1 if name.startswith("norm_") else 0.3
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def hf_state(layer: Qwen4ExpTextPLELayer) -> dict[str, torch.Tensor]:
    """HF's state dict without the hash constants it saves (derived by the engine layer)."""
    return {k: v for k, v in layer.state_dict().items() if k not in CHECKPOINT_BUFFERS}


class Pair:
    """An HF PLE layer and the engine layer with its weights, over a state cache of S slots
    filled with garbage (a fresh sequence must not read it)."""

    def __init__(self, dtype: torch.dtype = torch.float32, ple_layer_index: int = 1) -> None:
        cfg = hf_config()
        self.hf = Qwen4ExpTextPLELayer(cfg, layer_idx=1, ple_layer_index=ple_layer_index)
        randomize(self.hf, 0)
        self.ours = ours_for(cfg, ple_layer_index)
        self.ours.load_state_dict(hf_state(self.hf), strict=True)
        self.hf.to(dtype)
        self.ours.to(dtype)
        self.ours.process_weights_after_loading()
        self.dtype = dtype
        self.cache = self.new_cache()

    def new_cache(self) -> StateCache:
        spec = self.ours.state_spec().resolve(self.dtype, None)
        cache = StateCache([spec], S, CPU)
        g = torch.Generator().manual_seed(7)
        state = cache.layer(0)
        state["tokens"].copy_(torch.randint(0, VOCAB, state["tokens"].shape, generator=g))
        state["conv"].copy_(torch.randn(state["conv"].shape, generator=g))
        self.ours.bind_state(state)
        return cache

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return self.ours.state

    def hf_forward(self, tokens: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """HF's uncached forward over one whole sequence: `(L,)`, `(L, N, H)` -> `(L, N, H)`."""
        with torch.no_grad():
            out = self.hf(streams.reshape(1, -1, N * H), tokens[None], cache=None)
        return out.view(-1, N, H)

    def step(self, layout: StepLayout, tokens: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        meta = build_mamba_metadata(layout, CPU)
        with torch.no_grad():
            return self.ours(streams, tokens, meta)


def layout(decodes: list[int], prefills: list[tuple[int, int, int]]) -> StepLayout:
    """`prefills`: `(slot, tokens, tokens computed before)` per chunk."""
    return StepLayout(
        decode_slots=decodes,
        prefill_lens=[n for _, n, _ in prefills],
        prefill_slots=[s for s, _, _ in prefills],
        prefill_context_lens=[c for _, _, c in prefills],
    )


def sequence(length: int, seed: int, eos_at: tuple[int, ...] = ()) -> tuple[torch.Tensor, ...]:
    """Token ids `(L,)` (EOS at `eos_at`, none elsewhere) and streams `(L, N, H)` float32."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (length,), generator=g)
    tokens[list(eos_at)] = EOS
    return tokens, torch.randn(length, N, H, generator=g)


def close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol)


def prefill_state(pair: Pair, tokens: torch.Tensor, streams: torch.Tensor, slot: int) -> None:
    """One whole prefill of a fresh sequence into `slot`."""
    pair.step(layout([], [(slot, len(tokens), 0)]), tokens, streams.to(pair.dtype))


EOS_AT = (0, 5, 6, 12, 16)  # the start, a pair, single ones, all inside the sequence


@pytest.mark.parametrize("ple_layer_index", [0, 1, 3])
def test_constants_and_names_match_transformers(ple_layer_index: int) -> None:
    """The multipliers, head vocabularies and offsets (from the layer's own prime search and
    splitmix64) and the table size equal transformers'; the parameters are HF's minus the
    saved constants, which `CHECKPOINT_BUFFERS` names and the engine does not persist."""
    for cfg in (hf_config(), hf_config(vocab_size=1000, seed=99, heads_per_ngram=4)):
        hf = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=ple_layer_index)
        ours = ours_for(cfg, ple_layer_index)
        hf_emb, emb = hf.ple_embedding, ours.ple_embedding
        for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
            assert torch.equal(getattr(emb, name), getattr(hf_emb, name)), name
            assert f"ple_embedding.{name}" in CHECKPOINT_BUFFERS
        ours_shapes = {k: v.shape for k, v in ours.state_dict().items()}
        assert ours_shapes == {k: v.shape for k, v in hf_state(hf).items()}
        assert set(hf.state_dict()) - set(ours.state_dict()) == set(CHECKPOINT_BUFFERS)


def test_meta_build_gets_constants_after_loading() -> None:
    """Built on the meta device and materialised uninitialised (as the loader does), the layer
    gets its hash constants back in `process_weights_after_loading`."""
    cfg = hf_config()
    with torch.device("meta"):
        ours = ours_for(cfg, 2)
    ours = to_empty(ours, CPU)
    ours.process_weights_after_loading()
    hf = Qwen4ExpTextPLELayer(cfg, layer_idx=0, ple_layer_index=2)
    for name in ("layer_multipliers", "ngram_heads_vocab_sizes", "ngram_heads_offsets"):
        assert torch.equal(getattr(ours.ple_embedding, name), getattr(hf.ple_embedding, name))


def test_state_spec() -> None:
    """`tokens (n - 1,)` int64 and `conv ((K - 1) n, N H)` in the model dtype, kind conv."""
    spec = ours_for(hf_config(), 0).state_spec().resolve(torch.bfloat16, torch.float32)
    tokens, conv = spec.tensors
    assert (tokens.name, tokens.shape, tokens.kind, tokens.dtype) == (
        "tokens", (NGRAM - 1,), "conv", torch.int64,
    )  # fmt: skip
    assert (conv.name, conv.shape, conv.kind, conv.dtype) == (
        "conv", ((KERNEL - 1) * NGRAM, N * H), "conv", torch.bfloat16,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype, atol, rtol", [(torch.float32, ATOL, RTOL), (torch.bfloat16, 3e-2, 2e-2)]
)
def test_whole_prefill_equals_transformers(dtype: torch.dtype, atol: float, rtol: float) -> None:
    """(a) One fresh prefill (over a slot holding garbage) equals HF's uncached forward."""
    pair = Pair(dtype)
    tokens, streams = sequence(23, 1, EOS_AT)
    streams = streams.to(dtype)
    out = pair.step(layout([], [(4, 23, 0)]), tokens, streams)
    assert out.shape == (23, N, H) and out.dtype == dtype
    close(out, pair.hf_forward(tokens, streams), atol, rtol)
    assert torch.equal(pair.state["tokens"][4], tokens[-(NGRAM - 1) :])


def capture_ids(embedding: torch.nn.Embedding) -> list[torch.Tensor]:
    """The id tensors every call of `embedding` looks up, in call order."""
    seen: list[torch.Tensor] = []
    embedding.register_forward_hook(lambda _m, args, _out: seen.append(args[0].reshape(-1)))
    return seen


def test_hashed_ids_equal_transformers() -> None:
    """The table rows looked up (the hashed n-gram ids, EOS cuts included) equal HF's bit for
    bit, for a whole prefill and for the same sequence in chunks and decodes."""
    pair = Pair()
    ours_ids = capture_ids(pair.ours.ple_embedding.ngram_embedding)
    hf_ids = capture_ids(pair.hf.ple_embedding.ngram_embedding)
    tokens, streams = sequence(23, 2, EOS_AT)
    pair.hf_forward(tokens, streams)
    pair.step(layout([], [(1, 23, 0)]), tokens, streams)
    assert torch.equal(ours_ids[0], hf_ids[0])
    ours_ids.clear()
    for lo, hi in ((0, 1), (1, 6), (6, 7), (7, 20)):
        pair.step(layout([], [(3, hi - lo, lo)]), tokens[lo:hi], streams[lo:hi])
    for t in range(20, 23):
        pair.step(layout([3], []), tokens[t : t + 1], streams[t : t + 1])
    assert torch.equal(torch.cat(ours_ids), hf_ids[0])
    sizes = pair.hf.ple_embedding.ngram_heads_vocab_sizes
    assert int(hf_ids[0].unique().numel()) < hf_ids[0].numel()  # collisions exercised
    assert int(sizes.max()) < 100


@pytest.mark.parametrize("cuts", [(1, 2, 6, 7, 13), (4, 17), (2,)])
def test_chunked_prefill_then_decodes_equal_whole(cuts: tuple[int, ...]) -> None:
    """(b) Chunks at the cuts, then one decode per token to the end, equal one whole prefill
    (and HF's forward); the state after them equals the whole prefill's."""
    pair = Pair()
    tokens, streams = sequence(23, 3, EOS_AT)
    whole = pair.step(layout([], [(2, 23, 0)]), tokens, streams)
    whole_tokens, whole_conv = pair.state["tokens"][2].clone(), pair.state["conv"][2].clone()
    close(whole, pair.hf_forward(tokens, streams))

    bounds = [0, *cuts, 20]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        outs.append(pair.step(layout([], [(5, hi - lo, lo)]), tokens[lo:hi], streams[lo:hi]))
    for t in range(20, 23):
        outs.append(pair.step(layout([5], []), tokens[t : t + 1], streams[t : t + 1]))
    close(torch.cat(outs), whole)
    assert torch.equal(pair.state["tokens"][5], whole_tokens)
    close(pair.state["conv"][5], whole_conv)


def test_mixed_step_equals_each_alone() -> None:
    """(c) One step of two decode rows, a padding row, a continued chunk, a fresh chunk and a
    padding chunk: every real row equals HF's forward over its whole sequence; the slots
    advance as each sequence alone; idle slots and padding touch nothing."""
    pair = Pair()
    seqs = {  # slot -> (tokens, streams, tokens before this step)
        2: (*sequence(12, 10, (3, 11)), 11),  # decodes its 12th token (an EOS)
        0: (*sequence(5, 11, (1,)), 4),  # decodes its 5th
        1: (*sequence(13, 12, (0, 4, 5)), 3),  # a chunk of 10 after 3
        3: (*sequence(6, 13, (5,)), 0),  # fresh, 6 tokens
    }
    for slot, (tok, st, before) in seqs.items():
        if before:
            prefill_state(pair, tok[:before], st[:before], slot)
    saved = {k: v.clone() for k, v in pair.state.items()}
    pad_tokens, pad_streams = sequence(4, 14)
    # (slot, first, end) of the rows of each decode row and chunk, in step order
    rows = [(2, 11, 12), (0, 4, 5), (PAD_SLOT_ID, 0, 1), (1, 3, 13), (3, 0, 6),
            (PAD_SLOT_ID, 0, 3)]  # fmt: skip
    tokens, streams = [], []
    for slot, lo, hi in rows:
        tok, st = (pad_tokens, pad_streams) if slot == PAD_SLOT_ID else seqs[slot][:2]
        tokens.append(tok[lo:hi])
        streams.append(st[lo:hi])
    lay = layout([2, 0, PAD_SLOT_ID], [(1, 10, 3), (3, 6, 0), (PAD_SLOT_ID, 3, 0)])
    out = pair.step(lay, torch.cat(tokens), torch.cat(streams))
    assert out.shape == (1 + 1 + 1 + 10 + 6 + 3, N, H)
    starts = [0, 1, 2, 3, 13, 19]
    for (slot, lo, hi), start in zip(rows, starts):
        if slot == PAD_SLOT_ID:
            continue
        tok, st, _ = seqs[slot]
        ref = pair.hf_forward(tok, st)[lo:hi]
        close(out[start : start + hi - lo], ref)
        assert torch.equal(pair.state["tokens"][slot], tok[-(NGRAM - 1) :])
    for name, tensor in pair.state.items():
        for slot in (4, 5, 6, 7, 8):
            assert torch.equal(tensor[slot], saved[name][slot]), (name, slot)
    # The continued and fresh chunks' histories equal those of their sequences prefilled alone.
    alone = Pair()
    for slot in (1, 3):
        tok, st, _ = seqs[slot]
        prefill_state(alone, tok, st, slot)
        close(pair.state["conv"][slot], alone.state["conv"][slot])


CHAINS = {0: [0, 3, 5], 1: [1, 4], 2: [2]}  # sequence slot -> its decode rows, in order
SPEC_PREFILLS = [(3, 4, 7), (7, 3, 0), (PAD_SLOT_ID, 2, 0)]  # slot, tokens, computed before


def spec_layout() -> StepLayout:
    """Two speculative chains (3 and 2 positions, spare slots 4, 5 and 6), a plain decode, a
    chunk that continues slot 3, a fresh chunk on slot 7 and a padding chunk; slot 8 idle."""
    lay = layout([0, 1, 2, 0, 1, 0], SPEC_PREFILLS)
    lay.decode_waves = [3, 2, 1]
    lay.decode_chain_src = [0, 1, 2, 4, 6, 5]
    lay.decode_chain_dst = [4, 6, 2, 5, 1, 0]
    return lay


def test_speculative_waves_equal_one_by_one() -> None:
    """(d) Decode rows in speculative waves: each chain position's output equals HF's at that
    position, and the state it leaves in its `decode_chain_dst` slot (a spare slot, the
    sequence's own for the last position) equals a prefill of the sequence up to it; the
    prefill chunks of the same step are right too; the idle slot is untouched."""
    pair = Pair()
    prefix = {0: 6, 1: 2, 2: 9, 3: 7}  # tokens each sequence computed before the step
    eos = {0: (2, 7), 1: (1,), 2: (8,), 3: (0, 6), 7: (1,)}
    seqs = {slot: sequence(12, 20 + slot, eos.get(slot, ())) for slot in (0, 1, 2, 3, 7)}
    for slot, before in prefix.items():
        prefill_state(pair, seqs[slot][0][:before], seqs[slot][1][:before], slot)
    saved = {k: v.clone() for k, v in pair.state.items()}

    lay = spec_layout()
    meta = build_mamba_metadata(lay, CPU)
    row_pos = {}  # decode row -> (slot, position in its sequence)
    for slot, rows in CHAINS.items():
        for w, r in enumerate(rows):
            row_pos[r] = (slot, prefix[slot] + w)
    tokens = [seqs[row_pos[r][0]][0][row_pos[r][1]][None] for r in range(6)]
    streams = [seqs[row_pos[r][0]][1][row_pos[r][1]][None] for r in range(6)]
    for slot, n, before in SPEC_PREFILLS:
        tok, st = seqs[slot] if slot != PAD_SLOT_ID else sequence(n, 30)
        tokens.append(tok[before : before + n])
        streams.append(st[before : before + n])
    with torch.no_grad():
        out = pair.ours(torch.cat(streams), torch.cat(tokens), meta)
    assert out.shape == (6 + 4 + 3 + 2, N, H)

    dst = meta.decode_chain_dst.tolist()
    for r, (slot, p) in row_pos.items():
        tok, st = seqs[slot]
        close(out[r], pair.hf_forward(tok[: p + 1], st[: p + 1])[p])
        ref = Pair()
        prefill_state(ref, tok[: p + 1], st[: p + 1], 0)
        assert torch.equal(pair.state["tokens"][dst[r]], ref.state["tokens"][0]), r
        close(pair.state["conv"][dst[r]], ref.state["conv"][0])
    start = 6
    for slot, n, before in SPEC_PREFILLS:
        if slot != PAD_SLOT_ID:
            tok, st = seqs[slot]
            ref = pair.hf_forward(tok[: before + n], st[: before + n])[before:]
            close(out[start : start + n], ref)
        start += n
    for name, tensor in pair.state.items():
        assert torch.equal(tensor[8], saved[name][8]), name


def test_padding_rows_beside_written_slots() -> None:
    """Padding decode rows neither read nor write (the sync-free write sends them to a slot
    nobody writes, with its own value), even when every other slot is written; an
    all-padding step (a CUDA-graph capture) changes nothing."""
    pair = Pair()
    seqs = {slot: sequence(5, 40 + slot, (2,) if slot == 0 else ()) for slot in range(S)}
    for slot, (tok, st) in seqs.items():
        prefill_state(pair, tok[:4], st[:4], slot)
    saved = {k: v.clone() for k, v in pair.state.items()}

    written = list(range(S - 1))  # every slot but the last
    slots = [PAD_SLOT_ID, *written[:4], PAD_SLOT_ID, *written[4:], PAD_SLOT_ID]
    tok = torch.cat([seqs[s][0][4:5] if s != PAD_SLOT_ID else torch.tensor([EOS]) for s in slots])
    st = torch.cat([seqs[s][1][4:5] if s != PAD_SLOT_ID else torch.ones(1, N, H) for s in slots])
    out = pair.step(layout(slots, []), tok, st)
    for r, slot in enumerate(slots):
        if slot == PAD_SLOT_ID:
            continue
        close(out[r], pair.hf_forward(*seqs[slot])[4])
        assert torch.equal(pair.state["tokens"][slot], seqs[slot][0][3:5])
    for name, tensor in pair.state.items():
        assert torch.equal(tensor[S - 1], saved[name][S - 1]), name

    saved = {k: v.clone() for k, v in pair.state.items()}
    pads = [PAD_SLOT_ID] * 4
    out = pair.step(layout(pads, []), torch.zeros(4, dtype=torch.long), torch.ones(4, N, H))
    assert out.shape == (4, N, H)
    for name, tensor in pair.state.items():
        assert torch.equal(tensor, saved[name]), name
