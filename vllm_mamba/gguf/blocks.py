"""GGUF blocks decoded into the engine's integer layouts, exactly.

Each llama.cpp block type stores a row of weights in blocks; `decode_tensor` turns one tensor
into the float32 tensor it stands for, with, for the types below, the exact
`GroupedWeight` (`vllm_mamba.ops.grouped_linear`) attached
(`vllm_mamba.layers.packed_weights.attach_packed`). Layouts from ggml-quants (fp16 = IEEE
half; all integers little-endian; a block covers consecutive weights of one row):

Per type: block bytes / weights per block; the value of a weight; the engine layout (bits,
group, scale, offset).

- Q4_0: d:f16, qs[16] / 32; `d * (nib - 8)`, byte j holding weight j (low nibble) and j + 16
  (high): bits 4, G32, (d, -8 d), exactly the engine's int4 kernel.
- Q4_1: d, m:f16, qs[16] / 32; `d * nib + m`: bits 4, G32, (d, m).
- Q5_0: d, qh:u32, qs[16] / 32; `d * (nib + 16 b - 16)`, b = bit j of qh for weight j:
  bits 8, G32, (d, none), codes in [-16, 15].
- Q5_1: d, m, qh:u32, qs[16] / 32; `d * (nib + 16 b) + m`: bits 8, G32, (d, m).
- Q8_0: d, qs:i8[32] / 32; `d * q`: bits 8, G32, (d, none).
- Q4_K: d, dmin:f16, scales[12], qs[128] / 256; sub-block s of 32: `d sc_s nib - dmin m_s`:
  bits 4, G32, (d sc_s, -dmin m_s), and the super-blocks' d, dmin, sc, m repacked as
  `vllm_mamba.ops.q4k`'s scale bytes (`GroupedWeight.super_scales`: the same 4.5 bits a weight
  in the integer-dot kernels of `quantization="w4a8_k"`).
- Q5_K: d, dmin, scales[12], qh[32], qs[128] / 256; `d sc_s (nib + 16 b) - dmin m_s`:
  bits 8, G32, (d sc_s, -dmin m_s).
- Q6_K: ql[128], qh[64], sc:i8[16], d:f16 / 256; sub-block of 16: `d sc (q6 - 32)`:
  bits 8, G16, (d sc, none), codes in [-32, 31].

K-quants: the 6-bit `sc_s` / `m_s` of the 8 sub-blocks are packed in `scales[12]` (s < 4:
`scales[s] & 63`, `scales[s + 4] & 63`; s >= 4: `scales[s + 4] & 15 | (scales[s - 4] >> 6) << 4`,
`scales[s + 4] >> 4 | (scales[s] >> 6) << 4`); the 32 bytes `qs[32 c : 32 c + 32]` hold
sub-block 2c in their low nibbles and 2c + 1 in their high ones (Q5_K's 5th bit of sub-block
s: bit s of `qh[i]`). Q6_K's halves of 128: `ql[64 h + l]`, `ql[64 h + 32 + l]` low nibbles
hold weights l, l + 32, their high nibbles l + 64, l + 96, with 2 high bits each from
`qh[32 h + l]` (bits 0-1, 2-3, 4-5, 6-7). The float32 scales and offsets are exact (a float16
times an integer under 2^8). Bits per weight after the repack: Q4_0 4.5 (the int4 kernel's
float16 scales), Q4_1 / Q4_K 6 (4 + two float32 per 32), Q5_0 / Q8_0 9, Q5_1 / Q5_K 10, Q6_K 10.

F32, F16 and BF16 are read as they are; 1-D tensors are always float (a kept type's 1-D
tensor through `gguf`'s reference dequantiser). Any other type (Q2_K, Q3_K, IQ*, TQ*, MXFP4,
...) is a ValueError naming the tensor and the type: dequantising it to float would silently
multiply its memory, so the file is refused instead.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_mamba.layers.packed_weights import attach_packed
from vllm_mamba.ops.grouped_linear import GroupedWeight, pack_nibbles
from vllm_mamba.ops.q4k import pack_scales

__all__ = ["FLOAT_TYPES", "KEPT_TYPES", "decode_tensor", "decode_blocks"]

FLOAT_TYPES = ("F32", "F16", "BF16")
KEPT_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_BLOCK = {  # type -> (weights per block, bytes per block)
    "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
    "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
}  # fmt: skip


def _f16(raw: np.ndarray) -> torch.Tensor:
    """`(..., 2)` uint8 little-endian halves -> `(...)` float32."""
    return torch.from_numpy(np.ascontiguousarray(raw).view("<f2")[..., 0].astype(np.float32))


def _u8(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(raw))


def _low_high(qs: torch.Tensor) -> torch.Tensor:
    """`(..., 16)` bytes -> `(..., 32)` nibbles: the 16 low ones, then the 16 high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _fifth_bits(qh: np.ndarray) -> torch.Tensor:
    """Q5_0 / Q5_1's `qh` `(..., 4)` bytes (a little-endian u32) -> `(..., 32)` bits 0/1."""
    word = torch.from_numpy(np.ascontiguousarray(qh).view("<u4")[..., 0].astype(np.int64))
    return ((word[..., None] >> torch.arange(32)) & 1).to(torch.uint8)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's `scales` `(..., 12)` bytes -> the 6-bit `(sc, m)` `(..., 8)` each."""
    s = scales.to(torch.int32)
    lo_sc, lo_m = s[..., 0:4] & 63, s[..., 4:8] & 63
    hi_sc = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    hi_m = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return torch.cat([lo_sc, hi_sc], -1), torch.cat([lo_m, hi_m], -1)


