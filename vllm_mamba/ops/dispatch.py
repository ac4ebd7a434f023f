"""The one place where the implementation of the ops is chosen.

`get_mamba_ops(device)` returns a `MambaOps` table (`vllm_mamba.ops.table`) bound to one
backend of the op registry (`vllm_mamba.ops.families`); layers call through it, projections
included, and never pick a kernel themselves. On the CPU the C++ extension
(`vllm_mamba.ops.cpu_kernels`) runs when it is built, else the references with one warning; on
CUDA the Triton kernels (`vllm_mamba.ops.triton_ops`). `VLLM_MAMBA_OPS=ref|cpp|triton` forces a
choice for every op; `ref` runs `F.linear` and the `_ref` functions only. The C++ backend also
gets the fused decode layers (`vllm_mamba.ops.fused_decode`) unless
`VLLM_MAMBA_FUSED_DECODE=0`.

Each backend module exposes `available() -> bool` and `register()`, which registers its own ops
(`families.load_backend` calls it once, when the backend is first chosen).
"""

from __future__ import annotations

import logging

import torch

from vllm_mamba import envs
from vllm_mamba.ops.families import BACKEND_MODULES, load_backend
from vllm_mamba.ops.table import MambaOps, bind_ops

__all__ = ["MambaOps", "REF_OPS", "get_mamba_ops"]

logger = logging.getLogger(__name__)
_warned: set[str] = set()

REF_OPS = bind_ops("ref")


def _load_backend(name: str) -> MambaOps | None:
    """Backend `name`'s table, or None when it is not usable here."""
    return bind_ops(name) if load_backend(name) else None


def get_mamba_ops(device: torch.device | str) -> MambaOps:
    """Returns the fastest available ops for `device`, or the backend forced by the environment.

    Args:
        device: where the model runs.

    Returns:
        The ops table to call.

    Raises:
        ValueError: `VLLM_MAMBA_OPS` names an unknown or unavailable backend.
    """
    device_type = torch.device(device).type
    forced = envs.VLLM_MAMBA_OPS
    if forced == "ref":
        return REF_OPS
    if forced:
        if forced not in BACKEND_MODULES:
            raise ValueError(f"VLLM_MAMBA_OPS={forced!r}: expected one of ref, cpp, triton")
        ops = _load_backend(forced)
        if ops is None:
            raise ValueError(f"VLLM_MAMBA_OPS={forced!r}: that backend is not available here")
        return ops
    preferred = "triton" if device_type == "cuda" else "cpp"
    ops = _load_backend(preferred)
    if ops is not None:
        return ops
    if preferred not in _warned:
        _warned.add(preferred)
        logger.warning(
            "Mamba %s kernels are not available; using the pure-PyTorch reference ops (slow). "
            "Build them with `pip install --no-build-isolation -e .`.",
            preferred,
        )
    return REF_OPS
