"""The one place where the implementation of the Mamba ops is chosen.

`get_mamba_ops(device)` returns a `MambaOps` table (`vllm_mamba.ops.table`); layers call
through it, projections included, and never pick a kernel themselves. On the CPU the C++
extension (`vllm_mamba.ops.cpu_kernels`) runs when it is built, else the references with one
warning; on CUDA the Triton kernels (`vllm_mamba.ops.triton_ops`).
`VLLM_MAMBA_OPS=ref|cpp|triton` forces a choice for every op; `ref` runs `F.linear` and the
`_ref` functions only. The C++ backend also gets the fused decode layers
(`vllm_mamba.ops.fused_decode`) unless `VLLM_MAMBA_FUSED_DECODE=0`.

Each backend module exposes `available() -> bool` and `make_ops() -> MambaOps`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging

import torch
import torch.nn.functional as F

from vllm_mamba import envs
from vllm_mamba.ops import fused_decode
from vllm_mamba.ops.causal_conv1d import causal_conv1d_update_ref, causal_conv1d_varlen_ref
from vllm_mamba.ops.gated_rms_norm import gated_rms_norm_ref
from vllm_mamba.ops.int4_linear import int4_linear_ref
from vllm_mamba.ops.int8_linear import int8_linear_ref
from vllm_mamba.ops.selective_scan import selective_scan_varlen_ref, selective_state_update_ref
from vllm_mamba.ops.ssd import ssd_chunk_scan_varlen_ref, ssd_state_update_ref
from vllm_mamba.ops.table import MambaOps

__all__ = ["MambaOps", "REF_OPS", "get_mamba_ops"]

logger = logging.getLogger(__name__)
_BACKEND_MODULES = {"cpp": "vllm_mamba.ops.cpu_kernels", "triton": "vllm_mamba.ops.triton_ops"}
_warned: set[str] = set()


REF_OPS = MambaOps(
    name="ref",
    causal_conv1d_varlen=causal_conv1d_varlen_ref,
    causal_conv1d_update=causal_conv1d_update_ref,
    selective_scan_varlen=selective_scan_varlen_ref,
    selective_state_update=selective_state_update_ref,
    linear=F.linear,
    ssd_chunk_scan_varlen=ssd_chunk_scan_varlen_ref,
    ssd_state_update=ssd_state_update_ref,
    gated_rms_norm=gated_rms_norm_ref,
    int8_linear=int8_linear_ref,
    int4_linear=int4_linear_ref,
)


def _load_backend(name: str) -> MambaOps | None:
    """Imports backend `name` and returns its ops, or None when it is not usable here."""
    try:
        module = importlib.import_module(_BACKEND_MODULES[name])
    except ImportError:
        return None
    if not module.available():
        return None
    ops = module.make_ops()
    if name == "cpp" and fused_decode.available():
        ops = dataclasses.replace(
            ops,
            fused_mamba_decode=fused_decode.fused_mamba_decode,
            fused_mamba2_decode=fused_decode.fused_mamba2_decode,
        )
    return ops


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
        if forced not in _BACKEND_MODULES:
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
