"""The grouped routed-experts kernel (`ffn` family: `moe_experts`, `csrc/moe_experts.cpp`)
against its reference, and the reference against `SparseMoE`'s unfused dispatch.

Cases: 1 to 70 rows (experts chosen by a single row and by many: the integer-dot GEMM path from
`2 C` rows of an expert, the rows path below it); float32, int8 and 4-bit weights (weight-only,
the reference on the same quantised weights, within 1e-5), bfloat16 weights (bfloat16 products
as the unfused layer's, against the reference with its inputs and outputs rounded as they are),
int8, Q4_0- and Q4_K-style 4-bit weights with integer dot products (the reference's products on
quantised inputs: FUSED_TOL, a row whose quantised input lies at a rounding boundary within
FLIP_ATOL); SwiGLU clips; a row's result does not depend on the other rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_fused_ffn_decode import _int_dot_weight, _w, _weight
from tests.ops.test_int_dot_linear import (
    FLIP_ATOL,
    FMTS,
    FUSED_TOL,
    near_boundary,
    quantised_inputs,
)
from vllm_mamba.layers.clamped_swiglu import gated_mlp
from vllm_mamba.layers.moe import ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.ops import cpu_kernels, ffn
from vllm_mamba.ops.table import bind_ops

pytestmark = pytest.mark.skipif(
    "moe_experts" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

H, I, E, K = 64, 96, 8, 3  # hidden, expert width, experts, experts per row
CLIPS = {"none": (0.0, False), "after": (0.8, False), "before": (0.8, True)}


def _routing(g: torch.Generator, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights `(rows, K)` and K distinct expert ids per row, expert 0 chosen by most rows (so
    that one expert has many rows and others few)."""
    scores = torch.rand(rows, E, generator=g)
    scores[:, 0] += 0.5
    ids = scores.topk(K, dim=-1)[1]
    return torch.rand(rows, K, generator=g), ids


def _params(g: torch.Generator, fmt: str) -> list[torch.Tensor | None]:
    gate_up, down = _w(g, E * 2 * I, H), _w(g, E * H, I)
    if fmt in FMTS:
        (gu, gu_s), (dn, dn_s) = _int_dot_weight(gate_up, fmt), _int_dot_weight(down, fmt)
    else:
        (gu, gu_s), (dn, dn_s) = _weight(gate_up, fmt), _weight(down, fmt)
    return [gu, dn, gu_s, dn_s]


def _near_rows(ids: torch.Tensor, call) -> set[int]:  # noqa: ANN001
    """The rows whose int8-quantised inputs, in the reference `call()`, hold a value near a
    rounding boundary (`near_boundary`): the reference multiplies expert by expert (ascending
    id), its gate/up then its down product on that expert's rows."""
    inputs = quantised_inputs(ffn, call)
    experts = torch.unique(ids).tolist()
    assert len(inputs) == 2 * len(experts)
    near: set[int] = set()
    for i, e in enumerate(experts):
        rows = torch.where(ids == e)[0]
        for blocks in inputs[2 * i : 2 * i + 2]:  # (M, K / 32, 32)
            near |= set(rows[near_boundary(blocks)].tolist())
    return near


