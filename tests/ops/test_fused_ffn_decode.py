"""The fused feed-forward kernels (`ffn` family: `mlp_decode`, `moe_decode`) against their
references, and the references against the unfused layers.

Kernel cases: 1, 3 and 8 rows; float32 and bfloat16 weights, int8 and 4-bit weights
(`quantize_int8` / `quantize_int4`, the reference on the same quantised weights); separate or
merged gate and up weights; activations and multipliers; the MoE with softmax (renormalised or
not) and sigmoid routers (bias, groups), with and without a shared expert and its gate, and
top-k ties (the lower expert id wins, in kernel and reference alike). The references are checked
against `GatedMLP`, `ExpertRouter` and `SparseMoE` themselves (tie-free routing). With integer
dot products (`int_dot`: int8, Q4_0- and Q4_K-style 4-bit weights in the strip layout) the
kernels against the references' quantised-input products, as `tests/ops/test_int_dot_linear.py`
holds the fused Mamba layers.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_int_dot_linear import (
    FLIP_ATOL,
    FMTS,
    FUSED_TOL,
    _rows_near_a_rounding_boundary,
)
from vllm_mamba.layers.clamped_swiglu import gated_mlp
from vllm_mamba.layers.layernorm import RMSNorm
from vllm_mamba.layers.linear import Linear
from vllm_mamba.layers.mlp import GatedMLP
from vllm_mamba.layers.moe import ROUTER_KINDS, ExpertList, ExpertRouter, RouterConfig, SparseMoE
from vllm_mamba.ops import cpu_kernels, ffn
from vllm_mamba.ops.int4_linear import quantize_int4
from vllm_mamba.ops.int8_linear import quantize_int8
from vllm_mamba.ops.int_dot_linear import pack_w4a8, pack_w8a8
from vllm_mamba.ops.q4k import quantize_q4k
from vllm_mamba.ops.table import bind_ops

pytestmark = pytest.mark.skipif(
    "fused_moe_decode" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)

H, I, S, E = 64, 96, 64, 8  # hidden, expert / MLP width, shared width, experts (I: 3 groups)


def _w(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * shape[-1] ** -0.5


def _weight(w: torch.Tensor, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`w` as float32, bfloat16, int8 or 4-bit, with its scales."""
    if dtype == "int8":
        return quantize_int8(w)
    if dtype == "int4":
        return quantize_int4(w)
    return w.to(getattr(torch, dtype)).contiguous(), None


def _hidden(g: torch.Generator, rows: int) -> torch.Tensor:
    return torch.randn(rows, H, generator=g)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _rows_alone(got: torch.Tensor, hidden: torch.Tensor, op, *args) -> None:  # noqa: ANN001
    """Every row of `got = op(hidden, *args)` has the bits of that row called alone (a
    speculative chain's rows equal its tokens decoded one by one)."""
    for i in range(hidden.shape[0]):
        assert torch.equal(got[i : i + 1], op(hidden[i : i + 1], *args)), f"row {i}"


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("merged", [False, True])
def test_mlp_kernel_matches_reference(rows: int, dtype: str, merged: bool) -> None:
    g = torch.Generator().manual_seed(rows * 7 + len(dtype) + merged)
    gate, up, down = _w(g, I, H), _w(g, I, H), _w(g, H, I)
    if merged:
        gate_w, gate_s = _weight(torch.cat([gate, up]), dtype)
        up_w = up_s = None
    else:
        (gate_w, gate_s), (up_w, up_s) = _weight(gate, dtype), _weight(up, dtype)
    down_w, down_s = _weight(down, dtype)
    norm = 1.0 + 0.1 * torch.randn(H, generator=g)
    params = list(ffn.MlpParams(norm, gate_w, up_w, down_w, gate_s, up_s, down_s))
    hidden = _hidden(g, rows)
    for act, gm, dm, rm in ((0, 1.0, 1.0, 1.0), (1, 0.5, 2.0, 0.25), (4, 1.0, 1.0, 1.0)):
        args = (1e-6, act, gm, dm, rm, torch.float32)
        want = ffn.fused_mlp_decode_ref(hidden, params, *args)
        got = cpu_kernels.fused_mlp_decode(hidden, params, *args)
        _close(got, want)
        _rows_alone(got, hidden, cpu_kernels.fused_mlp_decode, params, *args)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", ["float32", "int4"])
