"""`w8a8_linear` / `w4a8_linear` (integer dot products) against independent formulas, for the
int8, Q4_0-style and Q4_K-style (`ops.q4k`, `quantization="w4a8_k"`) weights.

- The activation quantiser (`quantize_activations_q8`) equals a per-block loop written here.
- The kernels quantise x exactly as it does: with one-hot weight rows each output is one
  activation's `d * q`, compared for equality.
- The kernels' results against the exact value (float64) of the same integer products: the
  block sums are exact integers, so the only error is float32's rounding of the K / 32 scaled
  block terms and their sum. Bound per output: `(NB + 8) * 2^-24 * sum_j |d_j D_j|` (times
  the row scale; NB block terms summed, the scale products, the final scale; Q4_K-style: 2 NB
  + 8 over both terms of a block, `d_j ds_j D_j` and `d_j dm_j sum(q)`), plus the output
  rounding (2^-24 float32, 2^-8 bfloat16) of `|out|`. An activation code off by one would be
  `d * |w|`, far above it. The references (`w8a8_linear_ref`, float32 `F.linear` over K
  products) are held to `(K + 8) * 2^-24 * sum_i |x_i w_i|` (dequantised values).
- A row's result does not depend on the other rows of the batch (bit for bit): from 16 rows
  the ops run a GEMM (`csrc/int_dot_gemm.h`, AVX2 / AVX-512), which must give each row the
  bits the one-row path gives it, for any thread count.
- The strip layout the weights are stored in (`to_strips`): the inverse and single rows read
  back the plain rows; every kernel test above passes stored weights and checks against the
  plain ones, with N not a multiple of 16 (a partial last strip).
- Bad inputs; the same tests without VNNI (`VLLM_MAMBA_INT_DOT_VNNI=0`, a subprocess).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from vllm_mamba.ops.grouped_linear import pack_nibbles, unpack_nibbles
from vllm_mamba.ops.int4_linear import quantize_int4, unpack_int4
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.int_dot_linear import (
    dequantize_activations_q8,
    from_strips,
    has_int_dot_kernels,
    int_dot_instruction,
    pack_w4a8,
    pack_w8a8,
    quantize_activations_q8,
    strip_rows,
    to_strips,
    w4a8_linear_ref,
    w8a8_linear_ref,
)
from vllm_mamba.ops.q4k import quantize_q4k, unpack_scales

needs_kernel = pytest.mark.skipif(not has_int_dot_kernels(), reason="C++ extension not built")
FMTS = ["w8a8", "w4a8", "w4a8_k"]  # int8, Q4_0-style 4-bit, Q4_K-style 4-bit weights


def _kernel(fmt: str):  # noqa: ANN202
    return torch.ops.vllm_mamba.w8a8_linear if fmt == "w8a8" else torch.ops.vllm_mamba.w4a8_linear


U = 2.0**-24


def _q8_loop(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 of each row of x, one block at a time in float32 numpy: codes and scales."""
    rows = x.float().numpy().reshape(x.shape[0], -1, 32)
    q = np.zeros(rows.shape, dtype=np.int8)
    d = np.zeros(rows.shape[:2], dtype=np.float32)
    for i in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            block = rows[i, j]
            scale = np.float32(np.abs(block).max()) / np.float32(127)
            d[i, j] = scale
            if scale > 0:
                q[i, j] = np.clip(np.rint(block / scale), -127, 127).astype(np.int8)
    return q.reshape(x.shape), d


def _x(m: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, k // 32, 1, generator=g).repeat_interleave(
        32, 1
    ).reshape(m, k).mul(3)
    if m > 1 and k >= 64:
        x[1, 32:64] = 0  # a block of zeros: scale 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_quantiser_matches_a_per_block_loop(dtype: torch.dtype) -> None:
    x = _x(5, 128, 1, dtype)
    x[0, :32] = torch.arange(32) - 16.5  # amax 16.5: a scale that is not a power of two
    x[2, :32] = 0.0
    x[2, 0], x[2, 1], x[2, 2], x[2, 3] = 127.0, 2.5, -3.5, 0.5  # scale 1: ties to even
    q, d = quantize_activations_q8(x)
    want_q, want_d = _q8_loop(x)
    assert q.dtype == torch.int8 and d.dtype == torch.float32
    assert np.array_equal(q.numpy(), want_q) and np.array_equal(d.numpy(), want_d)
    assert q[2, :4].tolist() == [127, 2, -4, 0]
    assert float(d[1, 1]) == 0.0 and not q[1, 32:64].any()


