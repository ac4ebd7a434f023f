"""The op registry (`vllm_mamba.ops.families`): a backend's own ops where registered, the `_ref`s
everywhere else, typed signatures checked, and clear errors for bad registrations."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterator
from typing import Protocol

import pytest
import torch.nn.functional as F

from vllm_mamba.ops import cpu_kernels, families
from vllm_mamba.ops.dispatch import REF_OPS
from vllm_mamba.ops.families import (
    OpFamily,
    OpSpec,
    family_ops,
    has_own_op,
    register_family,
    register_op_family,
    register_op_impl,
    registered_families,
)
from vllm_mamba.ops.table import FIELDS, MambaOps, bind_ops

BUILTIN = (
    "causal_conv1d", "selective_scan", "ssd", "gated_rms_norm", "paged_attention", "linear",
    "fused_decode", "gated_delta", "kda", "mla", "short_conv", "rwkv7", "rwkv4",
    "lightning_attention", "mlstm",
)  # fmt: skip


def _ref_a(x: int) -> int:
    return x + 1


def _ref_b(x: int) -> int:
    return x * 2


def _fast_a(x: int) -> int:
    return x + 1  # the same result, another function


def _wrong_names(y: int) -> int:
    return y + 1


class _AOp(Protocol):
    def __call__(self, x: int) -> int: ...


@pytest.fixture
def family() -> Iterator[str]:
    register_op_family("test_family", {"a": _ref_a, "b": _ref_b})
    yield "test_family"
    families._FAMILIES.pop("test_family", None)
    for key in [k for k in families._IMPLS if k[0] == "test_family"]:
        families._IMPLS.pop(key)


def test_a_backend_without_its_own_ops_gets_the_references(family: str) -> None:
    ops = REF_OPS.family(family)
    assert ops.a is _ref_a and ops.b is _ref_b


def test_a_backend_overrides_only_what_it_registers(family: str) -> None:
    register_op_impl(family, "cpp", a=_fast_a)
    cpp = family_ops(family, "cpp")
    assert cpp.a is _fast_a and cpp.b is _ref_b
    assert has_own_op(family, "cpp", "a") and not has_own_op(family, "cpp", "b")
    assert REF_OPS.family(family).a is _ref_a  # other backends keep the reference


def test_unknown_family_and_op_are_refused(family: str) -> None:
    with pytest.raises(KeyError, match="not registered"):
        REF_OPS.family("no_such_family")
    with pytest.raises(ValueError, match=r"has no ops \['c'\]"):
        register_op_impl(family, "cpp", c=_ref_a)
    with pytest.raises(ValueError, match="is not registered"):
        register_op_impl("no_such_family", "cpp", a=_ref_a)
    with pytest.raises(ValueError, match="callable"):
        register_op_family("bad", {"a": 3})
    with pytest.raises(ValueError, match="callable"):
        register_op_family("bad", {})
    with pytest.raises(ValueError, match="not callable"):
        register_op_impl(family, "cpp", a=3)
    assert "bad" not in registered_families()


def test_an_impl_with_other_parameters_is_refused(family: str) -> None:
    """Layers call ops with keyword arguments: an implementation must take the reference's."""
    with pytest.raises(ValueError, match=r"parameters \['y'\] differ from \['x'\]"):
        register_op_impl(family, "cpp", a=_wrong_names)
    assert not has_own_op(family, "cpp", "a")


def test_a_reference_must_match_its_protocol() -> None:
    with pytest.raises(ValueError, match="reference: parameters"):
        register_family(OpFamily("typed_bad", {"a": OpSpec(_AOp, _wrong_names)}))
    register_family(OpFamily("typed_ok", {"a": OpSpec(_AOp, _ref_a)}))
    try:
        with pytest.raises(ValueError, match="differ"):
            register_op_impl("typed_ok", "cpp", a=_wrong_names)
    finally:
        families._FAMILIES.pop("typed_ok")
    assert "typed_bad" not in registered_families()


