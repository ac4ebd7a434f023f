"""`MLAAttention`: Multi-head Latent Attention (DeepSeek-V2/V3, Kimi Linear's full-attention
layers) over a paged LATENT cache.

Per token, with transformers' names (so checkpoints load as an identity mapping):

    q = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))       (Hq, Dn + Dr)
    [c | k_rot] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)    (R), (Dr) shared by all heads
    kv_b_proj(c) = [k_nope (Dn) | v (Dv)] per head;  keys [k_nope | k_rot]
    out = o_proj(causal softmax(scale q . k) v),  scale = (Dn + Dr) ** -0.5

Kimi applies no rotary embedding; DeepSeek rotates `q_rot` and `k_rot` (the `rotary` module,
called as `rotary(positions, q_rot (T, Hq * Dr), k_rot (T, Dr))`) before the latent is cached.

What the engine caches per token is the latent `[c | k_rot]` only (`MLASpec(R + Dr)`, one
row shared by the heads), not per-head keys and values. The attention runs in the ABSORBED
form (see `vllm_mamba.ops.mla_attention`): with `W_UK (Hq, Dn, R)` and `W_UV (Hq, Dv, R)` the
per-head halves of `kv_b_proj`, the query `[q_nope @ W_UK | q_rot]` scores the latents directly,
the attention returns `sum_t p_t c_t (Hq, R)` and `W_UV` maps it to the values; a bias of
`kv_b_proj` adds the same term to every score of a query (dropped: softmax is shift invariant)
and its value half is added to the output.

Prefill chunks use the same absorbed kernel (causal varlen, `prefill_attention`) rather than
expanding the gathered latents to per-head keys and values with `kv_b_proj`. Measured on the
CPU (2 shared cores, float32, 16 heads of Kimi's head shape R 512, Dr 64, Dn 128, Dv 128; the
whole layer's attention part: absorption, attention, `W_UV`): a 256-token prompt took 0.10 s
absorbed against 0.13 s expanded (gather, `kv_b_proj`, SDPA per sequence), and a 256-token
chunk after 768 cached tokens 0.29 s against 0.35 s. Expanded does fewer multiply-adds per
query-key pair (Dn + Dr + Dv = 320 against L + R = 1088) but pays the expansion of every cached
token per chunk, a `(context, Hq, Dn + Dr + Dv)` float32 copy, and one SDPA call per sequence;
absorbed reuses the one kernel, needs no extra memory and keeps chunked prefill exactly the
decode computation. (vLLM expands on GPUs, where long prefills are compute bound on tensor
cores; a CUDA measurement was not possible here.)

`W_UK` and `W_UV` are float32 copies split out of `kv_b_proj` after loading
(`process_weights_after_loading`, which `CausalLM` calls before any quantisation; else on the
first forward), read through the layer itself so that an int8 or int4 `kv_b_proj` works too.

Tensor parallelism: the heads are split over the ranks (`q_proj` / `q_b_proj` and `kv_b_proj`
column-parallel by head, `o_proj` row-parallel); `q_a_proj`, `kv_a_proj_with_mqa` and their norms
are replicated, so every rank caches the same latents.

Glossary: T tokens in the step, H hidden size, Hq query heads (this rank's), R kv_lora_rank,
Dn qk_nope_head_dim, Dr qk_rope_head_dim, Dv v_head_dim, L = R + Dr the latent dim.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm_mamba.attention.backends.paged import PagedMetadata
from vllm_mamba.cache_specs import KVSpec, MLASpec
from vllm_mamba.distributed.parallel_state import SINGLE, TensorParallel
from vllm_mamba.layers.cache_layers import KVCacheLayer, LatentKV
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.parallel_linear import column_linear, row_linear
from vllm_mamba.ops import mla_attention as mla_ops
from vllm_mamba.ops.table import MambaOps


class MLAAttention(KVCacheLayer):
    """One MLA layer: its projections, norms and the absorbed attention over the latent cache."""

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
        self.rotary = rotary
        self.mla = ops.family(mla_ops.FAMILY)
        # Derived from kv_b_proj (float32, not parameters): see process_weights_after_loading.
        self.w_uk: torch.Tensor | None = None  # (Hq, Dn, R)
        self.w_uv: torch.Tensor | None = None  # (Hq, Dv, R)
        self.b_uv: torch.Tensor | None = None  # (Hq, Dv) or None

    def kv_spec(self, dtype: torch.dtype) -> KVSpec:
        """One latent row `[c | k_rot]` of `R + Dr` values per token, shared by the heads."""
        return MLASpec(self.latent_dim, dtype)

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        """Splits `W_UK`, `W_UV` (and the value bias) out of `kv_b_proj` as float32.

        Read by applying `kv_b_proj` to the identity, so the split works for a float, int8 or
        4-bit weight and for this rank's column shard alike.
        """
        proj = self.kv_b_proj
        dtype = proj.compute_dtype
        device = proj.weight.device
        rank = self.kv_lora_rank
        bias = proj(torch.zeros(1, rank, dtype=dtype, device=device)).float()  # (1, out)
        weight = proj(torch.eye(rank, dtype=dtype, device=device)).float() - bias  # (R, out)
        per_head = weight.t().reshape(self.num_heads, -1, rank)  # (Hq, Dn + Dv, R)
        dn = self.qk_nope_head_dim
        self.w_uk = per_head[:, :dn].contiguous()  # (Hq, Dn, R)
        self.w_uv = per_head[:, dn:].contiguous()  # (Hq, Dv, R)
        b_uv = bias.view(self.num_heads, -1)[:, dn:]  # (Hq, Dv)
        self.b_uv = b_uv.contiguous() if bool(b_uv.any()) else None

    def forward(self, hidden: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """`hidden (T, H)` -> `(T, H)`."""
        assert isinstance(self.kv, LatentKV), "the latent cache is not bound to this layer"
        if self.w_uk is None:
            self.process_weights_after_loading()
        assert self.w_uk is not None and self.w_uv is not None
        num_tokens, heads = hidden.shape[0], self.num_heads
        dn, dr, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q = q.view(num_tokens, heads, dn + dr)
        ckv = self.kv_a_proj_with_mqa(hidden)  # (T, R + Dr)
        c, k_rot = ckv.split([rank, dr], dim=-1)
        c = self.kv_a_layernorm(c)  # (T, R)
        q_nope, q_rot = q[..., :dn], q[..., dn:]  # (T, Hq, Dn), (T, Hq, Dr)
        if self.rotary is not None and dr:
            q_rot, k_rot = self.rotary(
                meta.positions, q_rot.reshape(num_tokens, heads * dr), k_rot.contiguous()
            )
            q_rot = q_rot.view(num_tokens, heads, dr)
        latent = torch.cat([c, k_rot.to(c.dtype)], dim=-1)  # (T, L)
        self.mla.cache_write(latent=latent, cache=self.kv.latent, slot_mapping=meta.slot_mapping)
        q_lat = torch.einsum("thn,hnr->thr", q_nope.float(), self.w_uk)  # (T, Hq, R)
        query = torch.cat([q_lat, q_rot.float()], dim=-1)  # (T, Hq, L) float32
        out_lat = self._attend(query, meta)  # (T, Hq, R) float32
        out = torch.einsum("thr,hvr->thv", out_lat, self.w_uv)  # (T, Hq, Dv)
        if self.b_uv is not None:
            out = out + self.b_uv
        return self.o_proj(out.reshape(num_tokens, heads * self.v_head_dim).to(hidden.dtype))

    def _attend(self, query: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
        """Absorbed attention of `query (T, Hq, L)` over the latents -> `(T, Hq, R)`."""
        assert isinstance(self.kv, LatentKV)
        cache, rank, nd = self.kv.latent, self.kv_lora_rank, meta.num_decodes
        parts = []
        if nd:
            parts.append(
                self.mla.decode_attention(
                    query=query[:nd], cache=cache, block_tables=meta.decode_block_tables,
                    seq_lens=meta.decode_seq_lens, scale=self.scale, v_dim=rank,
                )
            )  # fmt: skip
        if meta.num_prefills:
            parts.append(
                self.mla.prefill_attention(
                    query=query[nd:], cache=cache, block_tables=meta.prefill_block_tables,
                    query_start_loc=meta.prefill_query_start_loc,
                    seq_lens=meta.prefill_seq_lens, scale=self.scale, v_dim=rank,
                )
            )  # fmt: skip
        if not parts:
            return query.new_zeros(query.shape[0], query.shape[1], rank)
        return parts[0] if len(parts) == 1 else torch.cat(parts)
