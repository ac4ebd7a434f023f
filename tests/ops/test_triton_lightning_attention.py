"""The Triton backend's lightning attention (its SSD kernels, `lightning_ops`) against the
`lightning_attention` references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. The interpreter is slow,
so the shapes are tiny.

Tolerances: float32 on both sides, the kernel's chunks of 32 tokens against the reference's of
64, about 1e-6 on values of order 10, checked as `test_lightning_attention`'s float32 bound.
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_lightning_attention import F32_TOL, make_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.lightning_attention import (
    lightning_ops,
    lightning_update_ref,
    lightning_varlen_ref,
)

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops import triton_ssd  # noqa: E402
from vllm_mamba.ops.table import bind_ops  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]


@pytest.fixture(params=_DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    """The CPU (in the interpreter) or a CUDA GPU, whichever this process can test."""
    return torch.device(request.param)


@pytest.mark.parametrize("heads", [(2, 16, 16), (3, 5, 7)])
def test_prefill_then_decode_equal_references(
    device: torch.device, heads: tuple[int, int, int]
) -> None:
    """Sequences from zeros and from saved states (one longer than the kernel's chunk) with a
    padding row, then a decode step with a padding row: outputs and states."""
    ops = lightning_ops(bind_ops("triton"))
    assert ops.varlen.args == (triton_ssd.ssd_chunk_scan_varlen,)
    case = make_case([3, 1, 40], heads, pad=(2,))
    ref = case.clone()
    want = lightning_varlen_ref(**ref.varlen_args())[:44]
    got = {k: v.to(device) for k, v in case.varlen_args().items()}
    out = ops.varlen(**got)
    torch.testing.assert_close(out[:44].cpu(), want, **F32_TOL)
    torch.testing.assert_close(got["ssm_states"].cpu(), ref.ssm_states, **F32_TOL)
    rows = torch.tensor([*case.state_indices[:3].tolist(), PAD_SLOT_ID], dtype=torch.int32)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(4, *x.shape[1:], generator=g) for x in (case.q, case.k, case.v))
    want = lightning_update_ref(q, k, v, case.slope, ref.ssm_states, rows)
    states = got["ssm_states"]
    out = ops.update(
        q=q.to(device), k=k.to(device), v=v.to(device), slope=case.slope.to(device),
        ssm_states=states, state_indices=rows.to(device),
    )  # fmt: skip
    torch.testing.assert_close(out[:3].cpu(), want[:3], **F32_TOL)
    torch.testing.assert_close(states.cpu(), ref.ssm_states, **F32_TOL)