def test_every_builtin_family_is_typed_and_its_refs_are_the_ref_default() -> None:
    """Every built-in op has a protocol whose parameters are its reference's, and the `ref`
    backend runs the reference of every op."""
    assert set(BUILTIN) <= set(registered_families())
    for name in BUILTIN:
        fam = registered_families()[name]
        ref_ops = family_ops(name, "ref")
        for op, spec in fam.ops.items():
            assert spec.protocol is not None, f"{name}.{op} has no protocol"
            assert getattr(ref_ops, op) is spec.ref
            want = families.parameter_names(spec.protocol.__call__)
            got = families.parameter_names(spec.ref)
            assert got is None or len(got) == len(want)
            assert got is None or all(w is None or g == w for g, w in zip(got, want)), (name, op)


def test_the_ref_table_holds_the_references() -> None:
    for field, (name, op) in FIELDS.items():
        want = None if name == "fused_decode" else registered_families()[name].ops[op].ref
        assert getattr(REF_OPS, field) is want, field
    assert REF_OPS.linear is F.linear
    assert set(FIELDS) == {f for f in inspect.signature(MambaOps).parameters if f != "name"}


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
def test_the_cpp_table_overrides_every_op_it_has_a_kernel_for() -> None:
    """Each kernel of `CPP_OPS` is the `cpp` backend's op (the wrapper under its name in
    `cpu_kernels`); the ops it has no kernel for stay the references."""
    for op in cpu_kernels.CPP_OPS:
        assert getattr(family_ops(op.family, "cpp"), op.op) is getattr(cpu_kernels, op.name)
        assert has_own_op(op.family, "cpp", op.op)
    table = bind_ops("cpp")
    assert table.name == "cpp" and table.linear is cpu_kernels.linear
    assert table.causal_conv1d_varlen is cpu_kernels.causal_conv1d_varlen
    assert not has_own_op("rwkv4", "ref", "varlen")


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
def test_every_kernel_of_the_build_is_declared_once() -> None:
    """The loaded build's ops (from their schemas) are exactly those `cpu_kernels` names: a new
    kernel is bound in `CPP_OPS` (or named as a helper), never forgotten."""
    names = [op.name for op in cpu_kernels.CPP_OPS]
    declared = [*names, *cpu_kernels.LINEAR_OPS, *cpu_kernels.OTHER_OPS]
    assert len(declared) == len(set(declared))
    assert cpu_kernels.library_ops() == set(declared)


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
def test_a_cpp_wrapper_takes_the_references_parameters_and_converts_scalars() -> None:
    ssd = registered_families()["ssd"].ops["chunk_scan_varlen"].ref
    wrapper = cpu_kernels.ssd_chunk_scan_varlen
    assert inspect.signature(wrapper) == inspect.signature(ssd)
    kda = cpu_kernels.kda_varlen
    assert inspect.signature(kda).parameters["chunk_size"].default == 12
    bad = cpu_kernels.CppOp("ssd", "chunk_scan_varlen", "ssd_chunk_scan_varlen")  # no dt_limit
    with pytest.raises(TypeError, match="dt_min"):
        cpu_kernels.cpp_wrapper(bad, ssd)


def _kda_varlen_other_default(
    q, k, v, a, b, A_log, dt_bias, ssm_states, query_start_loc, state_indices,
    has_initial_state, chunk_size=7,
):  # fmt: skip
    raise AssertionError("never called")


@pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
def test_a_cpp_wrapper_refuses_a_schema_default_the_reference_does_not_have() -> None:
    """`kda_varlen`'s schema says `chunk_size=12`: a reference defaulting to 7 is refused."""
    op = cpu_kernels.CppOp("kda", "varlen", "kda_varlen")
    with pytest.raises(TypeError, match="default of 'chunk_size'"):
        cpu_kernels.cpp_wrapper(op, _kda_varlen_other_default)


def test_every_triton_launcher_takes_its_family_ops_parameters() -> None:
    """`TRITON_OPS` names a launcher for existing family ops only, each with the op's
    parameters (checked without a GPU: registered under a scratch backend name)."""
    pytest.importorskip("triton", reason="triton is not installed")
    from vllm_mamba.ops import triton_ops

    try:
        for family, ops in triton_ops.TRITON_OPS.items():
            for op, where in ops.items():
                module, function = where.split(":")
                launcher = getattr(importlib.import_module(f"vllm_mamba.ops.{module}"), function)
                register_op_impl(family, "triton_check", **{op: launcher})
                assert getattr(family_ops(family, "triton_check"), op) is launcher
    finally:
        for key in [k for k in families._IMPLS if k[1] == "triton_check"]:
            families._IMPLS.pop(key)
