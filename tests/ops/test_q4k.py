"""The Q4_K-style 4-bit layout (`vllm_mamba.ops.q4k`, `quantization="w4a8_k"`).

- The scale bytes against the layout written out by hand (one super-block's 16 bytes), and
  `pack_scales` / `unpack_scales` as inverses over random 6-bit values and float16 scales.
- `quantize_q4k`: codes in [0, 15], 4.5 bits a weight, a weight representable in the layout
  comes back within the 6-bit scales' rounding, zero rows stay zero, a partial last
  super-block (K a multiple of 32 only), and a lower error than the Q4_0-style groups of
  `quantize_int4` at the same bytes on Gaussian, heavy-tailed and off-centre rows; for the
  reference (`quantize_q4k_ref`) and the C++ quantiser alike.
- The C++ quantiser against the reference: the same bytes for most super-blocks (its sums run
  in another order, so a near-tie between candidate scales may fall the other way) and the
  same error; every ISA level gives the same bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from vllm_mamba.ops import cpu_isa
from vllm_mamba.ops.grouped_linear import pack_nibbles, unpack_nibbles
from vllm_mamba.ops.int4_linear import dequantize_int4, quantize_int4
from vllm_mamba.ops.q4k import (
    dequantize_q4k,
    pack_scales,
    quantize_q4k,
    quantize_q4k_ref,
    super_blocks,
    unpack_scales,
)

HAS_CPP = cpu_isa.has_op("q4k_quantize")
needs_cpp = pytest.mark.skipif(not HAS_CPP, reason="C++ extension not built")
QUANTISERS = [
    pytest.param(quantize_q4k_ref, id="ref"),
    pytest.param(quantize_q4k, id="cpp", marks=needs_cpp),
]


def test_scale_bytes_follow_the_layout() -> None:
    """d = 1.0, dmin = 0.5; block 0: sc 63, m 5; block 1: sc 17, m 40; block 7: sc 1, m 63."""
    sc = torch.zeros(1, 1, 8, dtype=torch.uint8)
    m = torch.zeros(1, 1, 8, dtype=torch.uint8)
    sc[0, 0, 0], m[0, 0, 0] = 63, 5
    sc[0, 0, 1], m[0, 0, 1] = 17, 40
    sc[0, 0, 7], m[0, 0, 7] = 1, 63
    d = torch.tensor([[1.0]], dtype=torch.float16)
    dmin = torch.tensor([[0.5]], dtype=torch.float16)
    got = pack_scales(d, dmin, sc, m)[0].tolist()
    want = [0x00, 0x3C, 0x00, 0x38]  # float16 1.0 and 0.5, little-endian
    want += [0x5F, 0x81, 0, 0, 0, 0, 0, 0xF1]  # sc & 15 | (m & 15) << 4
    want += [0x3 | (0x1 << 4) | (0x2 << 6), 0, 0, 0x3 << 6]  # high bits of blocks 0-1, ..., 6-7
    assert got == want
    ds, dm = unpack_scales(torch.tensor([got], dtype=torch.uint8), 256)
    assert ds[0, :2].tolist() == [63.0, 17.0] and ds[0, 7].item() == 1.0
    assert dm[0, :2].tolist() == [2.5, 20.0] and dm[0, 7].item() == 31.5


def test_pack_and_unpack_scales_are_inverses() -> None:
    g = torch.Generator().manual_seed(0)
    n, ns = 5, 3
    sc = torch.randint(0, 64, (n, ns, 8), generator=g, dtype=torch.uint8)
    m = torch.randint(0, 64, (n, ns, 8), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, ns, generator=g) * 4).to(torch.float16)
    dmin = (torch.rand(n, ns, generator=g) * 100).to(torch.float16)
    d[0, 0] = 60000.0  # the sign-bit byte
    ds, dm = unpack_scales(pack_scales(d, dmin, sc, m), ns * 256)
    assert torch.equal(ds, (d.float()[..., None] * sc.float()).reshape(n, -1))
    assert torch.equal(dm, (dmin.float()[..., None] * m.float()).reshape(n, -1))


@pytest.mark.parametrize("k", [32, 192, 256, 800, 1024])
@pytest.mark.parametrize("quantise", QUANTISERS)
def test_shapes_codes_and_bits_per_weight(k: int, quantise) -> None:  # noqa: ANN001
    w = torch.randn(24, k, generator=torch.Generator().manual_seed(k))
    codes, scales = quantise(w)
    assert codes.shape == (24, k // 2) and codes.dtype == torch.uint8
    assert scales.shape == (24, super_blocks(k) * 16) and scales.dtype == torch.uint8
    assert int(unpack_nibbles(codes).max()) <= 15
    if k % 256 == 0:
        assert (codes.numel() + scales.numel()) * 8 / w.numel() == 4.5


@pytest.mark.parametrize("quantise", QUANTISERS)
def test_a_representable_weight_comes_back(quantise) -> None:  # noqa: ANN001
    """Blocks that are exactly `a c - m` (a, m per block, c in [0, 15] using the whole range)
    come back within the 6-bit rounding of a and m."""
    g = torch.Generator().manual_seed(1)
    n, k = 8, 512
    c = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    c[..., 0], c[..., 1] = 0, 15
    a = 0.01 + torch.rand(n, k // 32, 1, generator=g) * 0.02
    m = torch.rand(n, k // 32, 1, generator=g) * 0.1
    w = (a * c - m).reshape(n, k)
    back = dequantize_q4k(*quantise(w), torch.float32)
    # one 6-bit step of the largest scale / min of the super-block, times the codes' range
    step = (a.amax() / 63) * 15 + m.amax() / 63
    assert float((back - w).abs().max()) <= float(step)


@pytest.mark.parametrize("quantise", QUANTISERS)
def test_zero_rows_and_blocks_stay_zero(quantise) -> None:  # noqa: ANN001
    w = torch.randn(4, 512, generator=torch.Generator().manual_seed(2))
    w[1] = 0
    w[2, 32:64] = 0
    back = dequantize_q4k(*quantise(w), torch.float32)
    assert torch.equal(back[1], torch.zeros(512))
    assert torch.equal(back[2, 32:64], torch.zeros(32))


@pytest.mark.parametrize("quantise", QUANTISERS)
def test_bad_shapes_are_value_errors(quantise) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantise(torch.randn(4, 48))
    with pytest.raises(ValueError, match="K a multiple of 32"):
        quantise(torch.randn(64))


@pytest.mark.parametrize("rows", ["gaussian", "student-t", "off-centre"])
@pytest.mark.parametrize("quantise", QUANTISERS)
def test_lower_error_than_q4_0_at_the_same_bytes(rows: str, quantise) -> None:  # noqa: ANN001
    g = torch.Generator().manual_seed(3)
    w = torch.randn(256, 1024, generator=g)
    if rows == "student-t":  # heavy tails: a few large weights per block
        w = w / torch.sqrt(torch.distributions.Chi2(3.0).sample((256, 1024)) / 3)
    elif rows == "off-centre":
        w = 0.02 * w + 0.01
    q4k = dequantize_q4k(*quantise(w), torch.float32)
    q40 = dequantize_int4(*quantize_int4(w), torch.float32)
    err_k, err_0 = (q4k - w).pow(2).mean(), (q40 - w).pow(2).mean()
    assert float(err_k) < 0.85 * float(err_0), (float(err_k), float(err_0))


@pytest.mark.parametrize("quantise", QUANTISERS)
def test_codes_pack_as_the_engines_int4(quantise) -> None:  # noqa: ANN001
    """The codes use `pack_nibbles`' layout (byte i of a block: column i low, i + 16 high)."""
    w = torch.randn(16, 256, generator=torch.Generator().manual_seed(4))
    codes, scales = quantise(w)
    assert torch.equal(pack_nibbles(unpack_nibbles(codes)), codes)
    ds, dm = unpack_scales(scales, 256)
    want = unpack_nibbles(codes).float().reshape(16, 8, 32) * ds[..., None] - dm[..., None]
    assert torch.equal(dequantize_q4k(codes, scales, torch.float32), want.reshape(16, 256))


