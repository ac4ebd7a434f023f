"""Which build of the C++ CPU kernels runs: the ISA level of this CPU, chosen at run time.

`setup.py` compiles the kernels once per level into `vllm_mamba._C_<level>`: `generic`,
`avx2` (AVX2 + FMA + F16C) and `avx512` (AVX-512 F/BW/CD/DQ/VL) on x86-64, `neon` on aarch64.
`load()` imports the highest level the CPU supports, or the level that
`VLLM_MAMBA_CPU_ISA=generic|avx2|avx512|neon` forces (which must be one the CPU supports:
forcing a level is for testing and measuring lower levels on a newer machine; torch's own
libraries are then capped at the same level, `cap_libraries`). Only one build is ever
imported: each registers the same `torch.ops.vllm_mamba` ops.

The CPU's features come from `/proc/cpuinfo` on Linux; elsewhere from torch's own detection
(`torch.backends.cpu.get_cpu_capability()`).
"""

from __future__ import annotations

import importlib
import os
import platform
from functools import cache
from types import ModuleType

# Levels of each architecture, lowest first, with the CPU flags (as /proc/cpuinfo names them)
# each needs beyond the level below: the features of `-march=x86-64-v3` and `-v4`, which the
# builds are compiled with.
_X86_LEVELS: dict[str, frozenset[str]] = {
    "generic": frozenset(),
    "avx2": frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"}),
    "avx512": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
}
_ARM_LEVELS: dict[str, frozenset[str]] = {"neon": frozenset()}
ENV_VAR = "VLLM_MAMBA_CPU_ISA"


def _machine() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from /proc/cpuinfo, or None where there is no such file."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return set()


@cache
def supported_levels() -> tuple[str, ...]:
    """The ISA levels this CPU can run, lowest first.

    Returns:
        For example `("generic", "avx2", "avx512")` on an AVX-512 x86-64 CPU, `("neon",)`
        on aarch64, `("generic",)` on other architectures.
    """
    machine = _machine()
    if machine == "aarch64":
        return tuple(_ARM_LEVELS)
    if machine != "x86_64":
        return ("generic",)
    flags = _cpu_flags()
    if flags is None:  # not Linux: torch's cpuinfo-based detection
        import torch

        capability = torch.backends.cpu.get_cpu_capability().lower()
        top = {"avx512": 2, "avx2": 1}.get(capability, 0)
        return tuple(list(_X86_LEVELS)[: top + 1])
    levels = []
    for name, needs in _X86_LEVELS.items():
        if needs <= flags:
            levels.append(name)
        else:
            break
    return tuple(levels)


def requested_level() -> str | None:
    """The level `VLLM_MAMBA_CPU_ISA` forces, checked against the CPU; None when unset.

    Raises:
        ValueError: the variable names no level of this architecture, or one the CPU lacks.
    """
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return None
    known = _ARM_LEVELS if _machine() == "aarch64" else _X86_LEVELS
    if value not in known:
        raise ValueError(
            f"{ENV_VAR}={value!r} is not a level of this CPU; use one of {list(known)}"
        )
    if value not in supported_levels():
        raise ValueError(
            f"{ENV_VAR}={value!r}: this CPU supports only {list(supported_levels())} (a level "
            "can be forced lower than the CPU's, not higher)"
        )
    return value


# What the libraries under torch (ATen's own kernels, oneDNN, MKL) are capped at when a level
# is forced below the CPU's: each dispatches on the CPU by itself, so without the cap a forced
# avx2 run would still multiply with AVX-512. Values as each library's variable takes them.
_LIBRARY_CAPS: dict[str, dict[str, str]] = {
    "generic": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
             "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}  # fmt: skip


def cap_libraries() -> dict[str, str]:
    """Caps torch's libraries at the forced level when it is below the CPU's highest.

    Called when the package is imported, before torch's libraries pick their kernels; a
    variable the user set is kept.

    Returns:
        The variables set.
    """
    try:
        forced = requested_level()
    except ValueError:
        return {}  # reported by `load()`
    if forced is None or forced == supported_levels()[-1]:
        return {}
    caps = {k: v for k, v in _LIBRARY_CAPS.get(forced, {}).items() if k not in os.environ}
    os.environ.update(caps)
    return caps


_loaded: tuple[str, ModuleType] | None = None


def load() -> tuple[str, ModuleType] | None:
    """Imports the kernel build for this CPU (once) and returns its level and module.

    The forced level when `VLLM_MAMBA_CPU_ISA` is set, else the highest supported level that
    was built; a level whose build is missing falls back to the next lower one.

    Returns:
        `(level, module)`, or None when no build is installed (`VLLM_MAMBA_NO_EXT=1`).

    Raises:
        ValueError: `VLLM_MAMBA_CPU_ISA` names an unknown or unsupported level.
        ImportError: the forced level's build is not installed.
    """
    global _loaded
    if _loaded is not None:
        return _loaded
    # Each build links against torch's libraries (libc10, libtorch), which only importing torch
    # loads: without it every level would fail to import, as if none were installed.
    import torch  # noqa: F401

    forced = requested_level()
    candidates = [forced] if forced else list(reversed(supported_levels()))
    for level in candidates:
        try:
            module = importlib.import_module(f"vllm_mamba._C_{level}")
        except ImportError:
            if forced:
                raise ImportError(
                    f"{ENV_VAR}={forced}: the {forced} build of the kernels is not installed "
                    f"(built with VLLM_MAMBA_CPU_ISAS excluding it?)"
                ) from None
            continue
        _loaded = (level, module)
        return _loaded
    return None


def active_level() -> str | None:
    """The ISA level of the kernel build in use (loading it if needed), or None without one."""
    loaded = load()
    return loaded[0] if loaded else None


def has_op(name: str) -> bool:
    """Whether a kernel build is installed (loading it if needed) and registers
    `torch.ops.vllm_mamba.<name>`."""
    try:
        if load() is None:  # registers torch.ops.vllm_mamba.*
            return False
    except OSError:
        return False
    import torch

    return hasattr(torch.ops.vllm_mamba, name)
