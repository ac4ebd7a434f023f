"""The C++ `grouped_linear` kernel against `grouped_linear_ref` and an independent float64
product, and a `Linear` with `install_packed` against the float layer.

The float64 product is written here from the layout's definition (`W[n, k] = scale[n, k // G]
* code[n, k] + offset[n, k // G]`), from codes drawn as integers and packed by this file's own
nibble packing (per 32 columns, byte j = code j | code j + 16 << 4), so neither the kernel nor
`GroupedWeight` computes the expected values. Rows 1, 3 and 17 run the GEMV (one row, a
remainder tile, several tiles), 80 the dequantised block GEMM; K 384 has 24, 12, 6, 3 and 1
groups for G 16, 32, 64, 128 and K; N 37 is no multiple of the 4- and 8-row units. float32
results are within 1e-5 of the float64 product relative to `|x| @ |W|^T` (summation order
only). `tests/ops/test_cpu_isa.py` runs this file at every lower ISA level the CPU has.
"""

from __future__ import annotations

import functools

import pytest
import torch

from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.packed_weights import install_packed
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dispatch import REF_OPS, get_mamba_ops
from vllm_mamba.ops.grouped_linear import (
    GroupedWeight,
    grouped_linear_cpp,
    grouped_linear_ref,
    has_grouped_kernel,
)

needs_kernel = pytest.mark.skipif(
    not has_grouped_kernel(),
    reason="C++ extension not built (pip install --no-build-isolation -e .)",
)

N, K = 37, 384
ROWS = (1, 3, 17, 80)
CASES = [(8, g) for g in (16, 32, 64, 128, K)] + [(4, g) for g in (32, 64, 128, K)]
F32_TOL = 1e-5  # relative to |x| @ |W|^T
BF16_TOL = 2.0**-7  # bfloat16 output (and, in a bfloat16 GEMM, weight) rounding


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """Codes (N, K) in [0, 15] -> (N, K / 2) uint8: per 32 columns, byte j = c_j | c_{j+16} << 4."""
    n, k = codes.shape
    rows = []
    for r in range(n):
        c = codes[r].tolist()
        row = []
        for base in range(0, k, 32):
            row += [c[base + j] | (c[base + j + 16] << 4) for j in range(16)]
        rows.append(row)
    return torch.tensor(rows, dtype=torch.uint8)


@functools.cache
def _weight(bits: int, group: int, n: int = N, k: int = K) -> tuple[torch.Tensor, ...]:
    """Codes as stored, the integer codes (N, K) int64, scales, offsets (zero points as GPTQ /
    Q4_K store them: offset = -scale * z, z not an integer) and a bias."""
    g = torch.Generator().manual_seed(bits * 1000 + group + n)
    if bits == 4:
        ints = torch.randint(0, 16, (n, k), generator=g)
        stored = _pack(ints)
    else:
        ints = torch.randint(-127, 128, (n, k), generator=g)
        stored = ints.to(torch.int8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001  # (N, K/G)
    scales[0] *= -1.0  # negative scales (GGUF's signed d)
    zeros = torch.rand(n, k // group, generator=g) * (15.0 if bits == 4 else 20.0)
    offsets = (-scales * zeros).contiguous()
    return stored, ints, scales.contiguous(), offsets, torch.randn(n, generator=g)


def _float64(x: torch.Tensor, ints, scales, offsets, bias, group: int) -> torch.Tensor:
    """x @ W^T + bias in float64, W from the definition; and |x| @ |W|^T."""
    n, k = ints.shape
    s = scales.double().repeat_interleave(group, dim=1)  # (N, K)
    w = ints.double() * s
    if offsets is not None:
        w = w + offsets.double().repeat_interleave(group, dim=1)
    x64 = x.double()
    out = x64 @ w.T
    if bias is not None:
        out = out + bias.double()
    return out, x64.abs() @ w.abs().T


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))


@needs_kernel
@pytest.mark.parametrize(
    ("with_offsets", "with_bias"),
    [(True, True), (False, True), (False, False)],
    ids=["offsets_bias", "bias", "plain"],
)
@pytest.mark.parametrize(("bits", "group"), CASES)
def test_float32_matches_float64_and_ref(bits, group, with_offsets, with_bias) -> None:
    stored, ints, scales, offsets, bias = _weight(bits, group)
    offsets = offsets if with_offsets else None
    bias = bias if with_bias else None
    for rows in ROWS:
        x = _x(rows, K, rows)
        got = torch.ops.vllm_mamba.grouped_linear(x, stored, scales, offsets, bias, bits, group)
        assert got.dtype == torch.float32 and got.shape == (rows, N)
        want, mag = _float64(x, ints, scales, offsets, bias, group)
        err = (got.double() - want).abs()
        assert (err <= F32_TOL * mag).all(), (rows, (err / mag).max().item())
        ref = grouped_linear_ref(x, stored, scales, offsets, bias, bits, group)
        assert ((got - ref).abs().double() <= F32_TOL * mag).all(), rows


