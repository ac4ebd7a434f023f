"""The Triton `cca` conv kernels (ZAYA1's CCA) against the references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. float32 on both sides:
results agree to a few ulps (1e-5); the saved histories are copies, exactly equal.
"""

from __future__ import annotations

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.cca import cca_conv_update_ref, cca_conv_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_cca import cca_conv_update, cca_conv_varlen  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("kernels", [(2, 2), (1, 4), (3, 1)])
def test_conv_varlen_and_update_match_reference(device: str, kernels: tuple[int, int]) -> None:
    """Sequences of 20 (longer than one token tile), 1 (shorter than the history), 0 and 5
    tokens (a padding slot), fresh and saved histories, 3 groups of 6 channels; then decode
    rows with a padding row."""
    g = torch.Generator().manual_seed(sum(kernels))
    channels, dim, hist = 18, 6, sum(kernels) - 2
    weights = (
        torch.randn(channels, kernels[0], generator=g), torch.randn(channels, generator=g),
        torch.randn(channels, dim, kernels[1], generator=g) * 0.3,
        torch.randn(channels, generator=g),
    )  # fmt: skip
    weights = tuple(w.to(device) for w in weights)
    x = torch.randn(26, channels, generator=g).to(device)
    qsl = torch.tensor([0, 20, 21, 21, 26], dtype=torch.int32, device=device)
    idx = torch.tensor([3, 1, 0, PAD_SLOT_ID], dtype=torch.int32, device=device)
    flags = torch.tensor([True, True, False, True], device=device)
    states = torch.randn(5, channels, hist, generator=g).to(device)
    got_states, want_states = states.clone(), states.clone()
    got = cca_conv_varlen(x, *weights, got_states, qsl, idx, flags)
    want = cca_conv_varlen_ref(x, *weights, want_states, qsl, idx, flags)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=0, rtol=0)
    rows = torch.tensor([3, PAD_SLOT_ID, 1], dtype=torch.int32, device=device)
    got = cca_conv_update(x[:3], got_states, *weights, rows)
    want = cca_conv_update_ref(x[:3], want_states, *weights, rows)
    torch.testing.assert_close(got[[0, 2]], want[[0, 2]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=0, rtol=0)