def _rows_alone(got: torch.Tensor, x: torch.Tensor, weights, ids, params, *args) -> None:  # noqa: ANN001
    for t in (0, x.shape[0] // 2, x.shape[0] - 1):
        one = cpu_kernels.moe_experts(x[t : t + 1], weights[t : t + 1], ids[t : t + 1], params,
                                      *args)  # fmt: skip
        assert torch.equal(got[t : t + 1], one), f"row {t}"


@pytest.mark.parametrize("rows", [1, 9, 70])
@pytest.mark.parametrize("fmt", ["float32", "int8", "int4"])
@pytest.mark.parametrize("clip", ["none", "after"])
def test_kernel_matches_reference(rows: int, fmt: str, clip: str) -> None:
    g = torch.Generator().manual_seed(rows * 11 + len(fmt) + len(clip))
    params = _params(g, fmt)
    x = torch.randn(rows, H, generator=g) * (4.0 if clip != "none" else 1.0)
    weights, ids = _routing(g, rows)
    args = (2, False, *CLIPS[clip])  # gelu (erf)
    got = cpu_kernels.moe_experts(x, weights, ids, params, *args)
    want = ffn.moe_experts_ref(x, weights, ids, params, *args)
    assert got.dtype == torch.float32 and got.shape == (rows, H)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if clip != "none":  # the clip binds
        assert (ffn.moe_experts_ref(x, weights, ids, params, 2) - want).abs().max() > 1e-3


# The kernel and the reference sum the same exact bfloat16 products in float32 in different
# orders: where a product's sum lies that close to a rounding midpoint, its bfloat16 rounding
# goes the other way (one bfloat16 step, 2^-8 of it), which moves the row's result by a few
# thousandths at these magnitudes. That is rare: at most a tenth of the rows.
BF16_FLIP_ATOL = 1e-2


@pytest.mark.parametrize("rows", [1, 9, 33, 70])
@pytest.mark.parametrize("dims", [(H, I), (50, 38)])
def test_bfloat16_weights_multiply_bfloat16_activations(rows: int, dims: tuple[int, int]) -> None:
    """With bfloat16 weights the products take bfloat16 inputs and give bfloat16 results, as
    the unfused layer's (`fused::project`), summed in float32: rows equal to the reference
    within 1e-5 but the rare one where a product's rounding flips (BF16_FLIP_ATOL). An expert
    of at most 64 rows runs `bf16_gemm` on a CPU with AVX512-BF16, one of more (70 rows: expert
    0) `mm`; (50, 38): a hidden size and width that are not whole tiles or vectors. Where the
    CPU has no bfloat16 instructions they widen to float32, the reference's own math."""
    h, i = dims
    g = torch.Generator().manual_seed(5 + rows)
    params = [_w(g, E * 2 * i, h).bfloat16(), _w(g, E * h, i).bfloat16(), None, None]
    x = torch.randn(rows, h, generator=g)
    weights, ids = _routing(g, rows)
    got = cpu_kernels.moe_experts(x, weights, ids, params, 0)
    if not torch.ops.vllm_mamba.native_bf16():
        torch.testing.assert_close(got, ffn.moe_experts_ref(x, weights, ids, params, 0))
        return
    gate_up, down = params[0].float(), params[1].float()
    want = torch.zeros(rows, h)
    for e in torch.unique(ids).tolist():
        r, pos = torch.where(ids == e)
        gu = (x[r].bfloat16().float() @ gate_up[e * 2 * i : (e + 1) * 2 * i].T).bfloat16()
        z = torch.nn.functional.silu(gu[:, :i].float()) * gu[:, i:].float()
        d = (z.bfloat16().float() @ down[e * h : (e + 1) * h].T).bfloat16().float()
        want.index_add_(0, r, d * weights[r, pos, None])
    diff = (got - want).abs()
    assert float(diff.max()) <= BF16_FLIP_ATOL
    tight = (diff <= 1e-5 + 1e-5 * want.abs()).all(-1)
    assert 10 * int((~tight).sum()) <= rows, (~tight).nonzero()


@pytest.mark.parametrize("rows", [1, 9, 70])
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_with_integer_dots_matches_reference(rows: int, fmt: str) -> None:
    g = torch.Generator().manual_seed(rows * 7 + len(fmt))
    params = _params(g, fmt)
    x = torch.randn(rows, H, generator=g)
    weights, ids = _routing(g, rows)
    got = cpu_kernels.moe_experts(x, weights, ids, params, 0, True)
    want = ffn.moe_experts_ref(x, weights, ids, params, 0, True)
    near = _near_rows(ids, lambda: ffn.moe_experts_ref(x, weights, ids, params, 0, True))
    far = [t for t in range(rows) if t not in near]
    assert rows < 4 or 2 * len(far) >= rows, near  # the tight comparison keeps its power
    torch.testing.assert_close(got[far], want[far], **FUSED_TOL)
    for t in near:
        assert float((got[t] - want[t]).abs().max()) <= FLIP_ATOL, t
    _rows_alone(got, x, weights, ids, params, 0, True)


def test_reference_is_the_unfused_layer() -> None:
    """The reference equals `SparseMoE`'s routed experts unfused (`dispatch_experts` over an
    `ExpertList` of clipped `GatedMLP`s, float32 accumulation)."""
    g = torch.Generator().manual_seed(3)
    ops = bind_ops("ref")
    experts = ExpertList(
        gated_mlp(H, I, False, ops, reduce=False, limit=0.8, before_act=False) for _ in range(E)
    )
    moe = SparseMoE(ExpertRouter(H, RouterConfig("softmax_topk", E, K, renormalize=True), ops),
                    experts, accumulate_fp32=True)  # fmt: skip
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(_w(g, *p.shape))
        x = torch.randn(20, H, generator=g) * 4.0
        want = moe(x)
        weights, ids = moe.router(x)
    gate_up = torch.cat([torch.cat([m.gate_proj.weight, m.up_proj.weight]) for m in experts])
    down = torch.cat([m.down_proj.weight for m in experts])
    params = [gate_up.detach(), down.detach(), None, None]
    got = ffn.moe_experts_ref(x, weights, ids, params, 0, False, 0.8, False)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("int_dot", [False, True])
def test_bfloat16_rows_and_no_rows(int_dot: bool) -> None:
    """bfloat16 rows are the float32 rows they widen to (the result float32); no rows, no
    result rows."""
    g = torch.Generator().manual_seed(6)
    params = _params(g, "w8a8" if int_dot else "float32")
    x = torch.randn(12, H, generator=g).bfloat16()
    weights, ids = _routing(g, 12)
    got = cpu_kernels.moe_experts(x, weights, ids, params, 0, int_dot)
    assert got.dtype == torch.float32
    assert torch.equal(got, cpu_kernels.moe_experts(x.float(), weights, ids, params, 0, int_dot))
    none = cpu_kernels.moe_experts(x[:0], weights[:0], ids[:0], params, 0, int_dot)
    assert none.shape == (0, H)


def test_bad_input_is_refused() -> None:
    g = torch.Generator().manual_seed(4)
    params = _params(g, "float32")
    x = torch.randn(4, H, generator=g)
    weights, ids = _routing(g, 4)
    with pytest.raises(RuntimeError, match="expert id 8 is not in"):
        cpu_kernels.moe_experts(x, weights, torch.full_like(ids, E), params, 0)
    with pytest.raises(RuntimeError, match="weights must be"):
        cpu_kernels.moe_experts(x, weights[:, :2], ids, params, 0)
    with pytest.raises(RuntimeError, match="act must be"):
        cpu_kernels.moe_experts(x, weights, ids, params, 9)