@needs_cpp
@pytest.mark.parametrize("rows", ["gaussian", "off-centre"])
def test_the_cpp_quantiser_agrees_with_the_reference(rows: str) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(512, 800, generator=g)  # 25 groups: 3 super-blocks and a partial one
    if rows == "off-centre":
        w = 0.02 * w + 0.01
    codes, scales = quantize_q4k(w)
    ref_codes, ref_scales = quantize_q4k_ref(w)
    same = (scales.reshape(512, -1, 16) == ref_scales.reshape(512, -1, 16)).all(-1)
    assert float(same.float().mean()) >= 0.9, float(same.float().mean())
    err = (dequantize_q4k(codes, scales, torch.float32) - w).pow(2).mean()
    ref_err = (dequantize_q4k(ref_codes, ref_scales, torch.float32) - w).pow(2).mean()
    assert abs(float(err) / float(ref_err) - 1) <= 0.01, (float(err), float(ref_err))


@needs_cpp
def test_every_isa_level_quantises_to_the_same_bytes() -> None:
    code = (
        "import hashlib, torch\n"
        "from vllm_mamba.ops import cpu_isa\n"
        "from vllm_mamba.ops.q4k import quantize_q4k\n"
        "w = torch.randn(64, 800, generator=torch.Generator().manual_seed(6))\n"
        "c, s = quantize_q4k(w)\n"
        "h = hashlib.sha256(c.numpy().tobytes() + s.numpy().tobytes()).hexdigest()\n"
        "print('RESULT', cpu_isa.active_level(), h)\n"
    )
    digests = {}
    for level in cpu_isa.supported_levels():
        env = dict(os.environ, **{cpu_isa.ENV_VAR: level})
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        line = [x for x in done.stdout.splitlines() if x.startswith("RESULT")]
        assert line, done.stderr[-2000:]
        _, got_level, digest = line[-1].split()
        assert got_level == level
        digests[level] = digest
    assert len(set(digests.values())) == 1, digests
