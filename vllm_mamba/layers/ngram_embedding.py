"""`PerLayerEmbedding`: Qwen4-Exp's Per-Layer n-gram Embedding (PLE), a stateful layer that adds
hashed n-gram features of the token ids to every hyper-connection stream (transformers'
`Qwen4ExpTextPLELayer` with its `Qwen4ExpTextNGramEmbedding`).

Per token `t` with raw ids `x_t` and streams `h_t (N, H)`:

    w_s = x_{t-s} unless an EOS is among x_{t-s} .. x_{t-1}, else EOS     s = 0 .. n - 1
    m_g = XOR_{p < g} (w_p * mult[p])          int64, wrapping          g = 2 .. n
    id_{g,j} = m_g mod vocab[g, j] + offset[g, j]                       j = 0 .. J - 1
    e = concat_{g, j} table[id_{g,j}]                                   (E,)
    k = rms_H(key_proj(e)) ;  q = rms_H(h_t) ;  v = value_proj(e)       (N, H), (N, H), (H,)
    a = <k_i, q_i> / sqrt(H) ;  a = sign(a) sqrt(max(|a|, 1e-6))        (N,)
    g_t = sigmoid(a)[:, None] * v                                       (N, H)
    u_t = rms_H(g_t)                                                    (N H,)
    out_t = g_t + silu(sum_k conv[:, k] * u_{t - (K - 1 - k) n})        (N, H)

The layer returns `out (T, N, H)`; the caller adds it to the streams. `rms_H` is the
zero-centred RMS norm over each group of H channels (`x / rms(x) * (1 + weight)`, in float32,
cast back to the input's dtype): `norm_key`, `norm_query`, `norm_conv`, one `(N H,)` weight
each. The conv is depthwise over the N H channels, K taps dilated by n, no bias. The rest
runs in the model dtype in transformers' order (the conv sums its taps in float32).

Hash constants, as transformers derives them (no checkpoint tensor): `mult (n,)` odd int64
multipliers from splitmix64 of `seed + 10007 ple_layer_index`, each below `2^63 / vocab_size`;
the `G = (n - 1) J` head vocabularies are the consecutive primes from `ngram_vocab_size_base`
on, this PLE layer taking the `(ple_layer_index G + i)`-th for its head `i`; `offset` their
running sums. The table has `ceil(sum(vocab) / divisor) divisor` rows of `E / G`. They live in
non-persistent buffers (`ple_embedding.layer_multipliers`, `ngram_heads_vocab_sizes`,
`ngram_heads_offsets`), filled at construction and again by `process_weights_after_loading`
(a model built on the meta device and materialised uninitialised gets them back there).
transformers saves them in its checkpoints: `CHECKPOINT_BUFFERS` names them for the loader
to skip.

Per-sequence state (`state_spec`): `tokens (n - 1,)` int64, the last n - 1 raw ids, oldest
first, and `conv ((K - 1) n, N H)`, the last (K - 1) n conv inputs `u`, oldest first (model
dtype); both kind `conv`. A fresh sequence starts from EOS ids and zero inputs, as
transformers' uncached forward does. The recurrence runs through `recurrent_step`: decode rows
(one token each, in speculative waves) and prefill chunks share one vectorised pass over
segments (each row's look-backs gathered from its own segment or the slot's saved history); a
padding row (`PAD_SLOT_ID`) reads a fresh history and writes nothing, with no host sync (a
decode step can be captured in a CUDA graph).

Checkpoint names (under `...ple.`): `ple_embedding.ngram_embedding.weight (V, E / G)`,
`key_proj.weight (N H, E)`, `value_proj.weight (H, E)`, `norm_key.weight`,
`norm_query.weight`, `norm_conv.weight (N H,)`, `conv1d.weight (N H, 1, K)`. Replicated under
tensor parallelism (the streams are whole on every rank).

Glossary: T tokens in the step, N streams (`hc_count`), H hidden size, E embedding width
(`ple_embed_dim`), n n-gram size (also the conv's dilation), J heads per n-gram order
(`heads_per_ngram`), G = (n - 1) J hash heads, V table rows, K conv taps
(`ple_conv_kernel_size`), R = (K - 1) n conv history, C = N H channels, S state slots, B
segments (sequences) in a pass, L rows in a pass.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.mamba_metadata import MambaMetadata
from vllm_mamba.cache_specs import PAD_SLOT_ID, StateSpec, StateTensor
from vllm_mamba.layers.cache_layers import StatefulLayer
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mixer_base import Conv1dWeights
from vllm_mamba.layers.recurrent_step import recurrent_step
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops.table import MambaOps

__all__ = ["CHECKPOINT_BUFFERS", "NGramHashEmbedding", "PerLayerEmbedding"]

# transformers' saved hash constants (derived here, not loaded): names under `...ple.`.
CHECKPOINT_BUFFERS = (
    "ple_embedding.layer_multipliers",
    "ple_embedding.ngram_heads_vocab_sizes",
    "ple_embedding.ngram_heads_offsets",
)

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_LAYER_SEED_STRIDE = 10007  # the seed of PLE layer i: seed + 10007 i


def _splitmix64(value: int) -> int:
    """One splitmix64 output for state `value` (unsigned 64-bit arithmetic on Python ints)."""
    value = (value + _GAMMA) & _MASK64
    value = ((value ^ (value >> 30)) * _MIX1) & _MASK64
    value = ((value ^ (value >> 27)) * _MIX2) & _MASK64
    return value ^ (value >> 31)


def hash_multipliers(
    vocab_size: int, ngram_size: int, ple_layer_index: int, seed: int
) -> list[int]:
    """The `n` odd multipliers of one PLE layer, each below `(2^63 - 1) / vocab_size` (so a
    token id times one fits an int64)."""
    bound = max(1, ((1 << 63) - 1) // max(vocab_size, 1) // 2)
    base = seed + _LAYER_SEED_STRIDE * ple_layer_index
    return [
        2 * (_splitmix64((base + _GAMMA * (p + 1)) & _MASK64) % bound) + 1
        for p in range(ngram_size)
    ]


def _is_prime(value: int) -> bool:
    if value < 2:
        return False
    if value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def head_vocab_sizes(base: int, heads: int, ple_layer_index: int) -> list[int]:
    """The vocabularies of one PLE layer's `heads` hash heads: the consecutive primes from
    `base` on, layer `i` taking the `i heads`-th to the `(i + 1) heads - 1`-th."""
    primes, candidate = [], base
    while len(primes) < (ple_layer_index + 1) * heads:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes[ple_layer_index * heads :]


class GroupedZeroCenteredRMSNorm(nn.Module):
    """`x / rms(x) * (1 + weight)` over each group of `group_size` channels of the last
    dimension, in float32, cast back to x's dtype (transformers' `Qwen4ExpTextRMSNorm` with a
    `group_size`)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        if dim % group_size:
            raise ValueError(f"dim ({dim}) must be divisible by group_size ({group_size})")
        self.weight = nn.Parameter(torch.zeros(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x (..., dim)` -> `(..., dim)` in x's dtype."""
        xf = x.float().unflatten(-1, (-1, self.group_size))  # (..., dim / group, group)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf.flatten(-2) * (1.0 + self.weight.float())).to(x.dtype)


class NGramHashEmbedding(nn.Module):
    """The hashed n-gram table and its constants (transformers' `Qwen4ExpTextNGramEmbedding`,
    without its cache handling: the window of look-backs comes from `PerLayerEmbedding`)."""

    def __init__(
        self,
        embed_dim: int,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        ngram_vocab_size_base: int,
        divisible_by: int,
        seed: int,
        ple_layer_index: int,
        eos_token_id: int,
    ) -> None:
        super().__init__()
        heads = (ngram_size - 1) * heads_per_ngram  # G
        if ngram_size < 2 or heads_per_ngram < 1 or embed_dim % heads:
            raise ValueError(
                f"ngram_size ({ngram_size}) must be >= 2 and ple_embed_dim ({embed_dim}) a "
                f"multiple of the (ngram_size - 1) * heads_per_ngram = {heads} hash heads"
            )
        self.ngram_size, self.heads_per_ngram, self.eos_token_id = (
            ngram_size, heads_per_ngram, eos_token_id,
        )  # fmt: skip
        self._multipliers = hash_multipliers(vocab_size, ngram_size, ple_layer_index, seed)
        self._vocab_sizes = head_vocab_sizes(ngram_vocab_size_base, heads, ple_layer_index)
        self._offsets = [sum(self._vocab_sizes[:i]) for i in range(heads)]
        rows = math.ceil(sum(self._vocab_sizes) / divisible_by) * divisible_by  # V
        self.ngram_embedding = nn.Embedding(rows, embed_dim // heads)
        for name, values in self._constants().items():
            self.register_buffer(name, torch.tensor(values, dtype=torch.long), persistent=False)

    def _constants(self) -> dict[str, list[int]]:
        return {
            "layer_multipliers": self._multipliers,  # (n,)
            "ngram_heads_vocab_sizes": self._vocab_sizes,  # (G,)
            "ngram_heads_offsets": self._offsets,  # (G,)
        }

    def refill_constants(self) -> None:
        """Writes the hash constants into their buffers on the table's device (after the
        module was materialised from the meta device with uninitialised buffers)."""
        device = self.ngram_embedding.weight.device
        for name, values in self._constants().items():
            setattr(self, name, torch.tensor(values, dtype=torch.long, device=device))

    def forward(self, window: torch.Tensor) -> torch.Tensor:
        """`window (L, n)` int64, each row's raw ids `[x_t, x_{t-1}, .., x_{t-n+1}]` -> the
        concatenated head embeddings `(L, E)` in the table's dtype."""
        eos = self.eos_token_id
        back = window[:, 1:]  # (L, n - 1): x_{t-1} ..
        seen = torch.cumsum((back == eos).int(), dim=1) > 0  # an EOS within s back
        w = torch.cat([window[:, :1], torch.where(seen, eos, back)], dim=1)  # (L, n)
        prod = w * self.layer_multipliers  # (L, n) int64, wrapping
        mixed = [prod[:, 0]]
        for p in range(1, self.ngram_size):
            mixed.append(torch.bitwise_xor(mixed[-1], prod[:, p]))
        m = torch.stack(mixed[1:], dim=1)  # (L, n - 1): orders 2 .. n
        shape = (1, self.ngram_size - 1, self.heads_per_ngram)
        ids = torch.remainder(m[:, :, None], self.ngram_heads_vocab_sizes.view(shape))
        ids = ids + self.ngram_heads_offsets.view(shape)  # (L, n - 1, J)
        return self.ngram_embedding(ids.flatten(1)).flatten(1)  # (L, G, E / G) -> (L, E)


def _look_back(
    values: torch.Tensor, prior: torch.Tensor, seg: torch.Tensor, pos: torch.Tensor, d: int
) -> torch.Tensor:
    """Each row's value `d` rows back within its segment, or from its segment's saved history
    where the segment is shorter.

    Args:
        values: `(L, *F)` the rows, segments back to back.
        prior: `(B, P, *F)` each segment's history before its first row, oldest first
            (`1 <= d <= P`).
        seg: `(L,)` int64 each row's segment; pos: `(L,)` int64 its index in the segment.

    Returns:
        `(L, *F)`.
    """
    rows = torch.arange(values.shape[0], device=values.device)
    own = values[(rows - d).clamp(min=0)]
    saved = prior[seg, (prior.shape[1] - d + pos).clamp(max=prior.shape[1] - 1)]
    inside = (pos >= d).view(-1, *[1] * (values.dim() - 1))
    return torch.where(inside, own, saved)


def _tails(
    values: torch.Tensor, prior: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Each segment's last P rows of `[prior | its rows]`, oldest first.

    Args:
        values: `(L, *F)`; prior: `(B, P, *F)`; starts, lens: `(B,)` int64 segment bounds.

    Returns:
        `(B, P, *F)` in prior's dtype.
    """
    n_seg, width = prior.shape[:2]
    if values.shape[0] == 0:
        return prior
    local = lens[:, None] - width + torch.arange(width, device=lens.device)  # (B, P)
    own = values[(starts[:, None] + local).clamp(0, values.shape[0] - 1)].to(prior.dtype)
    seg = torch.arange(n_seg, device=prior.device)[:, None]
    saved = prior[seg, (width + local).clamp(max=width - 1)]
    inside = (local >= 0).view(n_seg, width, *[1] * (prior.dim() - 2))
    return torch.where(inside, own, saved)


def _write_slots(
    state: torch.Tensor, slots: torch.Tensor, write: torch.Tensor, new: torch.Tensor
) -> None:
    """`state[slots[b]] = new[b]` where `write[b]`, without a host sync: the other rows write
    back the unchanged value of a slot no written row targets (there is one while the rows
    written are fewer than the slots, which holds when any row is not written)."""
    counts = torch.zeros(state.shape[0], dtype=torch.int32, device=state.device)
    counts.index_add_(0, slots, write.int())
    spare = torch.argmin(counts)  # a slot no written row targets
    target = torch.where(write, slots, spare)  # (B,)
    keep = write.view(-1, *[1] * (new.dim() - 1))
    state[target] = torch.where(keep, new.to(state.dtype), state[target])


class PerLayerEmbedding(StatefulLayer):
    """Qwen4-Exp's PLE layer: `(T, N, H)` streams and `(T,)` token ids -> the `(T, N, H)` to add
    to the streams (see the module docstring)."""

    def __init__(
        self,
        hidden_size: int,
        streams: int,
        embed_dim: int,
        vocab_size: int,
        ngram_size: int,
        heads_per_ngram: int,
        ngram_vocab_size_base: int,
        make_ngram_vocab_size_divisible_by: int,
        seed: int,
        ple_layer_index: int,
        conv_kernel_size: int,
        eos_token_id: int,
        norm_eps: float,
        ops: MambaOps,
    ) -> None:
        """Args: `hidden_size` H; `streams` N (`hc_count`); `embed_dim` E (`ple_embed_dim`);
        `vocab_size` the token vocabulary (bounds the multipliers); `ngram_size` n;
        `heads_per_ngram` J; `ngram_vocab_size_base` where the head primes start;
        `make_ngram_vocab_size_divisible_by` the table's row padding; `seed` the hash seed;
        `ple_layer_index` this layer's index among the PLE layers (0-based); `conv_kernel_size`
        K (`ple_conv_kernel_size`); `eos_token_id` the id that cuts n-grams; `norm_eps`
        (`rms_norm_eps`); `ops` the ops table (its `linear` runs the projections)."""
        super().__init__()
        if conv_kernel_size < 1:
            raise ValueError(f"ple_conv_kernel_size must be >= 1, got {conv_kernel_size}")
        self.hidden_size, self.streams = hidden_size, streams
        self.ngram_size, self.kernel, self.eos_token_id = ngram_size, conv_kernel_size, eos_token_id
        self.history = (conv_kernel_size - 1) * ngram_size  # R
        channels = streams * hidden_size  # C
        self.ple_embedding = NGramHashEmbedding(
            embed_dim, vocab_size, ngram_size, heads_per_ngram, ngram_vocab_size_base,
            make_ngram_vocab_size_divisible_by, seed, ple_layer_index, eos_token_id,
        )  # fmt: skip
        self.key_proj = Linear(embed_dim, channels, False, ops)
        self.value_proj = Linear(embed_dim, hidden_size, False, ops)
        self.norm_key = GroupedZeroCenteredRMSNorm(channels, hidden_size, norm_eps)
        self.norm_query = GroupedZeroCenteredRMSNorm(channels, hidden_size, norm_eps)
        self.norm_conv = GroupedZeroCenteredRMSNorm(channels, hidden_size, norm_eps)
        # `conv1d.weight (C, 1, K)`: depthwise, dilated by n, no bias
        self.conv1d = Conv1dWeights(channels, conv_kernel_size, bias=False)

    def process_weights_after_loading(self) -> None:
        """Writes the hash constants (derived, not loaded) on the weights' device."""
        self.ple_embedding.refill_constants()

    def state_spec(self) -> StateSpec:
        """`tokens (n - 1,)` int64 (the last raw ids) and `conv (R, C)` (the last conv inputs,
        the model dtype), both kind `conv`, oldest first."""
        return StateSpec(
            (
                StateTensor("tokens", (self.ngram_size - 1,), "conv", torch.int64),
                StateTensor("conv", (self.history, self.streams * self.hidden_size), "conv"),
            )
        )

    def forward(
        self, streams: torch.Tensor, token_ids: torch.Tensor, meta: MambaMetadata
    ) -> torch.Tensor:
        """`streams (T, N, H)` and `token_ids (T,)` -> `(T, N, H)` in the streams' dtype (to
        add to the streams), advancing `tokens` and `conv` in place."""
        token_ids = token_ids.long()
        states = [self.state["tokens"], self.state["conv"]]

        def decode(rows: slice, slots: torch.Tensor) -> torch.Tensor:
            tok = token_ids[rows]  # (D,)
            every = torch.arange(tok.shape[0], device=tok.device)
            ones = torch.ones_like(every)
            return self._segments(
                streams[rows], tok, every, every * 0, every, ones, slots, None
            )  # one segment per row

        def prefill(rows: slice) -> torch.Tensor:
            tok = token_ids[rows]  # (L,)
            qsl = meta.prefill_query_start_loc.long()  # (B + 1,)
            starts, lens = qsl[:-1], qsl[1:] - qsl[:-1]
            seg = torch.repeat_interleave(
                torch.arange(starts.shape[0], device=tok.device), lens, output_size=tok.shape[0]
            )  # (L,)
            pos = torch.arange(tok.shape[0], device=tok.device) - starts[seg]
            return self._segments(
                streams[rows], tok, seg, pos, starts, lens, meta.prefill_state_indices,
                meta.prefill_has_initial_state,
            )  # fmt: skip

        return recurrent_step(meta, states, decode, prefill)

    def _segments(
        self,
        streams: torch.Tensor,
        tok: torch.Tensor,
        seg: torch.Tensor,
        pos: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        slots: torch.Tensor,
        initial: torch.Tensor | None,
    ) -> torch.Tensor:
        """One pass over B segments of rows back to back, each continuing its slot's state.

        Args:
            streams: `(L, N, H)`; tok: `(L,)` int64.
            seg, pos: `(L,)` int64 each row's segment and index in it.
            starts, lens: `(B,)` int64 the segments' first row and length.
            slots: `(B,)` int each segment's slot, `PAD_SLOT_ID` for padding (not read, not
                written).
            initial: `(B,)` bool whether the slot holds earlier tokens (None: all do).

        Returns:
            `(L, N, H)` in the streams' dtype; the slots' states advanced in place.
        """
        tokens, history = self.state["tokens"], self.state["conv"]  # (S, n - 1), (S, R, C)
        n, rows = self.ngram_size, tok.shape[0]
        valid = slots != PAD_SLOT_ID  # (B,)
        idx = slots.long().clamp(min=0)
        read = valid if initial is None else valid & initial.bool()
        ctx = torch.where(read[:, None], tokens[idx], self.eos_token_id)  # (B, n - 1)
        prior = torch.where(read[:, None, None], history[idx], 0)  # (B, R, C)

        window = torch.stack(
            [tok] + [_look_back(tok, ctx, seg, pos, s) for s in range(1, n)], dim=1
        )  # (L, n)
        emb = self.ple_embedding(window)  # (L, E)
        shape = (rows, self.streams, self.hidden_size)
        key = self.norm_key(self.key_proj(emb)).view(shape)  # (L, N, H)
        value = self.value_proj(emb)  # (L, H)
        query = self.norm_query(streams.reshape(rows, -1)).view(shape)  # (L, N, H)
        gate = (key * query).sum(dim=-1, keepdim=True) / math.sqrt(self.hidden_size)  # (L, N, 1)
        gate = gate.abs().clamp_min(1e-6).sqrt() * gate.sign()
        gate = rowwise(torch.sigmoid, gate.view(rows, -1)).view(gate.shape)  # each row as alone
        gated = gate * value.unsqueeze(-2)  # (L, N, H)
        u = self.norm_conv(gated.flatten(-2))  # (L, C)

        weight = self.conv1d.weight.float()  # (C, 1, K)
        acc = u.float() * weight[:, 0, -1]  # tap K - 1: this row
        for k in range(self.kernel - 1):
            back = (self.kernel - 1 - k) * n
            acc = acc + _look_back(u, prior, seg, pos, back).float() * weight[:, 0, k]
        out = gated + rowwise(F.silu, acc.to(u.dtype)).view(shape)  # (L, N, H)

        write = valid & (lens > 0)  # (B,)
        _write_slots(tokens, idx, write, _tails(tok, ctx, starts, lens))
        _write_slots(history, idx, write, _tails(u, prior, starts, lens))
        return out
