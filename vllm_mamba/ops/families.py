"""The one op registry: every op family, its typed signatures, `_ref` defaults and backends.

An op family is a group of ops that one kind of layer calls (`causal_conv1d`, `selective_scan`,
`ssd`, `gated_rms_norm`, `paged_attention`, `linear`, `fused_decode`, `gated_delta`, `kda`,
`mla`, `short_conv`, `rwkv7`, `rwkv4`, or a plugin's own): each op has a name, a typed
`Protocol` (its signature) and a pure-PyTorch `_ref` implementation, which every backend runs
unless it registers its own. A backend (`cpp`: `vllm_mamba.ops.cpu_kernels`, `triton`:
`vllm_mamba.ops.triton_ops`) overrides the ops it implements with `register_op_impl`, from its
module's `register()` function, which `load_backend` calls once, when the backend is first
asked for (by `vllm_mamba.ops.dispatch` or by `family_ops` / `has_own_op`); importing a
backend module registers none of its ops. The built-in families (each module's `OPS`) are
registered on the registry's first use.

    FAMILY = OpFamily("ema", {"scan_varlen": OpSpec(EmaScanOp, ema_scan_varlen_ref)})
    register_family(FAMILY)                 # or register_op_family("ema", {...refs...})
    register_op_impl("ema", "cpp", scan_varlen=ema_scan_varlen_cpp)
    ops = family_ops("ema", "cpp")          # this backend's own ops, else the references
    ops.scan_varlen(...)

The registry refuses an op whose parameters (names, in order) differ from its reference's or
its protocol's, so a kernel called with keyword arguments reads them as the reference does.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType, SimpleNamespace
from typing import Any

__all__ = [
    "BACKEND_MODULES",
    "OpFamily",
    "OpSpec",
    "family_ops",
    "has_own_op",
    "load_backend",
    "own_op",
    "parameter_names",
    "register_family",
    "register_op_family",
    "register_op_impl",
    "registered_families",
]

# The backends that have their own ops, and the module whose `register()` registers them (and
# whose `available()` says whether they run here).
BACKEND_MODULES = {"cpp": "vllm_mamba.ops.cpu_kernels", "triton": "vllm_mamba.ops.triton_ops"}

# The modules that declare the built-in families (each as its `OPS`), registered on first use.
_BUILTIN_MODULES = (
    "causal_conv1d", "selective_scan", "ssd", "gated_rms_norm", "paged_attention", "linear",
    "fused_decode", "gated_delta", "kda", "mla_attention", "short_conv", "rwkv7", "rwkv4", "ffn",
    "rglru", "lightning_attention", "mlstm", "cca", "dynamic_conv", "hyper_connection",
    "sampling",
)  # fmt: skip


@dataclass(frozen=True)
class OpSpec:
    """One op of a family: its typed signature (a `Protocol` with `__call__`, or None for an
    untyped plugin op) and its pure-PyTorch reference, the default of every backend."""

    protocol: type | None
    ref: Callable[..., Any]


@dataclass(frozen=True)
class OpFamily:
    """A named group of ops (`OpSpec` by op name)."""

    name: str
    ops: Mapping[str, OpSpec] = field(default_factory=dict)

    @property
    def refs(self) -> dict[str, Callable[..., Any]]:
        """The reference of every op."""
        return {op: spec.ref for op, spec in self.ops.items()}


_FAMILIES: dict[str, OpFamily] = {}
_IMPLS: dict[tuple[str, str], dict[str, Callable[..., Any]]] = {}
_LOADED: set[str] = set()  # the backends whose own ops are registered


def parameter_names(fn: Callable[..., Any]) -> tuple[str | None, ...] | None:
    """The names of `fn`'s parameters in order (`self` dropped for a Protocol's `__call__`;
    None for a positional-only one, whose name callers never use), or None where Python cannot
    tell (a builtin)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    if params and params[0].name == "self":
        params = params[1:]
    return tuple(None if p.kind is p.POSITIONAL_ONLY else p.name for p in params)


def _check_signature(
    where: str, fn: Callable[..., Any], want: tuple[str | None, ...] | None
) -> None:
    """Raises ValueError when `fn`'s parameters differ from `want` (None: any name)."""
    got = parameter_names(fn)
    if want is None or got is None:
        return
    if len(got) != len(want) or any(w is not None and g != w for g, w in zip(got, want)):
        raise ValueError(f"{where}: parameters {list(got)} differ from {list(want)}")


