"""The Triton `rglru` kernels (RecurrentGemma's RG-LRU) against the references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. Math is float32 on both
sides with the same operations, so float32 results agree to a few ulps (1e-5).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_rglru import make_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.rglru import rglru_update_ref, rglru_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_rglru import rglru_update, rglru_varlen  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]


@pytest.mark.parametrize("device", _DEVICES)
def test_varlen_and_update_match_reference(device: str) -> None:
    """Resets, initial states, an empty and a padding sequence, two channel blocks; decode
    rows with a padding row."""
    case = make_case(device=device)
    args = (case.x, case.gates, case.log_a_scale)
    got_states, ref_states = case.h_states.clone(), case.h_states.clone()
    got = rglru_varlen(*args, got_states, case.qsl, case.slots, case.init)
    want = rglru_varlen_ref(*args, ref_states, case.qsl, case.slots, case.init)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([6, PAD_SLOT_ID, 2], device=device)
    step = (case.x[:3], case.gates[:3], case.log_a_scale)
    got = rglru_update(*step, got_states, rows)
    want = rglru_update_ref(*step, ref_states, rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=1e-5, rtol=1e-5)