def decode_blocks(type_name: str, blocks: np.ndarray) -> GroupedWeight:
    """The exact layout of `(N, B, block bytes)` uint8 blocks of `type_name` (one of
    `KEPT_TYPES`): `(N, B * weights per block)` weights."""
    n, nb, _ = blocks.shape
    if type_name in ("Q4_0", "Q4_1"):
        d = _f16(blocks[..., 0:2])  # (N, B)
        m = _f16(blocks[..., 2:4]) if type_name == "Q4_1" else -8.0 * d
        qs = _u8(blocks[..., -16:]).reshape(n, nb * 16)  # already the int4 kernel's packing
        return GroupedWeight(qs.contiguous(), d, m.contiguous(), 4, 32)
    if type_name == "Q8_0":
        d = _f16(blocks[..., 0:2])
        q = _u8(blocks[..., 2:34]).view(torch.int8).reshape(n, nb * 32)
        return GroupedWeight(q.contiguous(), d, None, 8, 32)
    if type_name in ("Q5_0", "Q5_1"):
        d = _f16(blocks[..., 0:2])
        at = 4 if type_name == "Q5_1" else 2
        q = _low_high(_u8(blocks[..., at + 4 :])) | (_fifth_bits(blocks[..., at : at + 4]) << 4)
        if type_name == "Q5_1":
            codes, offsets = q.to(torch.int8), _f16(blocks[..., 2:4])
        else:
            codes, offsets = (q.to(torch.int16) - 16).to(torch.int8), None
        return GroupedWeight(codes.reshape(n, nb * 32).contiguous(), d, offsets, 8, 32)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])  # (N, B)
        sc, m = _k_scales(_u8(blocks[..., 4:16]))  # (N, B, 8)
        qs = _u8(blocks[..., -128:]).reshape(n, nb, 4, 32)
        q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, nb, 8, 32)  # sub-blocks
        scales = (d[..., None] * sc.float()).reshape(n, nb * 8)
        offsets = (-(dmin[..., None] * m.float())).reshape(n, nb * 8)
        if type_name == "Q4_K":  # with its super-blocks as the w4a8_k kernels read them
            supers = pack_scales(d.half(), dmin.half(), sc, m)
            codes = pack_nibbles(q.reshape(n, nb * 256))
            return GroupedWeight(codes, scales, offsets, 4, 32, supers)
        qh = _u8(blocks[..., 16:48])  # (N, B, 32): bit s is sub-block s's 5th bit
        bits = (qh[:, :, None, :] >> torch.arange(8, dtype=torch.uint8)[:, None]) & 1
        q = q | (bits << 4)
        return GroupedWeight(q.reshape(n, nb * 256).to(torch.int8), scales, offsets, 8, 32)
    if type_name == "Q6_K":
        ql = _u8(blocks[..., 0:128]).reshape(n, nb, 2, 2, 32)  # half, first/second 32, l
        qh = _u8(blocks[..., 128:192]).reshape(n, nb, 2, 1, 32)
        sc = _u8(blocks[..., 192:208]).view(torch.int8).float()  # (N, B, 16)
        d = _f16(blocks[..., 208:210])
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
        high = (qh >> shifts) & 3  # (N, B, 2, 4, 32): weights l, l+32, l+64, l+96
        low = torch.cat([ql & 0x0F, ql >> 4], dim=3)  # (N, B, 2, 4, 32) the same order
        q = (low | (high << 4)).to(torch.int16) - 32
        scales = (d[..., None] * sc).reshape(n, nb * 16)
        return GroupedWeight(q.reshape(n, nb * 256).to(torch.int8), scales, None, 8, 16)
    raise ValueError(f"decode_blocks: block type {type_name} is not kept as integers")


def decode_tensor(
    name: str, type_name: str, shape: tuple[int, ...], data: np.ndarray
) -> torch.Tensor:
    """One GGUF tensor (see the module docstring) as float, in PyTorch order `shape`.

    Raises:
        ValueError: a block type that is not kept and not dequantised (the tensor and type
            named), or blocks that do not fit the shape.
    """
    if type_name in FLOAT_TYPES:
        if type_name == "BF16":  # gguf maps BF16 as raw uint16
            raw = torch.from_numpy(np.ascontiguousarray(data).view(np.int16))
            return raw.view(torch.bfloat16).reshape(shape)
        return torch.from_numpy(np.array(data)).reshape(shape)
    if type_name in KEPT_TYPES and len(shape) == 2:
        per, nbytes = _BLOCK[type_name]
        rows, cols = shape
        if cols % per or data.size != rows * cols // per * nbytes:
            raise ValueError(f"GGUF tensor {name}: {type_name} blocks do not fit shape {shape}")
        layout = decode_blocks(type_name, np.asarray(data).reshape(rows, cols // per, nbytes))
        return attach_packed(layout.dequantize(), layout)
    if type_name in KEPT_TYPES:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        values = dequantize(np.asarray(data), GGMLQuantizationType[type_name])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)
    raise ValueError(
        f"GGUF tensor {name}: block type {type_name} is not supported (kept as integers: "
        f"{', '.join(KEPT_TYPES)}; float: {', '.join(FLOAT_TYPES)}); convert the model with one "
        "of those types"
    )
