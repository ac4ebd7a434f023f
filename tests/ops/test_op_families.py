"""Op families (`vllm_mamba.ops.families`): a backend's own ops where registered, the `_ref`s
everywhere else, and clear errors for unknown families and ops."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_mamba.ops.dispatch import REF_OPS
from vllm_mamba.ops.families import (
    _IMPLS,
    _REFS,
    family_ops,
    register_op_family,
    register_op_impl,
)


def _ref_a(x: int) -> int:
    return x + 1


def _ref_b(x: int) -> int:
    return x * 2


def _fast_a(x: int) -> int:
    return x + 1  # the same result, another function


@pytest.fixture
def family() -> Iterator[str]:
    register_op_family("test_family", {"a": _ref_a, "b": _ref_b})
    yield "test_family"
    _REFS.pop("test_family", None)
    for key in [k for k in _IMPLS if k[0] == "test_family"]:
        _IMPLS.pop(key)


def test_a_backend_without_its_own_ops_gets_the_references(family: str) -> None:
    ops = REF_OPS.family(family)
    assert ops.a is _ref_a and ops.b is _ref_b


def test_a_backend_overrides_only_what_it_registers(family: str) -> None:
    register_op_impl(family, "cpp", a=_fast_a)
    cpp = family_ops(family, "cpp")
    assert cpp.a is _fast_a and cpp.b is _ref_b
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
