"""`MLAAttention`: Multi-head Latent Attention (DeepSeek-V2/V3, Kimi Linear's full-attention
layers) over a paged LATENT cache.

Per token, with transformers' names (so checkpoints load as an identity mapping):

    q = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))       (Hq, Dn + Dr)
    [c | k_rot] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)    (R), (Dr) shared by all heads
    kv_b_proj(c) = [k_nope (Dn) | v (Dv)] per head;  keys [k_nope | k_rot]
    out = o_proj(causal softmax(scale q . k) v),  scale = (Dn + Dr) ** -0.5
    (Ling 3: out per head times sigmoid(g_proj(x)) before o_proj, `head_gate`)

Kimi applies no rotary embedding; DeepSeek rotates `q_rot` and `k_rot` (the `rotary` module,
called as `rotary(positions, q_rot (T, Hq * Dr), k_rot (T, Dr), meta)`) before the latent is
cached.

What the engine caches per token is the latent `[c | k_rot]` only (`MLASpec(R + Dr)`, one
row shared by the heads), not per-head keys and values. Decode runs in the ABSORBED form
(see `vllm_mamba.ops.mla_attention`): with `W_UK (Hq, Dn, R)` and `W_UV (Hq, Dv, R)` the
per-head halves of `kv_b_proj`, the query `[q_nope @ W_UK | q_rot]` scores the latents directly,
the attention returns `sum_t p_t c_t (Hq, R)` and `W_UV` maps it to the values; a bias of
`kv_b_proj` adds the same term to every score of a query (dropped: softmax is shift invariant)
and its value half is added to the output.

Decode rows always run absorbed (`decode_attention`): one query per row, memory bound, and the
latent is read once for all heads. Prefill chunks run EXPANDED by default: each sequence's
cached latents are gathered, `kv_b_proj` expands them to per-head keys `[k_nope | k_rot]` and
values, and `F.scaled_dot_product_attention` runs causal attention with the chunk's queries
at their absolute positions (so chunked prefill equals whole prefill). Chosen by measurement:
on the CPU (2 shared cores, float32, 16 heads of Kimi's head shape R 512, Dr 64, Dn 128,
Dv 128; absorption, attention and `W_UV` against gather, expansion and SDPA), absorbed with
the C++ `prefill_attention` against expanded took 3.6 / 2.9 ms for a 64-token prompt,
21.7 / 14.3 ms for a 256-token prompt, 78.9 / 53.4 ms for a 256-token chunk after 768 cached
tokens and 145.9 / 124.8 ms after 1792 (best of 3; the machine was loaded, one earlier run
even had the 256-token prompt the other way round, 49.9 / 91.9 ms). Per query-key pair
expanded does `Dn + Dr + Dv` = 320 multiply-adds against `L + R` = 1088 absorbed, and its
work runs in GEMM and SDPA kernels; the expansion of the context (`S R Hq (Dn + Dv)`) is paid
once per chunk. vLLM makes the same choice (expanded prefill, absorbed decode). The cost is
a float32 `(S, Hq, Dn + Dr + Dv)` copy of a sequence's context: a sequence whose copy would
exceed `expand_max_bytes` (`EXPAND_MAX_BYTES`, 256 MiB) runs absorbed instead, through the
same family's `prefill_attention` (`prefill_form="absorbed"` forces that for all).

Tensor parallelism: the heads are split over the ranks (`q_proj` / `q_b_proj` and `kv_b_proj`
column-parallel by head, `o_proj` row-parallel); `q_a_proj`, `kv_a_proj_with_mqa` and their norms
are replicated, so every rank caches the same latents.

Glossary: T tokens in the step, H hidden size, Hq query heads (this rank's), R kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim, L = R + Dr the latent dim.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.cache_specs import KVSpec, MLASpec
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import KVCacheLayer, LatentKV
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.layers.rowwise import rowwise
from vllm_mamba.ops import mla_attention as mla_ops
from vllm_mamba.ops.table import MambaOps

EXPAND_MAX_BYTES = 256 * 2**20  # a longer sequence's prefill runs absorbed (no expanded copy)


SMALL_ROWS = 8  # rows up to which the absorbed products run row by row (`_per_row`)


class MLAAttention(KVCacheLayer):
    """One MLA layer: its projections, norms and its attention over the latent cache."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float,
        ops: MambaOps,
        tp: TensorParallel = SINGLE,
        *,
        bias: bool = False,
        rotary: nn.Module | None = None,
        scale: float | None = None,
        prefill_form: str = "expanded",
        head_gate: bool = False,
    ) -> None:
        """Builds the layer (this rank's heads).

        Args:
            hidden_size: H.
            num_heads: all ranks' query heads.
            q_lora_rank: the rank of the low-rank query (`q_a_proj`, `q_a_layernorm`,
                `q_b_proj`), or None for a plain `q_proj`.
            kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim: R, Dn, Dr, Dv.
            norm_eps: epsilon of `q_a_layernorm` and `kv_a_layernorm` (Kimi: 1e-6).
            ops: the ops table.
            tp: this rank's tensor-parallel place.
            bias: biases of `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj` (`attention_bias`).
            rotary: rotates `(positions, q_rot (T, Hq * Dr), k_rot (T, Dr))`, or None (Kimi).
            scale: the softmax scale; default `(Dn + Dr) ** -0.5`.
            prefill_form: "expanded" (the default, see the module docstring) or "absorbed".
            head_gate: a sigmoid gate per head on the attention's output, `g_proj (Hq, H)`
                (Ling 3's MLA), split by head over the ranks.

        Raises:
            ValueError: the heads do not divide over the ranks.
        """
        super().__init__()
        self.num_heads = tp.split(num_heads, "num_attention_heads")  # this rank's
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.latent_dim = kv_lora_rank + qk_rope_head_dim
        self.q_lora_rank = q_lora_rank
        self.scale = scale if scale is not None else (qk_nope_head_dim + qk_rope_head_dim) ** -0.5
        qk_head = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = column_linear(hidden_size, [num_heads * qk_head], False, ops, tp)
        else:
            self.q_a_proj = column_linear(hidden_size, [q_lora_rank], bias, ops, SINGLE)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = column_linear(q_lora_rank, [num_heads * qk_head], False, ops, tp)
        self.kv_a_proj_with_mqa = column_linear(hidden_size, [self.latent_dim], bias, ops, SINGLE)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        kv_b_out = num_heads * (qk_nope_head_dim + v_head_dim)
        self.kv_b_proj = column_linear(kv_lora_rank, [kv_b_out], False, ops, tp)
        self.o_proj = row_linear(num_heads * v_head_dim, hidden_size, bias, ops, tp)
        self.g_proj = column_linear(hidden_size, [num_heads], False, ops, tp) if head_gate else None
        self.rotary = rotary
        self.mla = ops.family(mla_ops.FAMILY)
        if prefill_form not in ("expanded", "absorbed"):
            raise ValueError(f"prefill_form must be 'expanded' or 'absorbed', got {prefill_form!r}")
        self.prefill_form = prefill_form
        self.expand_max_bytes = EXPAND_MAX_BYTES
        # Derived from kv_b_proj (float32, not parameters): see process_weights_after_loading.
        self.w_kv: torch.Tensor | None = None  # (Hq * (Dn + Dv), R), kv_b_proj's weight
        self.b_kv: torch.Tensor | None = None  # (Hq * (Dn + Dv),) or None, its bias

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        """One latent row `[c | k_rot]` of `R + Dr` values per token, shared by the heads."""
        return MLASpec(self.latent_dim, dtype)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Keeps `kv_b_proj`'s weight (and bias) as float32 `w_kv`, whose per-head halves are
        `W_UK` and `W_UV` (`_w_uk_uv`).

        Read by applying `kv_b_proj` to the identity, so it works for a float, int8 or 4-bit
        weight and for this rank's column shard alike.
        """
        proj = self.kv_b_proj
        dtype = proj.compute_dtype
        device = proj.weight.device
        rank = self.kv_lora_rank
        bias = proj(torch.zeros(1, rank, dtype=dtype, device=device)).float()  # (1, out)
        weight = proj(torch.eye(rank, dtype=dtype, device=device)).float() - bias  # (R, out)
        self.w_kv = weight.t().contiguous()  # (Hq (Dn + Dv), R)
        self.b_kv = bias[0].contiguous() if bool(bias.any()) else None

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `W_UK (Hq, Dn, R)` and `W_UV (Hq, Dv, R)` of the float32 `kv_b_proj` weight."""
        assert self.w_kv is not None
        per_head = self.w_kv.view(self.num_heads, -1, self.kv_lora_rank)  # (Hq, Dn + Dv, R)
        return per_head[:, : self.qk_nope_head_dim], per_head[:, self.qk_nope_head_dim :]

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        q_nope, q_rot, _ = self._queries(hidden, meta)
        nd, parts = meta.num_decodes, []
        if nd:
            parts.append(
                self._absorbed(
                    q_nope[:nd], q_rot[:nd], self.mla.decode_attention,
                    block_tables=meta.decode_block_tables, seq_lens=meta.decode_seq_lens,
                )
            )  # fmt: skip
        if meta.num_prefills:
            parts.append(self._prefill(q_nope[nd:], q_rot[nd:], meta))
        return self._output(parts, hidden)

    def _queries(
        self, hidden: torch.Tensor, meta: PagedMetadata
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Writes the step's latents into the cache; returns the queries `q_nope (T, Hq, Dn)`,
        `q_rot (T, Hq, Dr)` (rotated) and the normed low-rank query `(T, q_lora_rank)` (None
        without one)."""
        assert isinstance(self.kv, LatentKV), "the latent cache is not bound to this layer"
        if self.w_kv is None:
            self.process_weights_after_loading()
        num_tokens, heads = hidden.shape[0], self.num_heads
        dn, dr, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q_resid = None
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(hidden))
            q = self.q_b_proj(q_resid)
        q = q.view(num_tokens, heads, dn + dr)
        ckv = self.kv_a_proj_with_mqa(hidden)  # (T, R + Dr)
        c, k_rot = ckv.split([rank, dr], dim=-1)
        c = self.kv_a_layernorm(c)  # (T, R)
        q_nope, q_rot = q[..., :dn], q[..., dn:]  # (T, Hq, Dn), (T, Hq, Dr)
        if self.rotary is not None and dr:
            q_rot, k_rot = self.rotary(
                meta.rope_positions, q_rot.reshape(num_tokens, heads * dr), k_rot.contiguous(), meta
            )
            q_rot = q_rot.view(num_tokens, heads, dr)
        latent = torch.cat([c, k_rot.to(c.dtype)], dim=-1)  # (T, L)
        self.mla.cache_write(latent=latent, cache=self.kv.latent, slot_mapping=meta.slot_mapping)
        return q_nope, q_rot, q_resid

    def _output(self, parts: list[torch.Tensor], hidden: torch.Tensor) -> torch.Tensor:
        """The attention outputs of the decode rows and the prefill chunks `(.., Hq, Dv)`
        float32, in step order -> the layer's output `(T, H)` (head gates, `o_proj`)."""
        num_tokens, heads = hidden.shape[0], self.num_heads
        if not parts:
            return self.o_proj(hidden.new_zeros(num_tokens, heads * self.v_head_dim))
        out = parts[0] if len(parts) == 1 else torch.cat(parts)  # (T, Hq, Dv) float32
        out = out.to(hidden.dtype)
        if self.g_proj is not None:  # per head, in the model dtype as transformers
            out = (
                out
                * rowwise(torch.sigmoid, self.g_proj(hidden).float()).to(hidden.dtype)[..., None]
            )
        return self.o_proj(out.reshape(num_tokens, heads * self.v_head_dim))

    def _absorbed(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, kernel: Callable[..., torch.Tensor],
        cache: torch.Tensor | None = None, **rows: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Absorbed attention of `q_nope (N, Hq, Dn)`, `q_rot (N, Hq, Dr)` through `kernel`
        (the family's decode or prefill op, with its row tensors `rows`) over `cache` (the
        layer's latents unless given) -> `(N, Hq, Dv)` float32."""
        assert isinstance(self.kv, LatentKV)
        w_uk, w_uv = self._w_uk_uv()
        q_lat = _per_row(q_nope.float(), w_uk)  # (N, Hq, R)
        query = torch.cat([q_lat, q_rot.float()], dim=-1)  # (N, Hq, L)
        cache = self.kv.latent if cache is None else cache
        out_lat = kernel(
            query=query, cache=cache, scale=self.scale, v_dim=self.kv_lora_rank, **rows
        )  # (N, Hq, R)
        out = _per_row_t(out_lat, w_uv)  # (N, Hq, Dv)
        if self.b_kv is not None:
            out = out + self.b_kv.view(self.num_heads, -1)[:, self.qk_nope_head_dim :]
        return out

    def _prefill(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        """The prefill chunks' attention -> `(Tp, Hq, Dv)` float32 (padding tokens zero)."""
        if self.prefill_form == "absorbed":
            return self._absorbed(
                q_nope, q_rot, self.mla.prefill_attention,
                block_tables=meta.prefill_block_tables,
                query_start_loc=meta.prefill_query_start_loc, seq_lens=meta.prefill_seq_lens,
            )  # fmt: skip
        out = torch.zeros(q_nope.shape[0], self.num_heads, self.v_head_dim, device=q_nope.device)
        for p, begin, end, length, expandable in self._prefill_spans(meta):
            if not expandable:  # too long to expand: absorbed
                out[begin:end] = self._absorbed(
                    q_nope[begin:end], q_rot[begin:end], self.mla.prefill_attention,
                    block_tables=meta.prefill_block_tables[p : p + 1],
                    query_start_loc=meta.prefill_query_start_loc.new_tensor([0, end - begin]),
                    seq_lens=meta.prefill_seq_lens[p : p + 1],
                )  # fmt: skip
                continue
            table = meta.prefill_block_tables[p]
            out[begin:end] = self._expanded(q_nope[begin:end], q_rot[begin:end], table, length)
        return out

    def _prefill_spans(self, meta: PagedMetadata) -> Iterator[tuple[int, int, int, int, bool]]:
        """`(p, begin, end, length, expandable)` of each non-empty prefill chunk: its rows among
        the prefill tokens, its sequence's length and whether that sequence's expanded keys and
        values fit `expand_max_bytes`."""
        dims = self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim
        per_token = self.num_heads * dims * 4  # expanded K and V bytes
        starts = meta.prefill_query_start_loc.tolist()
        for p, length in enumerate(meta.prefill_seq_lens.tolist()):
            if starts[p + 1] > starts[p]:
                yield (
                    p,
                    starts[p],
                    starts[p + 1],
                    length,
                    length * per_token <= self.expand_max_bytes,
                )

    def _expanded(
        self, q_nope: torch.Tensor, q_rot: torch.Tensor, table: torch.Tensor, length: int,
        allowed: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """One sequence's chunk `q_nope (Q, Hq, Dn)`, `q_rot (Q, Hq, Dr)` over its `length`
        cached latents expanded to per-head keys and values -> `(Q, Hq, Dv)` float32; `allowed
        (Q, length)` the keys each query sees (default: causal)."""
        assert isinstance(self.kv, LatentKV) and self.w_kv is not None
        cache, heads = self.kv.latent, self.num_heads
        dn, rank = self.qk_nope_head_dim, self.kv_lora_rank
        block_size, num_q = cache.shape[1], q_nope.shape[0]
        pos = torch.arange(length, device=cache.device)  # (S,)
        latents = cache[table[pos // block_size].long(), pos % block_size].float()  # (S, L)
        kv = F.linear(latents[:, :rank], self.w_kv, self.b_kv).view(length, heads, -1)
        k_rot = latents[:, None, rank:].expand(length, heads, self.qk_rope_head_dim)
        keys = torch.cat([kv[..., :dn], k_rot], dim=-1)  # (S, Hq, Dn + Dr)
        values = kv[..., dn:]  # (S, Hq, Dv)
        query = torch.cat([q_nope, q_rot], dim=-1).float()  # (Q, Hq, Dn + Dr)
        if allowed is None:
            allowed = pos[None, :] <= pos[length - num_q :, None]  # (Q, S) causal
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
            attn_mask=allowed, scale=self.scale,
        )  # fmt: skip
        return out.transpose(0, 1)  # (Q, Hq, Dv)


def _per_row(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x (N, H, A) @ w (H, A, B)` per head -> `(N, H, B)`.

    Up to `SMALL_ROWS` rows, one matrix-vector product per row and head, so a row's bits do
    not depend on how many rows there are (a speculative chain's rows equal the tokens decoded
    one by one); above, one batched product per head.
    """
    if x.shape[0] <= SMALL_ROWS:
        return torch.matmul(x.unsqueeze(-2), w).squeeze(-2)
    return torch.einsum("tha,hab->thb", x, w)


def _per_row_t(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x (N, H, A) @ w (H, B, A)^T` per head -> `(N, H, B)`, row by row up to `SMALL_ROWS`
    rows as `_per_row` (with `w` in its stored layout)."""
    if x.shape[0] <= SMALL_ROWS:
        return torch.matmul(w, x.unsqueeze(-1)).squeeze(-1)
    return torch.einsum("tha,hba->thb", x, w)