@needs_kernel
@pytest.mark.parametrize("with_offsets", [True, False], ids=["offsets", "no_offsets"])
@pytest.mark.parametrize(("bits", "group"), CASES)
def test_bfloat16_matches_float64_and_ref(bits, group, with_offsets) -> None:
    stored, ints, scales, offsets, bias = _weight(bits, group)
    offsets = offsets if with_offsets else None
    for rows in ROWS:
        x = _x(rows, K, 100 + rows).to(torch.bfloat16)
        got = torch.ops.vllm_mamba.grouped_linear(x, stored, scales, offsets, bias, bits, group)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, N)
        want, mag = _float64(x, ints, scales, offsets, bias, group)
        assert ((got.double() - want).abs() <= BF16_TOL * mag).all(), rows
        ref = grouped_linear_ref(x, stored, scales, offsets, bias, bits, group)
        assert ((got.double() - ref.double()).abs() <= BF16_TOL * mag).all(), rows


@needs_kernel
@pytest.mark.parametrize(("bits", "group"), [(4, 32), (8, 32), (8, 16), (4, 128)])
def test_many_channels_split_over_threads(bits: int, group: int) -> None:
    """N large enough for several parallel tasks; rows 1 and 5 (tiles and a remainder)."""
    n, k = 700, 512
    stored, ints, scales, offsets, bias = _weight(bits, group, n, k)
    for rows in (1, 5):
        x = _x(rows, k, 7)
        got = torch.ops.vllm_mamba.grouped_linear(x, stored, scales, offsets, bias, bits, group)
        want, mag = _float64(x, ints, scales, offsets, bias, group)
        assert ((got.double() - want).abs() <= F32_TOL * mag).all(), rows


@needs_kernel
def test_row_strided_x_empty_batch_and_bad_inputs() -> None:
    stored, ints, scales, offsets, bias = _weight(4, 64)
    op = torch.ops.vllm_mamba.grouped_linear
    wide = torch.randn(3, K + 50)
    x = wide[:, 10 : 10 + K]  # a column slice, as the fused layers pass
    want = grouped_linear_ref(x.contiguous(), stored, scales, offsets, bias, 4, 64)
    torch.testing.assert_close(op(x, stored, scales, offsets, bias, 4, 64), want)
    assert op(torch.zeros(0, K), stored, scales, None, None, 4, 64).shape == (0, N)
    x = torch.randn(2, K)
    bad = {
        "uint8": (x, stored.to(torch.int8), scales, None, None, 4, 64),
        "int8": (x, stored, scales, None, None, 8, 64),
        "bits must be 4 or 8": (x, stored, scales, None, None, 2, 64),
        "group 48": (x, stored, scales, None, None, 4, 48),
        "scales": (x, stored, scales[:, :2], None, None, 4, 64),
        "offsets": (x, stored, scales, offsets.double(), None, 4, 64),
        "bias": (x, stored, scales, None, torch.zeros(3), 4, 64),
        "codes": (torch.randn(2, 2 * K), stored, scales, None, None, 4, 64),
        "float32 or bfloat16": (x.half(), stored, scales, None, None, 4, 64),
    }
    for message, args in bad.items():
        with pytest.raises(ValueError, match=message):
            op(*args)


def test_wrapper_falls_back_to_the_reference_for_other_inputs() -> None:
    stored, ints, scales, offsets, bias = _weight(8, 32)
    x = _x(2, K, 5).double()  # float64 x: no kernel dtype
    got = grouped_linear_cpp(x, stored, scales, offsets, bias, 8, 32)
    assert got.dtype == torch.float64
    want, mag = _float64(x, ints, scales, offsets, bias, 32)
    assert ((got - want).abs() <= F32_TOL * mag).all()


def test_tables_hold_the_grouped_op(monkeypatch: pytest.MonkeyPatch) -> None:
    assert REF_OPS.grouped_linear is grouped_linear_ref
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    assert get_mamba_ops("cpu").grouped_linear is grouped_linear_ref
    if cpu_kernels.available() and has_grouped_kernel():
        monkeypatch.setenv("VLLM_MAMBA_OPS", "cpp")
        assert get_mamba_ops("cpu").grouped_linear is grouped_linear_cpp


@needs_kernel
@pytest.mark.parametrize(
    ("bits", "group", "with_offsets"), [(4, 64, True), (8, 16, True), (8, K, False)]
)
def test_install_packed_linear_matches_the_float_layer(bits, group, with_offsets) -> None:
    """A `Linear` whose weight is replaced by its integer layout gives the outputs of the same
    layer holding the float weight that layout stands for, at decode and prefill sizes."""
    stored, ints, scales, offsets, bias = _weight(bits, group)
    layout = GroupedWeight(stored, scales, offsets if with_offsets else None, bits, group)
    ops = get_mamba_ops("cpu")
    dense = Linear(K, N, bias=True, ops=ops)
    packed = Linear(K, N, bias=True, ops=ops)
    s = scales.repeat_interleave(group, dim=1)
    w = ints.float() * s + (offsets.repeat_interleave(group, dim=1) if with_offsets else 0.0)
    with torch.no_grad():
        for layer in (dense, packed):
            layer.weight.copy_(w)
            layer.bias.copy_(bias)
    install_packed(packed, layout, ops)
    assert packed.weight.dtype == stored.dtype and packed.compute_dtype == torch.float32
    for rows in (1, 3, 80):
        x = _x(rows, K, 40 + rows).reshape(rows, 1, K)  # (T, 1, K): flattened by the layer
        with torch.no_grad():
            got, want = packed(x), dense(x)
        assert got.shape == want.shape == (rows, 1, N)
        mag = x.abs().reshape(rows, K) @ w.abs().T
        assert ((got - want).abs().reshape(rows, N) <= 2 * F32_TOL * mag).all(), rows
