"""The Q4_K-style 4-bit layout (`quantization="w4a8_k"`): super-blocks with 6-bit scales.

Beside the Q4_0-style groups of `int4` / `w4a8` (symmetric codes in [-8, 7] with one float16
scale per 32 weights, 4.5 bits a weight), this layout stores each group of 32 weights of a row
as unsigned codes c in [0, 15] with its own scale and min, as llama.cpp's Q4_K:

    weight i of block j = (d * sc_j) * c_i - (dmin * m_j)

where 8 consecutive blocks (256 weights) form a super-block with one float16 `d` and `dmin`,
and each block's `sc_j` and `m_j` are 6-bit integers. That is also 4.5 bits a weight (128 code
bytes and 16 scale bytes per 256), with an offset per block for the asymmetric ranges of real
weights. The last super-block of a row may hold fewer than 8 blocks (K a multiple of 32 only).

Storage (the kernels' `int_dot::Q4KRows`, `csrc/int_dot.h`):
- `codes (N, K/2)` uint8: the nibbles packed as the engine's int4 (per block of 32 columns,
  byte i holds column i in its low nibble and column i + 16 in its high one);
- `scales (N, S * 16)` uint8, S = ceil(K / 256), per row and super-block 16 bytes: `d`
  (float16, bytes 0-1 little-endian), `dmin` (bytes 2-3), byte 4 + i = `sc_i & 15 |
  (m_i & 15) << 4`, byte 12 + i holds the high two bits of `sc` and `m` of blocks 2i
  (bits 0-1, 2-3) and 2i + 1 (bits 4-5, 6-7).
Both are put in the integer-dot strip layout at load (`int_dot_linear.pack_w4a8`).

`quantize_q4k_ref` searches each block's scale and min as llama.cpp's `make_qkx2_quants` does (a
grid of candidate scales, each refined by weighted least squares, importance |w| plus the
super-block's RMS; the errors from the weighted moments), then quantises the 8 scales and mins
of a super-block to 6 bits under float16 `d` / `dmin` and recomputes the codes with the
quantised values. Written from the layout's definition; the held-out loss against Q4_0 and
llama.cpp's Q4_K_M is in `benchmarks/README.md`.

Glossary: N rows, K columns, NB = K / 32 blocks, S super-blocks.
"""

from __future__ import annotations

import torch

from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.grouped_linear import pack_nibbles, unpack_nibbles
from vllm_mamba.ops.int8_linear import QUANTIZE_BLOCK

Q4K_BLOCK = 32  # weights sharing one scale and min
Q4K_SUPER = 8  # blocks per super-block
Q4K_SUPER_BYTES = 16  # scale bytes per row and super-block
Q4K_LEVELS = 15  # codes in [0, 15]
Q4K_SCALE_MAX = 63  # 6-bit sc and m
# Candidate scale offsets: make_qkx2_quants' range (-1 to 1) in steps of 0.2 instead of its 0.1
# (measured on 512 x 1024 Gaussian, Student-t(3) and off-centre rows: RMS errors 0.0719 /
# 0.0933 / 0.0716 of the weights' spread against 0.0718 / 0.0932 / 0.0715, at 0.7x the time;
# Q4_0-style groups: 0.0859 / 0.1277 / 0.0942).
_GRID = [(-1.0 + 0.2 * i) for i in range(11)]


def q4k_supported(k: int) -> bool:
    """Whether a layer with `k` input features can take the layout (K a multiple of 32)."""
    return k > 0 and k % Q4K_BLOCK == 0