def test_activation_quantiser_rejects_k_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_activations_q8(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="multiple of 32"):
        w8a8_linear_ref(
            torch.zeros(2, 48), torch.zeros(3, 48, dtype=torch.int8), torch.ones(3), None
        )


@pytest.mark.parametrize("n", [1, 7, 16, 35, 48])
@pytest.mark.parametrize("group", [1, 4])
def test_the_strip_layout_is_a_permutation_read_back_by_row(n: int, group: int) -> None:
    plain = torch.arange(n * 8 * group, dtype=torch.int32).reshape(n, 8 * group)
    stored = to_strips(plain, group)
    assert stored.shape == plain.shape
    assert torch.equal(stored.flatten().sort().values, plain.flatten())
    assert torch.equal(from_strips(stored, group), plain)
    rows = torch.tensor([n - 1, 0, n // 2, n - 1])
    assert torch.equal(strip_rows(stored, rows, group), plain[rows])  # views of their strips
    many = torch.arange(max(9, n)).flip(0) % n  # more than 8 rows: one gather
    assert torch.equal(strip_rows(stored, many, group), plain[many])
    # row r's group g is at (g * L + r % 16) * group within its strip of L rows
    r = n - 1
    lanes = n - r // 16 * 16 if n - r // 16 * 16 < 16 else 16
    at = r // 16 * 16 * 8 * group + (3 * lanes + r % 16) * group
    assert torch.equal(stored.flatten()[at : at + group], plain[r, 3 * group : 4 * group])


def _one_hot_int8(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return pack_w8a8(torch.eye(k, dtype=torch.int8)), torch.ones(k)


def _one_hot_q4k(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K-style rows e_i: code 1 at i, 0 elsewhere, every block's scale 1 and min 0."""
    codes = torch.zeros(k, k, dtype=torch.uint8)
    codes.fill_diagonal_(1)
    ns = -(-k // 256)
    scales = torch.zeros(k, ns, 16, dtype=torch.uint8)
    scales[..., 1] = 0x3C  # d = 1.0 (float16 0x3C00)
    scales[..., 4:12] = 1  # sc = 1, m = 0
    return pack_w4a8(pack_nibbles(codes), scales.reshape(k, ns * 16))


def _one_hot_int4(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit rows e_i: code 0 (-8) at i, code 8 (0) elsewhere, scales -1/8: weight 1 at i."""
    codes = torch.full((k, k), 8, dtype=torch.uint8)
    codes.fill_diagonal_(0)
    c = codes.reshape(k, k // 32, 32)
    packed = (c[..., :16] | (c[..., 16:] << 4)).reshape(k, k // 2).contiguous()
    return pack_w4a8(packed, torch.full((k, k // 32), -0.125, dtype=torch.float16))


@needs_kernel
@pytest.mark.parametrize("m", [1, 3, 9, 20])
def test_kernels_quantise_x_as_the_reference(m: int) -> None:
    """One-hot weights read back each activation's `d * q` (one exact term per output)."""
    x = _x(m, 96, 2 + m)
    x[0, :32] = torch.arange(32) - 16.5
    want = dequantize_activations_q8(*quantize_activations_q8(x))
    assert torch.equal(torch.ops.vllm_mamba.w8a8_linear(x, *_one_hot_int8(96), None), want)
    assert torch.equal(torch.ops.vllm_mamba.w4a8_linear(x, *_one_hot_int4(96), None), want)
    assert torch.equal(torch.ops.vllm_mamba.w4a8_linear(x, *_one_hot_q4k(96), None), want)


def _exact(x: torch.Tensor, w_int: torch.Tensor, w_scale, fmt: str):  # noqa: ANN001, ANN202
    """The exact result (float64) of the integer products, the magnitude of its block terms
    (`sum_j |d_j D_j [* s_j]|`, times the row scale for int8; Q4_K-style `sum_j |d_j ds_j D_j|
    + |d_j dm_j sum(q)|`) and of its K products (the dequantised weights)."""
    q, d = _q8_loop(x)
    m, k = q.shape
    nb = k // 32
    qb = torch.from_numpy(q).double().reshape(m, 1, nb, 32)
    wb = w_int.double().reshape(1, -1, nb, 32)
    dots = (qb * wb).sum(-1)  # (M, N, NB) exact integers
    dx = torch.from_numpy(d).double()[:, None, :]  # (M, 1, NB)
    if fmt == "w4a8_k":
        ds, dm = (t.double()[None] for t in w_scale)  # (1, N, NB) each
        mins = dx * dm * qb.sum(-1)  # (M, N, NB)
        terms = dots * dx * ds - mins
        products = (qb * (wb * ds[..., None] - dm[..., None])).abs().sum(-1) * dx
        return terms.sum(-1), (dots * dx * ds).abs().sum(-1) + mins.abs().sum(-1), products.sum(-1)
    products = (qb * wb).abs().sum(-1)  # (M, N, NB)
    scales = dx * (w_scale.double()[None] if fmt == "w4a8" else w_scale.double()[None, :, None])
    terms = dots * scales  # (M, N, NB)
    return terms.sum(-1), terms.abs().sum(-1), (products * scales.abs()).sum(-1)


def _weights(n: int, k: int, fmt: str, seed: int):  # noqa: ANN202
    """Stored weights (strip layout) and scales, then the plain integers and scales."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * k**-0.5 + 0.3 * k**-0.5  # rows off centre
    if fmt == "w4a8_k":
        codes, scales = quantize_q4k(w)
        return *pack_w4a8(codes, scales), unpack_nibbles(codes), unpack_scales(scales, k)
    if fmt == "w4a8":
        qweight, scales = quantize_int4(w)
        return *pack_w4a8(qweight, scales), unpack_int4(qweight), scales.float()
    qweight, scale = quantize_int8(w)
    return pack_w8a8(qweight), scale, qweight, scale


@needs_kernel
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 3, 9, 17, 70])
@pytest.mark.parametrize("k,n", [(32, 13), (64, 40), (1024, 21), (800, 19)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_kernels_and_references_against_the_exact_products(
    fmt: str, m: int, k: int, n: int, dtype: torch.dtype, bias: bool
) -> None:
    """k 800: 25 blocks, a partial super-block (Q4_K-style) and a partial group of 16."""
    seed = m * 1000 + k + n
    qweight, scale, w_int, w_scale = _weights(n, k, fmt, seed)
    x = _x(m, k, seed + 1, dtype)
    b = torch.randn(n, generator=torch.Generator().manual_seed(seed + 2)) if bias else None
    exact, mag_blocks, mag_products = _exact(x, w_int, w_scale, fmt)
    if b is not None:
        exact = exact + b.double()
    out_round = U if dtype == torch.float32 else 2.0**-8
    ref = w8a8_linear_ref if fmt == "w8a8" else w4a8_linear_ref
    block_terms = (2 if fmt == "w4a8_k" else 1) * (k // 32) + 8
    for fn, terms, mag in ((_kernel(fmt), block_terms, mag_blocks), (ref, k + 8, mag_products)):
        got = fn(x, qweight, scale, b)
        assert got.dtype == dtype and got.shape == (m, n)
        bound = terms * U * mag + out_round * exact.abs() * 1.01 + 1e-30
        err = (got.double() - exact).abs()
        assert bool((err <= bound).all()), (fn, float((err / bound).max()))


@needs_kernel
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 5, 20])
def test_the_largest_block_sums_are_exact(fmt: str, m: int) -> None:
    """Every weight at its largest code (4-bit: 15, int8: 127 or -127) times activation codes
    of +-127: the block sums at their bounds, where the maddubs kernels add a 4-bit block's
    8 pair sums in int16 (16 * 15 * 127 = 30480 per lane, `kCodeSumBound`), through the
    one-row path (m 1, 5) and the GEMM (m 20)."""
    n, k = 19, 544
    g = torch.Generator().manual_seed(m)
    sign = torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0)
    sign[0] = 1.0  # a row of +127 codes only
    x = sign * torch.rand(m, k // 32, 1, generator=g).add(0.5).repeat_interleave(32, 1).view(m, k)
    if fmt == "w8a8":
        w_int = torch.full((n, k), 127, dtype=torch.int8)
        w_int[1::2] = -127
        w_scale = torch.rand(n, generator=g) + 0.5
        qweight, scale = pack_w8a8(w_int), w_scale
    else:
        codes = torch.full((n, k), 15, dtype=torch.uint8)
        if fmt == "w4a8_k":  # any valid scale bytes: those of a random weight
            scales = quantize_q4k(torch.randn(n, k, generator=g))[1]
            w_scale = unpack_scales(scales, k)
        else:
            scales = (torch.rand(n, k // 32, generator=g) + 0.5).half()
            w_scale = scales.float()
        qweight, scale = pack_w4a8(pack_nibbles(codes), scales)
        w_int = codes.int() - (0 if fmt == "w4a8_k" else 8)
    q, _ = _q8_loop(x)
    assert np.abs(q).min() == 127  # every activation code at +-127
    exact, mag_blocks, _ = _exact(x, w_int, w_scale, fmt)
    got = _kernel(fmt)(x, qweight, scale, None).double()
    terms = (2 if fmt == "w4a8_k" else 1) * (k // 32) + 8
    assert bool(((got - exact).abs() <= terms * U * mag_blocks + U * exact.abs() * 1.01).all())


@needs_kernel
@pytest.mark.parametrize("fmt", FMTS)
def test_a_rows_result_does_not_depend_on_the_batch(fmt: str) -> None:
    qweight, scale, _, _ = _weights(37, 544, fmt, 9)  # 17 blocks: a partial group
    x = _x(70, 544, 10)
    kernel = _kernel(fmt)
    batched = kernel(x, qweight, scale, None)
    for i in (0, 5, 33, 69):
        assert torch.equal(kernel(x[i : i + 1], qweight, scale, None), batched[i : i + 1])
    assert torch.equal(kernel(x[4:7], qweight, scale, None), batched[4:7])


@needs_kernel
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [2, 5, 12, 17, 64, 200])
@pytest.mark.parametrize(
    "k,n",
    # 3 blocks, 17 (a partial group of 16), 32; N vs 16 (AVX-512 multiplies strips in pairs:
    # one alone, a pair with a partial second strip, pairs and a partial one alone)
    [(96, 16), (96, 20), (544, 37), (1024, 70)],
)
def test_many_rows_equal_one_row_at_a_time(fmt: str, m: int, k: int, n: int) -> None:
    """The many-row paths (below 16 rows two whole strips side by side on AVX-512, in passes
    of 5 rows; a GEMM from 16 rows) give every row, bit for bit, what a call with that row
    alone gives (the one-row path), with bias, at 1 and 2 threads; rows holding an infinity or
    a NaN too (NaN where it gives NaN)."""
    qweight, scale, _, _ = _weights(n, k, fmt, m + k + n)
    x = _x(m, k, m + k)
    x[m // 2] = 0  # a row of zeros
    x[m // 3, 5], x[m // 4, k - 1] = float("inf"), float("nan")  # rows the engine can't quantise
    b = torch.randn(n, generator=torch.Generator().manual_seed(m))
    kernel = _kernel(fmt)
    one = torch.cat([kernel(x[i : i + 1], qweight, scale, b) for i in range(m)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            got = kernel(x, qweight, scale, b)
            torch.testing.assert_close(got, one, rtol=0, atol=0, equal_nan=True, msg=str(t))
            finite = one.isfinite().all(1)
            assert torch.equal(got[finite], one[finite]) and int(finite.sum()) >= m - 2
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_empty_inputs_and_bad_inputs() -> None:
    qweight, scale = quantize_int8(torch.randn(8, 64))
    q4, s4 = quantize_int4(torch.randn(8, 64))
    w8a8, w4a8 = torch.ops.vllm_mamba.w8a8_linear, torch.ops.vllm_mamba.w4a8_linear
    assert w8a8(torch.zeros(0, 64), qweight, scale, None).shape == (0, 8)
    assert w4a8(torch.zeros(0, 64), q4, s4, None).shape == (0, 8)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        w8a8(torch.randn(2, 48), torch.zeros(8, 48, dtype=torch.int8), torch.ones(8), None)
    with pytest.raises(RuntimeError, match="x must be float32 or bfloat16"):
        w8a8(x.half(), qweight, scale, None)
    with pytest.raises(RuntimeError, match="qweight must be \\(N, K\\)"):
        w8a8(torch.randn(2, 96), qweight, scale, None)
    with pytest.raises(RuntimeError, match="qweight must be contiguous int8"):
        w8a8(x, qweight.float(), scale, None)
    with pytest.raises(RuntimeError, match="scale must be contiguous float32"):
        w8a8(x, qweight, scale[:4], None)
    with pytest.raises(RuntimeError, match="bias must be"):
        w8a8(x, qweight, scale, torch.zeros(3))
    with pytest.raises(RuntimeError, match="qweight must be \\(N, K / 2\\)"):
        w4a8(x, qweight, s4, None)
    with pytest.raises(RuntimeError, match="scales must be contiguous float16"):
        w4a8(x, q4, s4.float(), None)
    qk, sk = quantize_q4k(torch.randn(8, 64))
    assert torch.equal(w4a8(torch.zeros(0, 64), qk, sk, None), torch.zeros(0, 8))
    with pytest.raises(RuntimeError, match="Q4_K-style scales must be contiguous uint8"):
        w4a8(x, qk, sk[:, :8].contiguous(), None)


@needs_kernel
def test_the_kernels_without_vnni() -> None:
    """With VLLM_MAMBA_INT_DOT_VNNI=0 the same tests run the maddubs kernels (a process reads
    it once)."""
    env = dict(os.environ, VLLM_MAMBA_INT_DOT_VNNI="0")
    code = "from vllm_mamba.ops.int_dot_linear import int_dot_instruction as f; print(f())"
    probe = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert probe.stdout.strip() in ("maddubs", "scalar"), probe.stderr[-2000:]
    if int_dot_instruction() != "vpdpbusd":
        pytest.skip("this CPU runs the maddubs kernels already (the tests above)")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__]
    select = "(exact_products and 1024 and dtype0 and not 70) or quantise_x or batch"
    cmd += ["-k", select + " or (many_rows and not 1024)"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout


# The fused layers against their references with integer dots: the same kernels quantise the
# same inputs, but the layer's intermediates (norms, conv, state update) round differently in
# the two paths, and an input at a rounding boundary of its block may take the next code: one
# step `d = max|x| / 127` of one activation, times its weights (measured: at most 2.3e-6 apart
# where no step is taken). A row whose quantised inputs (in the reference) hold a value within
# NEAR_BOUNDARY (relative) of a rounding boundary is held to FLIP_ATOL instead (one step: the
# generic build's mamba2 case at batch 12 has one at 1.3e-6, which moved its output by 0.011).
FUSED_TOL = dict(rtol=1e-3, atol=1e-3)
NEAR_BOUNDARY = 4e-6
FLIP_ATOL = 0.1


def _rows_near_a_rounding_boundary(module, call) -> set[int]:  # noqa: ANN001
    """The rows of x whose int8-quantised inputs, in the reference `call()` (which multiplies
    through `module._linear`), hold a value within NEAR_BOUNDARY of a rounding boundary."""
    near: set[int] = set()
    for blocks in quantised_inputs(module, call):
        near |= set(near_boundary(blocks).tolist())
    return near


def quantised_inputs(module, call) -> list[torch.Tensor]:  # noqa: ANN001
    """The inputs of the integer-dot products of the reference `call()` (which multiplies
    through `module._linear`), in call order, each `(B, K / 32, 32)`."""
    inputs = []
    linear = module._linear

    def spy(x, weight, bias, scale=None, int_dot=False):  # noqa: ANN001, ANN202
        if int_dot and scale is not None:
            inputs.append(x.detach().float().reshape(x.shape[0], -1, 32))
        return linear(x, weight, bias, scale, int_dot)

    module._linear = spy
    try:
        call()
    finally:
        module._linear = linear
    return inputs


def near_boundary(blocks: torch.Tensor) -> torch.Tensor:
    """The rows of `blocks (B, K / 32, 32)` (a product's inputs in int8 blocks) holding a value
    within NEAR_BOUNDARY of a rounding boundary of its block's quantisation."""
    r = blocks / (blocks.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-30)
    gap = (r - r.floor() - 0.5).abs() / r.abs().clamp(min=1.0)
    return torch.nonzero(gap.flatten(1).amin(1) < NEAR_BOUNDARY).flatten()


@needs_kernel
@pytest.mark.parametrize("four_bit", [False, True], ids=["w8a8", "w4a8"])
@pytest.mark.parametrize("batch", [1, 3, 12])
@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_fused_decode_layers_with_integer_dots(kind: str, batch: int, four_bit: bool) -> None:
    from tests.ops import test_fused_decode as tfd
    from vllm_mamba.ops import cpu_kernels
    from vllm_mamba.ops import fused_decode as fd

    g = torch.Generator().manual_seed(batch * 10 + four_bit)
    dtype = tfd.INT4_F32 if four_bit else tfd.INT8_F32
    if kind == "mamba":
        params, conv, ssm = tfd._mamba_case(g, 64, 128, 16, 6, 4, True, True, dtype)
        args = (1e-5, -1.0, torch.float32)
        kernel, ref = cpu_kernels.fused_mamba_decode, fd.fused_mamba_decode_ref
    else:
        params, conv, ssm = tfd._mamba2_case(g, 64, 4, 32, 1, 128, 4, True, True, dtype)
        args = (1, 128, 1e-5, 1e-6, torch.float32)
        kernel, ref = cpu_kernels.fused_mamba2_decode, fd.fused_mamba2_decode_ref
    x = torch.randn(batch, 64, generator=g)

    def run(h, c, s, i):  # noqa: ANN001, ANN202
        return kernel(h, params, c, s, i, *args, None, True)

    def want(h, c, s, i):  # noqa: ANN001, ANN202
        return ref(h, params, c, s, i, *args, None, True)

    idx = tfd._indices(batch, True)
    near = _rows_near_a_rounding_boundary(fd, lambda: want(x, conv.clone(), ssm.clone(), idx))
    live = [b for b in range(batch) if idx[b] != tfd.PAD_SLOT_ID]
    far = [b for b in live if b not in near]
    assert 2 * len(far) >= len(live), near  # the tight comparison keeps its power
    conv_k, ssm_k, conv_r, ssm_r = conv.clone(), ssm.clone(), conv.clone(), ssm.clone()
    got, ref_out = run(x, conv_k, ssm_k, idx), want(x, conv_r, ssm_r, idx)
    torch.testing.assert_close(got[far], ref_out[far], **FUSED_TOL)
    slots = idx[far].long()
    torch.testing.assert_close(conv_k[slots], conv_r[slots], **FUSED_TOL)
    torch.testing.assert_close(ssm_k[slots], ssm_r[slots], **FUSED_TOL)
    for b in set(live) - set(far):
        assert float((got[b] - ref_out[b]).abs().max()) <= FLIP_ATOL, b
    # integer dots change the result: the weight-only reference is farther away
    plain = ref(x, params, conv.clone(), ssm.clone(), tfd._indices(batch, True), *args)
    assert not torch.allclose(plain, run(x, conv.clone(), ssm.clone(), tfd._indices(batch, True)))


@needs_kernel
def test_fused_decode_refuses_integer_dots_for_k_not_a_multiple_of_32() -> None:
    from tests.ops import test_fused_decode as tfd
    from vllm_mamba.ops import cpu_kernels

    g = torch.Generator().manual_seed(0)
    params, conv, ssm = tfd._mamba2_case(g, 48, 3, 32, 1, 8, 3, True, True, tfd.INT8_F32)
    x, idx = torch.randn(1, 48, generator=g), tfd._indices(1, False)
    with pytest.raises(RuntimeError, match="in_proj weight: integer dot products need K"):
        cpu_kernels.fused_mamba2_decode(
            x, params, conv, ssm, idx, 1, 96, 1e-5, 1e-6, torch.float32, None, True
        )