def _signature_of(spec: OpSpec) -> tuple[str | None, ...] | None:
    """What an implementation of `spec` must take: its protocol's parameters, else its
    reference's."""
    if spec.protocol is not None:
        return parameter_names(spec.protocol.__call__)
    return parameter_names(spec.ref)


def register_family(family: OpFamily) -> None:
    """Registers (or replaces) `family` with its references.

    Raises:
        ValueError: no ops, an op that is not callable, or a reference whose parameters differ
            from its protocol's.
    """
    if not family.ops or not all(callable(s.ref) for s in family.ops.values()):
        raise ValueError(f"op family {family.name!r} needs callable reference ops, got {family}")
    for op, spec in family.ops.items():
        if spec.protocol is not None:
            _check_signature(f"{family.name}.{op} reference", spec.ref, _signature_of(spec))
    _FAMILIES[family.name] = family


def register_op_family(name: str, refs: Mapping[str, Callable[..., Any]]) -> None:
    """Registers (or replaces) family `name` from its reference ops alone (untyped).

    Raises:
        ValueError: no ops, or an op that is not callable.
    """
    register_family(OpFamily(name, {op: OpSpec(None, ref) for op, ref in refs.items()}))


def _builtins() -> None:
    """Registers the built-in families (once): each module's `OPS`."""
    if "causal_conv1d" in _FAMILIES:
        return
    for module in _BUILTIN_MODULES:
        register_family(importlib.import_module(f"vllm_mamba.ops.{module}").OPS)


def _family(name: str) -> OpFamily:
    _builtins()
    family = _FAMILIES.get(name)
    if family is None:
        raise KeyError(f"op family {name!r} is not registered (known: {sorted(_FAMILIES)})")
    return family


def register_op_impl(family: str, backend: str, **impls: Callable[..., Any]) -> None:
    """Registers backend `backend`'s own versions of some of `family`'s ops.

    Raises:
        ValueError: the family is unknown, an op it does not have, an op that is not
            callable, or one whose parameters differ from the reference's.
    """
    try:
        fam = _family(family)
    except KeyError:
        raise ValueError(f"op family {family!r} is not registered") from None
    unknown = sorted(set(impls) - set(fam.ops))
    if unknown:
        raise ValueError(f"op family {family!r} has no ops {unknown} (it has {sorted(fam.ops)})")
    for op, fn in impls.items():
        if not callable(fn):
            raise ValueError(f"{backend} {family}.{op} is not callable: {fn!r}")
        _check_signature(f"{backend} {family}.{op}", fn, _signature_of(fam.ops[op]))
    _IMPLS.setdefault((family, backend), {}).update(impls)


def load_backend(backend: str) -> bool:
    """Registers backend `backend`'s own ops (once) when it runs here: the one place a backend
    module's `register()` is called. A backend that does not run here registers nothing (and
    is asked again next time: `TRITON_INTERPRET` may have been set since).

    Returns:
        Whether the backend runs here (always True for `ref` and for names without a module,
        which have only what was registered for them by hand).
    """
    _builtins()
    module_name = BACKEND_MODULES.get(backend)
    if module_name is None or backend in _LOADED:
        return True
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return False
    if not module.available():
        return False
    module.register()
    _LOADED.add(backend)
    return True


def own_op(family: str, backend: str, op: str) -> Callable[..., Any] | None:
    """`backend`'s own version of `family`'s op `op`, or None when it runs the reference."""
    _family(family)
    load_backend(backend)
    return _IMPLS.get((family, backend), {}).get(op)


def family_ops(family: str, backend: str) -> SimpleNamespace:
    """The ops of `family` for `backend`: its own where registered, else the references.

    Raises:
        KeyError: the family is not registered.
    """
    refs = _family(family).refs
    load_backend(backend)
    return SimpleNamespace(**{**refs, **_IMPLS.get((family, backend), {})})


def has_own_op(family: str, backend: str, op: str) -> bool:
    """Whether `backend` registered its own version of `family`'s op `op` (else it runs the
    reference): a layer may then prefer a composition of the backend's other ops."""
    return own_op(family, backend, op) is not None


def registered_families() -> Mapping[str, OpFamily]:
    """Every registered family (read-only)."""
    _builtins()
    return MappingProxyType(_FAMILIES)
