"""The Triton `dynamic_conv` kernels (Inkling 2's per-token-tap convs) against the references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. Math is float32 on both
sides, so results agree to a few ulps (1e-5); the saved histories are copies, exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_dynamic_conv import make_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.dynamic_conv import dynamic_conv_update_ref, dynamic_conv_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_dynamic_conv import (  # noqa: E402
    dynamic_conv_update,
    dynamic_conv_varlen,
)

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize(("width", "channels", "heads"), [(4, 72, 3), (1, 16, 2)])
def test_varlen_and_update_match_reference(
    device: str, width: int, channels: int, heads: int
) -> None:
    """Fresh and saved histories, an empty and a padding sequence, a chunk longer than one
    token tile and one shorter than the history, two channel blocks; decode rows with a padding
    row."""
    case = make_case(width, channels, heads, device=device)
    got_states, ref_states = case.conv_states.clone(), case.conv_states.clone()
    got = dynamic_conv_varlen(*case.varlen_args(got_states))
    want = dynamic_conv_varlen_ref(*case.varlen_args(ref_states))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=0, rtol=0)
    rows = torch.tensor([6, PAD_SLOT_ID, 2], device=device)
    x, stat, taps = case.x[:3], case.static_weight, case.dynamic_taps[:3]
    got = dynamic_conv_update(x, got_states, stat, taps, rows)
    want = dynamic_conv_update_ref(x, ref_states, stat, taps, rows)
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=0, rtol=0)