def super_blocks(k: int) -> int:
    """Super-blocks of a row of `k` weights (the last may be partial)."""
    return -(-(k // Q4K_BLOCK) // Q4K_SUPER)


def quantize_q4k(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K-style quantisation of a float weight: the C++ quantiser for a CPU weight where the
    extension is loaded (`csrc/q4k_quantize.cpp`, rows in parallel; the same algorithm, its
    sums in another order), else `quantize_q4k_ref`. Arguments and results as the reference's.
    """
    if weight.dim() == 2 and q4k_supported(weight.shape[1]) and weight.device.type == "cpu":
        if cpu_isa.has_op("q4k_quantize"):
            return torch.ops.vllm_mamba.q4k_quantize(weight.detach().float().contiguous())
    return quantize_q4k_ref(weight)


def quantize_q4k_ref(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K-style quantisation of a float weight (see the module docstring), in PyTorch.

    Args:
        weight: `(N, K)` float32 or bfloat16, K a multiple of 32.

    Returns:
        `codes (N, K/2)` uint8 and `scales (N, ceil(K/256) * 16)` uint8, both contiguous.

    Raises:
        ValueError: `weight` is not 2-D with K a multiple of 32.
    """
    if weight.dim() != 2 or not q4k_supported(weight.shape[1]):
        raise ValueError(
            f"quantize_q4k: weight must be (N, K) with K a multiple of {Q4K_BLOCK}, "
            f"got {tuple(weight.shape)}"
        )
    n, k = weight.shape
    codes = torch.empty(n, k // 2, dtype=torch.uint8)
    scales = torch.empty(n, super_blocks(k) * Q4K_SUPER_BYTES, dtype=torch.uint8)
    step = max(1, QUANTIZE_BLOCK // (4 * k))  # rows at a time: the grid's temporaries stay small
    for r in range(0, n, step):
        codes[r : r + step], scales[r : r + step] = _quantize_rows(weight[r : r + step])
    return codes, scales


def _block_fits(w: torch.Tensor, imp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale `a >= 0` and min `m >= 0` of each block of `w (..., 32)` (`w ~ a c - m`, c in
    [0, 15]) with the least weighted squared error (importance `imp`) over the grid."""
    lo = w.amin(-1).clamp(max=0.0)  # (...,) the block's min, never above 0
    span = w.amax(-1) - lo  # (...,)
    flat = span <= 0
    safe = torch.where(flat, torch.ones_like(span), span)
    iw = imp * w
    sw, sx, sxx = imp.sum(-1), iw.sum(-1), (iw * w).sum(-1)  # (...,) the weighted moments
    best_a = span / Q4K_LEVELS  # the min-max fit
    best_m = -lo
    best_err = _error(w, imp, best_a, best_m)
    shifted = w - lo[..., None]
    for off in _GRID:
        iscale = (Q4K_LEVELS + off) / safe  # (...,)
        c = torch.round(shifted * iscale[..., None]).clamp_(0, Q4K_LEVELS)
        # weighted least squares of w ~ a c + b over the block
        ic = imp * c
        sc, scc, scx = ic.sum(-1), (ic * c).sum(-1), (iw * c).sum(-1)
        det = sw * scc - sc * sc
        ok = det > 0
        det = torch.where(ok, det, torch.ones_like(det))
        a = (sw * scx - sc * sx) / det
        b = (scc * sx - sc * scx) / det
        # a min above 0 is clamped to 0 (the range then starts at 0): a from the codes alone
        pos = b > 0
        a = torch.where(pos, scx / torch.where(scc > 0, scc, torch.ones_like(scc)), a)
        b = torch.where(pos, torch.zeros_like(b), b)
        # sum imp (a c + b - w)^2 from the moments
        err = a * a * scc + b * b * sw + sxx + 2 * (a * b * sc - a * scx - b * sx)
        better = ok & (a > 0) & (err < best_err)
        best_a = torch.where(better, a, best_a)
        best_m = torch.where(better, -b, best_m)
        best_err = torch.where(better, err, best_err)
    zero = torch.zeros_like(best_a)
    return torch.where(flat, zero, best_a), torch.where(flat, zero, best_m)


def _error(w: torch.Tensor, imp: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The weighted squared error of `w ~ a c - m` with the nearest codes c for a, m."""
    c = _codes(w, a, m)
    return (imp * (a[..., None] * c - m[..., None] - w) ** 2).sum(-1)


def _codes(w: torch.Tensor, a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The nearest codes in [0, 15] of `w (..., 32)` under scale `a` and min `m` (0 for a = 0)."""
    safe = torch.where(a > 0, a, torch.ones_like(a))[..., None]
    c = torch.round((w + m[..., None]) / safe).clamp_(0, Q4K_LEVELS)
    return torch.where(a[..., None] > 0, c, torch.zeros_like(c))


def _six_bits(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`v (n, S, 8)` >= 0 as float16 `d (n, S)` and 6-bit `q (n, S, 8)` with `v ~ d q`."""
    d = (v.amax(-1) / Q4K_SCALE_MAX).to(torch.float16)  # (n, S)
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))[..., None]
    q = torch.round(v / safe).clamp_(0, Q4K_SCALE_MAX)
    return d, torch.where(df[..., None] > 0, q, torch.zeros_like(q)).to(torch.uint8)


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_q4k_ref` of a block of rows `(n, K)`."""
    n, k = weight.shape
    nb, ns = k // Q4K_BLOCK, super_blocks(k)
    w = torch.zeros(n, ns * Q4K_SUPER, Q4K_BLOCK)  # (n, S * 8, 32), padding blocks zero
    w[:, :nb] = weight.detach().float().reshape(n, nb, Q4K_BLOCK)
    sup = w.reshape(n, ns, Q4K_SUPER * Q4K_BLOCK)  # (n, S, 256)
    rms = sup.pow(2).mean(-1).sqrt()  # (n, S)
    imp = w.abs() + rms.repeat_interleave(Q4K_SUPER, dim=1)[..., None]  # (n, S * 8, 32)
    a, m = _block_fits(w, imp)  # (n, S * 8) each
    d, sc = _six_bits(a.reshape(n, ns, Q4K_SUPER))  # (n, S), (n, S, 8)
    dmin, mq = _six_bits(m.reshape(n, ns, Q4K_SUPER))
    ds = (d.float()[..., None] * sc.float()).reshape(n, ns * Q4K_SUPER)  # (n, S * 8)
    dm = (dmin.float()[..., None] * mq.float()).reshape(n, ns * Q4K_SUPER)
    c = _codes(w, ds, dm)[:, :nb].reshape(n, k)  # (n, K) in [0, 15]
    return pack_nibbles(c), pack_scales(d, dmin, sc, mq)


def pack_scales(
    d: torch.Tensor, dmin: torch.Tensor, sc: torch.Tensor, m: torch.Tensor
) -> torch.Tensor:
    """`d, dmin (n, S)` float16 with 6-bit `sc, m (n, S, 8)` -> the scale bytes `(n, S * 16)`."""
    n, ns = d.shape
    out = torch.empty(n, ns, Q4K_SUPER_BYTES, dtype=torch.uint8)
    for col, half in ((0, d), (2, dmin)):
        bits = half.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF  # (n, S)
        out[..., col] = (bits & 0xFF).to(torch.uint8)
        out[..., col + 1] = (bits >> 8).to(torch.uint8)
    sc, m = sc.to(torch.uint8), m.to(torch.uint8)
    out[..., 4:12] = (sc & 15) | ((m & 15) << 4)
    high = (sc >> 4) | ((m >> 4) << 2)  # (n, S, 8): 4 bits per block
    out[..., 12:16] = high[..., 0::2] | (high[..., 1::2] << 4)
    return out.reshape(n, ns * Q4K_SUPER_BYTES)


def unpack_scales(scales: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale bytes `(N, S * 16)` of a K-column weight -> the block scales `d * sc` and mins
    `dmin * m`, each `(N, K/32)` float32 (exact)."""
    n = scales.shape[0]
    ns, nb = super_blocks(k), k // Q4K_BLOCK
    b = scales.reshape(n, ns, Q4K_SUPER_BYTES).to(torch.int32)  # (N, S, 16)

    def half(col: int) -> torch.Tensor:
        bits = b[..., col] | (b[..., col + 1] << 8)  # (N, S) in [0, 65535]
        bits = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16)
        return bits.view(torch.float16).float()

    lo = b[..., 4:12]  # (N, S, 8)
    high = b[..., 12:16].repeat_interleave(2, dim=-1)  # (N, S, 8): block i's byte 12 + i // 2
    high = high >> (4 * (torch.arange(Q4K_SUPER, device=scales.device) % 2))
    sc = (lo & 15) | ((high & 3) << 4)
    m = (lo >> 4) | (((high >> 2) & 3) << 4)
    ds = (half(0)[..., None] * sc.float()).reshape(n, ns * Q4K_SUPER)[:, :nb]
    dm = (half(2)[..., None] * m.float()).reshape(n, ns * Q4K_SUPER)[:, :nb]
    return ds, dm


def dequantize_q4k(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`codes (N, K/2)` with `scales (N, S * 16)` (plain layouts) as a float `(N, K)` weight."""
    n, half = codes.shape
    k = 2 * half
    ds, dm = unpack_scales(scales, k)  # (N, K/32) each
    c = unpack_nibbles(codes).float().reshape(n, k // Q4K_BLOCK, Q4K_BLOCK)
    return (c * ds[..., None] - dm[..., None]).reshape(n, k).to(dtype)
