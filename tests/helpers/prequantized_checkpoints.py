"""Pre-quantised checkpoints written by hand from each format's specification, for
`tests/models/test_prequantized.py`: nothing here calls the engine's readers.

Each writer takes a float weight `W (N, K)` and returns the checkpoint tensors of one layer
(name suffix -> tensor) and the float weight the format defines from them (its dequantisation
formula, written here from the spec). `FORMATS` names each variant with its
`quantization_config`, which layers it quantises, and the weight dtype the engine should run
each quantised layer in (int8 / uint8 codes, or None for float).

Glossary: N output features, K input features, G weights per group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]
Writer = Callable[[torch.Tensor], tuple[Tensors, torch.Tensor]]

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitudes of codes 0..7; bit 3 the sign
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of an AWQ word holds column AWQ_ORDER[i]


def int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned fields `(R, C)` -> int32 `(R * bits / 32, C)`: field r in word r // per at bit
    `bits * (r % per)` (GPTQ's qweight, compressed-tensors' zero points)."""
    per = 32 // bits
    rows = math.ceil(values.shape[0] / per) * per
    padded = torch.zeros(rows, values.shape[1], dtype=torch.int64)
    padded[: values.shape[0]] = values.long()
    words = torch.zeros(rows // per, values.shape[1], dtype=torch.int64)
    for i in range(per):
        words |= padded[i::per] << (bits * i)
    return int32(words)


def asym_groups(w: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, ...]:
    """Min / max quantisation of `w (N, K)` in groups of `group` columns: unsigned codes
    `(N, K)`, float16 scales and integer zeros `(N, K/G)` (zero in [1, 2^bits - 1])."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    scale = ((hi - lo) / top).clamp(min=1e-6).half()
    zero = torch.round(-lo / scale.float()).clamp(1, top)
    q = torch.round(g / scale.float()[..., None]) + zero[..., None]
    return q.clamp(0, top).reshape(n, k).long(), scale, zero.long()


def sym_groups(w: torch.Tensor, group: int, bits: int) -> tuple[torch.Tensor, ...]:
    """Symmetric quantisation: unsigned codes around the zero 2^(bits-1)."""
    n, k = w.shape
    mid = 1 << (bits - 1)
    g = w.reshape(n, k // group, group)
    scale = (g.abs().amax(-1) / (mid - 1)).clamp(min=1e-6).half()
    q = torch.round(g / scale.float()[..., None]).clamp(-mid, mid - 1) + mid
    return q.reshape(n, k).long(), scale, torch.full(scale.shape, mid)


def groups_of(k: int, group: int) -> torch.Tensor:
    return torch.arange(k) // (k if group == -1 else group)


def spec_value(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, g: torch.Tensor):
    """`W[n, k] = scale[n, g[k]] * (q[n, k] - zero[n, g[k]])`, float32."""
    return (q - zero[:, g]).float() * scale[:, g].float()


def gptq(bits: int, group: int, sym: bool, v1: bool, act_order: bool = False) -> Writer:
    """GPTQ: qweight (K*bits/32, N) packed along K, qzeros (K/G, N*bits/32) along N (v1: the
    zero minus one), scales (K/G, N) float16, g_idx (K,)."""

    def write(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        n, k = w.shape
        size = k if group == -1 else group
        perm = torch.randperm(k, generator=torch.Generator().manual_seed(k)) if act_order else None
        w_in_order = w[:, perm] if act_order else w  # act-order: groups over permuted columns
        q, scale, zero = (sym_groups if sym else asym_groups)(w_in_order, size, bits)
        g = groups_of(k, size)
        if act_order:  # column perm[j] was quantised j-th: back to the checkpoint's order
            inverse = torch.argsort(perm)
            q, g = q[:, inverse], g[inverse]
        stored_zero = zero - 1 if v1 else zero
        tensors = {
            "qweight": pack_rows(q.T, bits),
            "qzeros": _pack_cols(stored_zero.T, bits),
            "scales": scale.T.contiguous(),
            "g_idx": g.to(torch.int32),
        }
        return tensors, spec_value(q, scale, zero, g)

    return write


def _pack_cols(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned fields `(R, C)` -> int32 `(R, C * bits / 32)`, field c at bit `bits * (c % per)`
    of word c // per."""
    return pack_rows(values.T, bits).T.contiguous()


def awq(group: int) -> Writer:
    """AWQ gemm: qweight (K, N/8) with AWQ's column order, qzeros (K/G, N/8), scales (K/G, N)."""

    def interleave(values: torch.Tensor) -> torch.Tensor:  # (R, N) -> (R, N/8) int32
        r, n = values.shape
        words = torch.zeros(r, n // 8, dtype=torch.int64)
        for i, col in enumerate(AWQ_ORDER):
            words |= values[:, col::8].long() << (4 * i)
        return int32(words)

    def write(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        q, scale, zero = asym_groups(w, group, 4)
        tensors = {
            "qweight": interleave(q.T),
            "qzeros": interleave(zero.T),
            "scales": scale.T.contiguous(),
        }
        return tensors, spec_value(q, scale, zero, groups_of(w.shape[1], group))

    return write


def ct_pack(bits: int, group: int, sym: bool) -> Writer:
    """compressed-tensors pack-quantized: signed values + 2^(bits-1) packed along K into int32,
    bfloat16 scales, signed zero points packed along N (asymmetric)."""

    def write(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
        n, k = w.shape
        size = k if group == -1 else group
        q, scale, zero = (sym_groups if sym else asym_groups)(w, size, bits)
        scale = scale.bfloat16()  # float16 -> bfloat16 rounds: requantise on the new scale
        mid = 1 << (bits - 1)
        g = groups_of(k, size)
        lo, hi = 0, (1 << bits) - 1
        q = (torch.round(w / scale.float()[:, g]) + zero[:, g]).clamp(lo, hi).long()
        signed_q, signed_zero = q - mid, zero - mid
        tensors = {
            "weight_packed": _pack_cols(signed_q + mid, bits),
            "weight_scale": scale,
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
        }
        if not sym:
            tensors["weight_zero_point"] = pack_rows(signed_zero + mid, bits)
        return tensors, (signed_q - signed_zero[:, g]).float() * scale.float()[:, g]

    return write


def ct_int8_channel(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    """compressed-tensors int-quantized: int8 weight, per-channel bfloat16 scale `(N, 1)`."""
    scale = (w.abs().amax(1, keepdim=True) / 127).bfloat16()
    q = torch.round(w / scale.float()).clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scale}, q.float() * scale.float()


def _e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (sign in bit 3) of each value (already scaled, |x| <= 6)."""
    grid = torch.tensor(E2M1)
    index = (x.abs()[..., None] - grid).abs().argmin(-1)
    return index + 8 * (x < 0).long()


def _e2m1_value(code: torch.Tensor) -> torch.Tensor:
    sign = torch.where(code >= 8, -1.0, 1.0)
    return sign * torch.tensor(E2M1)[code & 7]


def _pack_pairs(code: torch.Tensor) -> torch.Tensor:
    """E2M1 codes `(..., K)` -> `(..., K/2)` uint8, element 2j in the low nibble."""
    return (code[..., 0::2] | (code[..., 1::2] << 4)).to(torch.uint8)


def nvfp4(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    """NVFP4: E2M1 in blocks of 16, float8 e4m3 block scales over a float32 global scale;
    `W = value * (scale / global_scale)`."""
    n, k = w.shape
    blocks = w.reshape(n, k // 16, 16)
    global_scale = torch.tensor([448.0 * 6.0]) / w.abs().max()
    scale = (blocks.abs().amax(-1) / 6.0 * global_scale).to(torch.float8_e4m3fn)
    unit = scale.float() / global_scale  # (N, K/16)
    code = _e2m1(blocks / unit[..., None].clamp(min=1e-12)).reshape(n, k)
    value = _e2m1_value(code).reshape(n, k // 16, 16) * unit[..., None]
    tensors = {"weight_packed": _pack_pairs(code), "weight_scale": scale}
    tensors["weight_global_scale"] = global_scale.float()
    return tensors, value.reshape(n, k)


def _mx_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OCP MXFP4: blocks of 32 with the E8M0 exponent floor(log2 amax) - 2: codes `(N, K)`,
    exponents `(N, K/32)` uint8, values `(N, K)`."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    exponent = torch.floor(torch.log2(blocks.abs().amax(-1).clamp(min=2.0**-100))) - 2
    unit = torch.pow(2.0, exponent)
    code = _e2m1((blocks / unit[..., None]).clamp(-6, 6)).reshape(n, k)
    value = _e2m1_value(code).reshape(n, k // 32, 32) * unit[..., None]
    return code, (exponent + 127).to(torch.uint8), value.reshape(n, k)


def ct_mxfp4(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    code, exponent, value = _mx_blocks(w)
    return {"weight_packed": _pack_pairs(code), "weight_scale": exponent}, value


def gpt_oss_mxfp4(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    """gpt-oss: `X.weight_blocks` (N, K/32, 16) and `X.weight_scales` (N, K/32)."""
    n, k = w.shape
    code, exponent, value = _mx_blocks(w)
    blocks = _pack_pairs(code).reshape(n, k // 32, 16)
    return {"weight_blocks": blocks, "weight_scales": exponent}, value


def ct_fp8_channel(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    """compressed-tensors float-quantized: float8 e4m3 weight, float32 scale per channel."""
    scale = w.abs().amax(1, keepdim=True) / 448.0
    q = (w / scale).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale": scale}, q.float() * scale


FP8_BLOCK = [32, 16]  # rows, columns: tiny layers hold several blocks, some partial


def fp8_blocks(w: torch.Tensor) -> tuple[Tensors, torch.Tensor]:
    """FP8 with block scales (Qwen's / DeepSeek's -FP8): float8 e4m3 weight, float32
    `weight_scale_inv` per block; `W = value * scale`."""
    rows, cols = w.shape
    bo, bi = FP8_BLOCK
    scale = torch.empty(math.ceil(rows / bo), math.ceil(cols / bi))
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi]
            s = block.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * bo : (i + 1) * bo, j * bi : (j + 1) * bi] = (block / s).to(torch.float8_e4m3fn)
    full = scale.repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return {"weight": q, "weight_scale_inv": scale}, q.float() * full


def _ct_config(fmt: str, weights: dict[str, Any]) -> dict[str, Any]:
    return {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
        "ignore": ["lm_head"],
    }


def _int_args(bits: int, group: int | None, sym: bool) -> dict[str, Any]:
    strategy = "group" if group else "channel"
    return {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": strategy,
            "group_size": group}  # fmt: skip


@dataclass(frozen=True)
class Format:
    """A checkpoint variant: its config, the writer of each quantised layer (its tensors
    named `X.<key>` where the float `X.weight` was), and the dtype the engine runs those
    layers in."""

    config: dict[str, Any]
    write: Writer
    runs_as: torch.dtype | None  # int8 / uint8 codes, None for float
    rows_of_8: bool = False  # only layers with N a multiple of 8 (packed along N)


def _gptq_config(bits: int, group: int, sym: bool, v1: bool, act: bool = False) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act,
            "sym": sym, "checkpoint_format": "gptq" if v1 else "gptq_v2"}  # fmt: skip


FORMATS: dict[str, Format] = {
    "fp8-blocks": Format(
        {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": FP8_BLOCK,
        },  # fmt: skip
        fp8_blocks,
        None,
    ),
    "gptq-4bit-g32-asym-v1": Format(
        _gptq_config(4, 32, False, True), gptq(4, 32, False, True), torch.uint8, True
    ),
    "gptq-4bit-g32-sym-v1": Format(  # the engine's own int4 layout (Q4_0 kernel)
        _gptq_config(4, 32, True, True), gptq(4, 32, True, True), torch.uint8, True
    ),
    "gptq-8bit-channel-asym-v2": Format(
        _gptq_config(8, -1, False, False), gptq(8, -1, False, False), torch.int8, True
    ),
    "gptq-4bit-g32-desc-act-in-order": Format(  # desc_act whose g_idx is contiguous
        _gptq_config(4, 32, False, True, True), gptq(4, 32, False, True), torch.uint8, True
    ),
    "gptq-4bit-g32-act-order": Format(
        _gptq_config(4, 32, False, True, True), gptq(4, 32, False, True, True), None, True
    ),
    "awq-4bit-g32": Format(
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 32,
            "version": "gemm",
            "zero_point": True,
        },  # fmt: skip
        awq(32),
        torch.uint8,
        True,
    ),
    "ct-w4a16-g32-asym": Format(
        _ct_config("pack-quantized", _int_args(4, 32, False)), ct_pack(4, 32, False), torch.uint8
    ),
    "ct-w8a16-channel-sym": Format(
        _ct_config("pack-quantized", _int_args(8, None, True)), ct_pack(8, -1, True), torch.int8
    ),
    "ct-int8-channel": Format(
        _ct_config("int-quantized", _int_args(8, None, True)), ct_int8_channel, torch.int8
    ),
    "ct-nvfp4": Format(
        _ct_config(
            "nvfp4-pack-quantized",
            {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "tensor_group",
                "group_size": 16,
            },
        ),  # fmt: skip
        nvfp4,
        torch.int8,
    ),
    "ct-mxfp4": Format(
        _ct_config(
            "mxfp4-pack-quantized",
            {
                "num_bits": 4,
                "type": "float",
                "symmetric": True,
                "strategy": "group",
                "group_size": 32,
            },
        ),  # fmt: skip
        ct_mxfp4,
        torch.int8,
    ),
    "ct-fp8-channel": Format(
        _ct_config(
            "float-quantized",
            {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"},
        ),  # fmt: skip
        ct_fp8_channel,
        None,
    ),
    "gpt-oss-mxfp4": Format({"quant_method": "mxfp4"}, gpt_oss_mxfp4, torch.int8),
}