@pytest.mark.parametrize("form", ["clip-before", "clip-after", "streams"])
def test_mlp_clips_and_stage_alone_match_reference(rows: int, dtype: str, form: str) -> None:
    """A clipped SwiGLU (`ClampedGatedMLP`, before or after the activation), and the stage
    inside residual streams (no norm weight, no residual): kernel against reference, and the
    reference against the unfused layer."""
    g = torch.Generator().manual_seed(rows * 3 + len(dtype) + len(form))
    ops = bind_ops("ref")
    limit = 0.0 if form == "streams" else 0.6
    mlp = gated_mlp(H, I, False, ops, limit=limit, before_act=form == "clip-before")
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(_w(g, *p.shape))
    (gate_w, gate_s), (up_w, up_s) = (_weight(mlp.gate_proj.weight.detach(), dtype),
                                      _weight(mlp.up_proj.weight.detach(), dtype))  # fmt: skip
    down_w, down_s = _weight(mlp.down_proj.weight.detach(), dtype)
    streams = form == "streams"
    norm = None if streams else torch.ones(H)
    params = list(ffn.MlpParams(norm, gate_w, up_w, down_w, gate_s, up_s, down_s))
    hidden = _hidden(g, rows) * (1.0 if streams else 4.0)  # the clips bind on large products
    args = (1e-6, 0, 1.0, 1.0, 0.5, torch.float32, False, not streams, limit, mlp.before_act
            if limit else False)  # fmt: skip
    want = ffn.fused_mlp_decode_ref(hidden, params, *args)
    got = cpu_kernels.fused_mlp_decode(hidden, params, *args)
    _close(got, want)
    _rows_alone(got, hidden, cpu_kernels.fused_mlp_decode, params, *args)
    if dtype == "float32":  # the layer: `h + 0.5 mlp(rms(h))`, or `0.5 mlp(h)` in streams
        with torch.no_grad():
            x = hidden if streams else hidden * torch.rsqrt(hidden.pow(2).mean(-1, True) + 1e-6)
            layer = 0.5 * mlp(x) + (0.0 if streams else hidden)
        _close(want, layer)


def test_mlp_bfloat16_activations() -> None:
    """A bfloat16 model's rows: float32 inside, the result rounded once."""
    g = torch.Generator().manual_seed(5)
    params = [torch.ones(H), _w(g, I, H).bfloat16(), _w(g, I, H).bfloat16(),
              _w(g, H, I).bfloat16(), None, None, None]  # fmt: skip
    hidden = _hidden(g, 3).bfloat16()
    args = (1e-6, 0, 1.0, 1.0, 1.0, torch.bfloat16)
    got = cpu_kernels.fused_mlp_decode(hidden, params, *args)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, ffn.fused_mlp_decode_ref(hidden, params, *args))


