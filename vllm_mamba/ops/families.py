"""Op families: the ops of a layer kind beyond the core table, with `_ref` defaults.

A new kind of layer (a delta rule, a short conv, a plugin's own recurrence) registers its ops
as a family: a name and its pure-PyTorch `_ref` implementations. A backend that has faster
versions of some of them registers those for its name; every other backend, and every op the
backend does not implement, runs the reference. So a family is added without any backend
having to implement it, and the choice between implementations stays in one place.

    register_op_family("ema", {"scan_varlen": ema_scan_varlen_ref, ...})
    register_op_impl("ema", "cpp", scan_varlen=ema_scan_varlen_cpp)
    ops = layer_ops.family("ema")       # MambaOps.family: this backend's, else the reference
    ops.scan_varlen(...)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType, SimpleNamespace

__all__ = [
    "register_op_family",
    "register_op_impl",
    "family_ops",
    "has_own_op",
    "registered_families",
]

_REFS: dict[str, dict[str, Callable]] = {}
_IMPLS: dict[tuple[str, str], dict[str, Callable]] = {}


def register_op_family(name: str, refs: Mapping[str, Callable]) -> None:
    """Registers (or replaces) family `name` with its reference ops.

    Raises:
        ValueError: no ops, or an op that is not callable.
    """
    if not refs or not all(callable(f) for f in refs.values()):
        raise ValueError(f"op family {name!r} needs callable reference ops, got {dict(refs)}")
    _REFS[name] = dict(refs)


def register_op_impl(family: str, backend: str, **impls: Callable) -> None:
    """Registers backend `backend`'s own versions of some of `family`'s ops.

    Raises:
        ValueError: the family is unknown, or an op it does not have.
    """
    refs = _REFS.get(family)
    if refs is None:
        raise ValueError(f"op family {family!r} is not registered")
    unknown = sorted(set(impls) - set(refs))
    if unknown:
        raise ValueError(f"op family {family!r} has no ops {unknown} (it has {sorted(refs)})")
    _IMPLS.setdefault((family, backend), {}).update(impls)


def family_ops(family: str, backend: str) -> SimpleNamespace:
    """The ops of `family` for `backend`: its own where registered, else the references.

    Raises:
        KeyError: the family is not registered.
    """
    if family not in _REFS:
        raise KeyError(f"op family {family!r} is not registered (known: {sorted(_REFS)})")
    return SimpleNamespace(**{**_REFS[family], **_IMPLS.get((family, backend), {})})


def has_own_op(family: str, backend: str, op: str) -> bool:
    """Whether `backend` registered its own version of `family`'s op `op` (else it runs the
    reference): a layer may then prefer a composition of the backend's other ops."""
    return op in _IMPLS.get((family, backend), {})


def registered_families() -> Mapping[str, Mapping[str, Callable]]:
    """Every family's reference ops (read-only)."""
    return MappingProxyType(_REFS)
