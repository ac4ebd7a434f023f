"""The Triton backend of the Mamba ops, as `vllm_mamba.ops.dispatch` loads it.

The kernels live in `triton_conv1d`, `triton_selective_scan` and `triton_ssd`; this module only
says whether they can run here and hands out the ops table (making it imports `triton_gated_delta`,
`triton_kda`, `triton_mla`, `triton_rwkv` and `triton_short_conv`, which register the `triton`
versions of the `gated_delta`, `kda`, `mla`, `rwkv7`, `rwkv4` and `short_conv` op families).
They run on CUDA devices, and on the CPU under the Triton interpreter (`TRITON_INTERPRET=1`),
which is how the tests check them.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F

from vllm_mamba.ops.table import MambaOps


def available() -> bool:
    """True when triton is installed and there is a CUDA device or the interpreter is on."""
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def make_ops() -> MambaOps:
    """Returns the table of the Triton ops (projections run `F.linear`, i.e. cuBLAS)."""
    import vllm_mamba.ops.triton_gated_delta  # noqa: F401  registers its family ops on import
    import vllm_mamba.ops.triton_kda  # noqa: F401  registers its family ops on import
    import vllm_mamba.ops.triton_mla  # noqa: F401  registers its family ops on import
    import vllm_mamba.ops.triton_rwkv  # noqa: F401  registers its family ops on import
    import vllm_mamba.ops.triton_short_conv  # noqa: F401  registers its family ops on import
    from vllm_mamba.ops.triton_attention import (
        paged_decode_attention,
        paged_prefill_attention,
        reshape_and_cache,
    )
    from vllm_mamba.ops.triton_conv1d import causal_conv1d_update, causal_conv1d_varlen
    from vllm_mamba.ops.triton_selective_scan import selective_scan_varlen, selective_state_update
    from vllm_mamba.ops.triton_ssd import ssd_chunk_scan_varlen, ssd_state_update

    return MambaOps(
        name="triton",
        causal_conv1d_varlen=causal_conv1d_varlen,
        causal_conv1d_update=causal_conv1d_update,
        selective_scan_varlen=selective_scan_varlen,
        selective_state_update=selective_state_update,
        ssd_chunk_scan_varlen=ssd_chunk_scan_varlen,
        ssd_state_update=ssd_state_update,
        reshape_and_cache=reshape_and_cache,
        paged_decode_attention=paged_decode_attention,
        paged_prefill_attention=paged_prefill_attention,
        linear=F.linear,
    )