def test_mlp_reference_is_the_layer() -> None:
    """The reference equals `h + GatedMLP(RMSNorm(h))` run by the unfused layers."""
    g = torch.Generator().manual_seed(1)
    ops = bind_ops("ref")
    mlp, norm = GatedMLP(H, I, False, ops, gate_multiplier=0.5, down_multiplier=3.0), RMSNorm(H)
    with torch.no_grad():
        for p in (*mlp.parameters(), norm.weight):
            p.copy_(_w(g, *p.shape) if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
        hidden = _hidden(g, 3)
        want = hidden + mlp(norm(hidden))
    params = [norm.weight.detach(), mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach(),
              mlp.down_proj.weight.detach(), None, None, None]  # fmt: skip
    got = ffn.fused_mlp_decode_ref(hidden, params, 1e-6, 0, 0.5, 3.0, 1.0, torch.float32)
    _close(got, want)


def _moe_params(
    g: torch.Generator, dtype: str, shared: str, bias: bool, tie: bool = False
) -> list[torch.Tensor | None]:
    """MoE params; `shared`: "none", "plain", "gated" or "merged" (a merged, ungated one)."""
    router = _w(g, E, H)
    if tie:  # experts 2 and 5 score alike, as do 3 and 6
        router[5], router[6] = router[2], router[3]
    gate_up, gu_s = _weight(_w(g, E * 2 * I, H), dtype)
    down, dn_s = _weight(_w(g, E * H, I), dtype)
    p = dict.fromkeys(ffn.MOE_PARAMS)
    p.update(norm_w=1.0 + 0.1 * torch.randn(H, generator=g), router_w=router,
             experts_gate_up_w=gate_up, experts_down_w=down, experts_gate_up_scale=gu_s,
             experts_down_scale=dn_s)  # fmt: skip
    if bias:
        p["router_bias"] = 0.1 * torch.randn(E, generator=g)
    if shared == "merged":
        p["shared_gate_w"], p["shared_gate_scale"] = _weight(_w(g, 2 * S, H), dtype)
    elif shared != "none":
        p["shared_gate_w"], p["shared_gate_scale"] = _weight(_w(g, S, H), dtype)
        p["shared_up_w"], p["shared_up_scale"] = _weight(_w(g, S, H), dtype)
    if shared != "none":
        p["shared_down_w"], p["shared_down_scale"] = _weight(_w(g, H, S), dtype)
    if shared == "gated":
        p["shared_expert_gate_w"], p["shared_expert_gate_scale"] = _weight(_w(g, 1, H), dtype)
    return list(ffn.MoeParams(**p))


# Router args: top_k, kind, renormalize, n_group, topk_group, scaling, renorm_eps.
ROUTERS = {
    "softmax-renorm": (3, ffn.ROUTER_SOFTMAX, True, 1, 1, 1.0, 0.0),
    "softmax": (2, ffn.ROUTER_SOFTMAX, False, 1, 1, 1.0, 0.0),
    "sigmoid": (3, ffn.ROUTER_SIGMOID, True, 1, 1, 2.5, 1e-6),
    "sigmoid-grouped": (2, ffn.ROUTER_SIGMOID, True, 4, 2, 1.5, 1e-20),
}


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize(
    ("router", "shared"),
    [("softmax-renorm", "gated"), ("softmax", "none"), ("sigmoid", "plain"),
     ("sigmoid-grouped", "merged")],
)  # fmt: skip
def test_moe_kernel_matches_reference(rows: int, dtype: str, router: str, shared: str) -> None:
    g = torch.Generator().manual_seed(rows * 13 + len(dtype) + len(router))
    params = _moe_params(g, dtype, shared, bias=router.startswith("sigmoid"))
    hidden = _hidden(g, rows)
    args = (*ROUTERS[router], 1e-6, 0, 0.5, torch.float32)
    want = ffn.fused_moe_decode_ref(hidden, params, *args)
    got = cpu_kernels.fused_moe_decode(hidden, params, *args)
    _close(got, want)
    _rows_alone(got, hidden, cpu_kernels.fused_moe_decode, params, *args)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int4"])
@pytest.mark.parametrize("normed", [True, False])
def test_moe_stage_inside_streams_matches_reference(rows: int, dtype: str, normed: bool) -> None:
    """Without the residual (`rm * ffn(x)` alone) and, without a norm weight, on the input
    itself (a stage between a residual-stream connection's ends): the reference's, which is
    the residual form minus the input (the form with a norm)."""
    g = torch.Generator().manual_seed(rows * 7 + len(dtype))
    params = _moe_params(g, dtype, "gated", bias=False)
    if not normed:
        params[ffn.MOE_PARAMS.index("norm_w")] = None
    hidden = _hidden(g, rows)
    args = (*ROUTERS["softmax-renorm"], 1e-6, 0, 0.5, torch.float32, False, False)
    want = ffn.fused_moe_decode_ref(hidden, params, *args)
    got = cpu_kernels.fused_moe_decode(hidden, params, *args)
    _close(got, want)
    _rows_alone(got, hidden, cpu_kernels.fused_moe_decode, params, *args)
    if normed:  # the same stage with its residual, less the input
        full = ffn.fused_moe_decode_ref(hidden, params, *args[:-1])
        _close(want, full - hidden)
    else:  # no norm: the reference on the input, as the normed form on an RMS-1 input
        unit = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        ones = list(params)
        ones[ffn.MOE_PARAMS.index("norm_w")] = torch.ones(H)
        _close(ffn.fused_moe_decode_ref(unit, params, *args),
               ffn.fused_moe_decode_ref(unit, ones, *args))  # fmt: skip


@pytest.mark.parametrize("router", ["softmax-renorm", "sigmoid"])
def test_moe_ties_choose_the_lower_expert(router: str) -> None:
    """Experts 2 and 5 (and 3 and 6) have equal logits: top-k breaks ties by ascending id."""
    g = torch.Generator().manual_seed(3)
    params = _moe_params(g, "float32", "none", bias=False, tie=True)
    hidden = _hidden(g, 8)
    args = list(ROUTERS[router])
    logits = ffn._linear(ffn._rms_norm(hidden, params[0], 1e-6), params[1], None)
    order = torch.sort(logits, dim=-1, descending=True, stable=True)[1]
    weights, chosen = ffn.route_ref(logits, *args, None)
    for b in range(hidden.shape[0]):  # a tie that straddles the k-th place keeps the lower id
        ids = set(chosen[b].tolist())
        assert chosen[b].tolist() == order[b, : args[0]].tolist()
        assert all(high not in ids or low in ids for low, high in ((2, 5), (3, 6)))
    for k in range(1, E):  # some k splits a tied pair
        args[0] = k
        call = (*args, 1e-6, 0, 1.0, torch.float32)
        want = ffn.fused_moe_decode_ref(hidden, params, *call)
        _close(cpu_kernels.fused_moe_decode(hidden, params, *call), want)


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_route_reference_is_the_router(kind: str) -> None:
    """`route_ref` chooses and weights as `ExpertRouter` (tie-free logits)."""
    g = torch.Generator().manual_seed(11)
    grouped = kind == "sigmoid_grouped"
    config = RouterConfig(kind, E, 3, renormalize=True, n_group=4 if grouped else 1,
                          topk_group=2 if grouped else 1, scaling=1.7,
                          score_bias=kind.startswith("sigmoid"), renorm_eps=1e-6)  # fmt: skip
    router = ExpertRouter(H, config)
    with torch.no_grad():
        router.weight.copy_(_w(g, E, H))
        if config.score_bias:
            router.e_score_correction_bias.copy_(0.1 * torch.randn(E, generator=g))
        x = _hidden(g, 5)
        weights, chosen = router(x)
    logits = x @ router.weight.detach().T
    bias = router.e_score_correction_bias.detach() if config.score_bias else None
    kind_code = 0 if kind in ("softmax_topk", "topk_softmax") else ffn.ROUTER_SIGMOID
    got_w, got_c = ffn.route_ref(logits, 3, kind_code, True, config.n_group, config.topk_group,
                                 config.scaling if kind_code else 1.0, 1e-6, bias)  # fmt: skip
    order, got_order = chosen.sort(dim=-1), got_c.sort(dim=-1)
    assert torch.equal(order.values, got_order.values)
    _close(got_w.gather(1, got_order.indices), weights.gather(1, order.indices))


# SwiGLU clips (`ClampedGatedMLP`): (routed, shared, before the activation); 0 none.
CLIPS = {"none": (0.0, 0.0, False), "after": (0.8, 0.5, False), "before": (0.8, 0.0, True)}


@pytest.mark.parametrize("clip", sorted(CLIPS))
def test_moe_reference_is_the_layer(clip: str) -> None:
    """The reference equals `h + SparseMoE(RMSNorm(h))` (experts of `GatedMLP`s, a gated shared
    expert; with SwiGLU clips `ClampedGatedMLP`s), the unfused layers."""
    g = torch.Generator().manual_seed(2)
    ops = bind_ops("ref")
    config = RouterConfig("softmax_topk", E, 3, renormalize=True)
    limit, shared_limit, before = CLIPS[clip]
    experts = ExpertList(
        gated_mlp(H, I, False, ops, reduce=False, limit=limit, before_act=before) for _ in range(E)
    )
    shared = gated_mlp(H, S, False, ops, limit=shared_limit, before_act=before)
    moe = SparseMoE(ExpertRouter(H, config, ops), experts, shared=shared,
                    shared_gate=Linear(H, 1, False, ops))  # fmt: skip
    norm = RMSNorm(H)
    with torch.no_grad():
        for p in (*moe.parameters(), norm.weight):
            p.copy_(_w(g, *p.shape) if p.dim() > 1 else 1 + 0.1 * torch.randn(p.shape))
        hidden = _hidden(g, 4)
        want = hidden + moe(norm(hidden))
    p = dict.fromkeys(ffn.MOE_PARAMS)
    p.update(
        norm_w=norm.weight.detach(), router_w=moe.router.weight.detach(),
        experts_gate_up_w=torch.cat([torch.cat([m.gate_proj.weight, m.up_proj.weight])
                                     for m in experts]).detach(),
        experts_down_w=torch.cat([m.down_proj.weight for m in experts]).detach(),
        shared_gate_w=shared.gate_proj.weight.detach(), shared_up_w=shared.up_proj.weight.detach(),
        shared_down_w=shared.down_proj.weight.detach(),
        shared_expert_gate_w=moe.shared_expert_gate.weight.detach(),
    )  # fmt: skip
    args = (*ROUTERS["softmax-renorm"], 1e-6, 0, 1.0, torch.float32, False, True, *CLIPS[clip])
    got = ffn.fused_moe_decode_ref(hidden, list(ffn.MoeParams(**p)), *args)
    _close(got, want)
    if clip != "none":  # the clips bind
        unclipped = ffn.fused_moe_decode_ref(
            hidden,
            list(ffn.MoeParams(**p)),
            *ROUTERS["softmax-renorm"],
            1e-6,
            0,
            1.0,
            torch.float32,
        )
        assert (unclipped - got).abs().max() > 1e-3


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("dtype", ["float32", "int4"])
@pytest.mark.parametrize("clip", ["after", "before"])
def test_moe_clipped_kernel_matches_reference(rows: int, dtype: str, clip: str) -> None:
    g = torch.Generator().manual_seed(rows * 5 + len(dtype) + len(clip))
    params = _moe_params(g, dtype, "gated", bias=False)
    hidden = _hidden(g, rows) * 4.0  # products large enough for the clips to bind
    args = (*ROUTERS["softmax-renorm"], 1e-6, 0, 0.5, torch.float32, False, True, *CLIPS[clip])
    want = ffn.fused_moe_decode_ref(hidden, params, *args)
    got = cpu_kernels.fused_moe_decode(hidden, params, *args)
    _close(got, want)
    _rows_alone(got, hidden, cpu_kernels.fused_moe_decode, params, *args)


def test_bad_input_is_refused() -> None:
    g = torch.Generator().manual_seed(4)
    params = _moe_params(g, "float32", "none", bias=False)
    hidden = _hidden(g, 9)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        cpu_kernels.fused_moe_decode(hidden, params, *ROUTERS["softmax"], 1e-6, 0, 1.0,
                                     torch.float32)  # fmt: skip
    with pytest.raises(RuntimeError, match="top_k"):
        cpu_kernels.fused_moe_decode(hidden[:1], params, 0, 0, True, 1, 1, 1.0, 0.0, 1e-6, 0,
                                     1.0, torch.float32)  # fmt: skip


def _int_dot_weight(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` quantised for integer dot products (`fmt` a `FMTS` entry), in the strip layout."""
    if fmt == "w8a8":
        qweight, scale = quantize_int8(w)
        return pack_w8a8(qweight), scale
    return pack_w4a8(*(quantize_q4k(w) if fmt == "w4a8_k" else quantize_int4(w)))


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("kind", ["mlp", "moe"])
def test_kernels_with_integer_dots_match_reference(rows: int, fmt: str, kind: str) -> None:
    """The MLP (merged gate and up) and the MoE (softmax router, gated shared expert) with
    integer-dot weights against the references' products on quantised inputs (FUSED_TOL; a
    row with an input at a rounding boundary of its block within FLIP_ATOL); rows alone."""
    g = torch.Generator().manual_seed(rows * 7 + len(fmt) + len(kind))
    if kind == "mlp":
        params = [1.0 + 0.1 * torch.randn(H, generator=g), *_int_dot_weight(_w(g, 2 * I, H), fmt)]
        down = _int_dot_weight(_w(g, H, I), fmt)
        p = dict(zip(ffn.MLP_PARAMS, [params[0], params[1], None, down[0], params[2], None,
                                      down[1]]))  # fmt: skip
        params = list(ffn.MlpParams(**p))
        args = (1e-6, 0, 1.0, 1.0, 1.0, torch.float32, True)
        kernel, ref = cpu_kernels.fused_mlp_decode, ffn.fused_mlp_decode_ref
    else:
        p = dict(zip(ffn.MOE_PARAMS, _moe_params(g, "float32", "gated", bias=False)))
        for name in ("experts_gate_up", "experts_down", "shared_gate", "shared_up",
                     "shared_down", "shared_expert_gate"):  # fmt: skip
            p[f"{name}_w"], p[f"{name}_scale"] = _int_dot_weight(p[f"{name}_w"], fmt)
        params = list(ffn.MoeParams(**p))
        args = (*ROUTERS["softmax-renorm"], 1e-6, 0, 0.5, torch.float32, True)
        kernel, ref = cpu_kernels.fused_moe_decode, ffn.fused_moe_decode_ref
    hidden = _hidden(g, rows)
    got, want = kernel(hidden, params, *args), ref(hidden, params, *args)
    near = _rows_near_a_rounding_boundary(ffn, lambda: ref(hidden, params, *args))
    far = [b for b in range(rows) if b not in near]
    assert 2 * len(far) >= rows, near  # the tight comparison keeps its power
    torch.testing.assert_close(got[far], want[far], **FUSED_TOL)
    for b in near:
        assert float((got[b] - want[b]).abs().max()) <= FLIP_ATOL, b
    _rows_alone(got, hidden, kernel, params, *args)
