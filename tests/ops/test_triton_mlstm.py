"""The Triton `mlstm` kernels (xLSTM's matrix-memory cell) against the references.

On the CPU the kernels run in the Triton interpreter, in a child pytest process started with
`TRITON_INTERPRET=1` when this process imported triton without it (see `test_triton_interpreter`).
The GPU tests carry the `cuda` marker and skip without a CUDA device. The interpreter is slow,
so the shapes are tiny.

Tolerances: float32 on both sides, the kernel's token-by-token recurrence against the
references' chunks, `test_mlstm`'s float32 bound (the cases are `test_mlstm`'s, well
conditioned).
"""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_mlstm import EPS, F32_TOL, STATES, TOKENS, make_case
from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops.mlstm import mlstm_update_ref, mlstm_varlen_ref

pytest.importorskip("triton", reason="triton is not installed")

import triton.language as tl  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from vllm_mamba.ops.triton_mlstm import mlstm_update, mlstm_varlen  # noqa: E402

IN_INTERPRETER = isinstance(tl.sum, InterpretedFunction)  # triton imported in interpreter mode
_NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
_CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, _NEEDS_CUDA])
_DEVICES = ["cpu"] if IN_INTERPRETER else [_CUDA]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("heads", [(2, 8, 48), (1, 5, 7)])
def test_varlen_and_update_match_reference(device: str, heads: tuple[int, int, int]) -> None:
    """Sequences from zeros and from saved states, an empty fresh one, a padding row; two
    value blocks (Dv 48) and dims that are not powers of two; then decode rows with a padding
    row."""
    case = make_case([3, 0, 20, 6], heads, pad=(2,), init=[True, False, False, True])
    ref = case.clone()
    want = mlstm_varlen_ref(**ref.args(), eps=EPS)
    got = {k: t.to(device) for k, t in case.args().items()}
    out = mlstm_varlen(**got, eps=EPS)
    torch.testing.assert_close(out.cpu(), want, **F32_TOL)
    for name in STATES:
        torch.testing.assert_close(got[name].cpu(), getattr(ref, name), **F32_TOL)
    rows = [*case.state_indices[:2].tolist(), PAD_SLOT_ID, int(case.state_indices[3])]
    rows = torch.tensor(rows, dtype=torch.int32)
    step = make_case([1, 1, 1, 1], heads, seed=5)
    inputs = {n: getattr(step, n) for n in TOKENS}
    want = mlstm_update_ref(**inputs, **ref.state_args(), state_indices=rows, eps=EPS)
    on_device = {n: t.to(device) for n, t in inputs.items()}
    states = {n: got[n] for n in STATES}
    out = mlstm_update(**on_device, **states, state_indices=rows.to(device), eps=EPS)
    torch.testing.assert_close(out.cpu(), want, **F32_TOL)
    assert not out[2].any()
    for name in STATES:
        torch.testing.assert_close(got[name].cpu(), getattr(ref, name), **F32_TOL)


@pytest.mark.parametrize("device", _DEVICES)
def test_bfloat16_states(device: str) -> None:
    """bfloat16 inputs and C / n states, float32 m: the references' results, to bfloat16."""
    case = make_case([4, 9], (2, 8, 16), init=[True, False])
    for name in (*TOKENS, "c_states", "n_states"):
        setattr(case, name, getattr(case, name).to(torch.bfloat16))
    ref = case.clone()
    want = mlstm_varlen_ref(**ref.args(), eps=EPS)
    got = {k: t.to(device) for k, t in case.args().items()}
    out = mlstm_varlen(**got, eps=EPS)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().float(), want.float(), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(got["c_states"].cpu().float(), ref.c_states.float(),
                               rtol=2**-7, atol=1e-2)  # fmt: skip
    torch.testing.assert_close(got["m_states"].cpu(), ref.m_states, **F32_TOL)
