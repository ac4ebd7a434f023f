"""The RG-LRU ops (`ops.rglru`): the references against an independent float64 loop written
from Griffin's equations, and the C++ kernels (`csrc/rglru.cpp`) against the references.

Cases: sequences of 0 to 41 tokens, with and without an initial state (a reset on the first
token), a padding sequence, chunked prefill equal to whole prefill, decode rows with a padding
row, float32 and bfloat16 inputs. `make_case` is shared with the Triton tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.rglru import rglru_update_ref, rglru_varlen_ref

needs_cpp = pytest.mark.skipif(
    "rglru_varlen" not in cpu_kernels.library_ops(), reason="C++ extension not built"
)
LENS = [5, 0, 41, 1, 17]  # per sequence; sequence 3 is padding
INIT = [True, False, False, True, True]
WIDTH = 40  # channels: a full and a partial block of 32


@dataclass
class RGLRUCase:
    x: torch.Tensor  # (T, L)
    gates: torch.Tensor  # (T, 2L)
    log_a_scale: torch.Tensor  # (L,)
    h_states: torch.Tensor  # (S, L)
    qsl: torch.Tensor  # (B + 1,)
    slots: torch.Tensor  # (B,)
    init: torch.Tensor  # (B,)


def make_case(dtype: torch.dtype = torch.float32, seed: int = 0, device: str = "cpu") -> RGLRUCase:
    """Random inputs over `LENS`, the slots shuffled among 8, sequence 3 a padding one."""
    g = torch.Generator().manual_seed(seed)
    tokens = sum(LENS) + 2  # two padding tokens after the last sequence
    slots = torch.tensor([6, 2, 0, PAD_SLOT_ID, 5])
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    return RGLRUCase(
        (torch.randn(tokens, WIDTH, generator=g) * 2).to(dtype).to(device),
        torch.randn(tokens, 2 * WIDTH, generator=g).mul(2).to(dtype).to(device),
        (-8 * torch.nn.functional.softplus(torch.randn(WIDTH, generator=g))).to(device),
        torch.randn(8, WIDTH, generator=g).to(device),
        qsl.to(device), slots.to(device), torch.tensor(INIT).to(device),
    )  # fmt: skip


def _f64_loop(case: RGLRUCase) -> tuple[torch.Tensor, torch.Tensor]:
    """Griffin's recurrence channel by channel in float64: (outputs, final states)."""
    x, gates = case.x.double(), case.gates.double()
    c = case.log_a_scale.double()
    out = torch.zeros_like(x)
    states = case.h_states.double().clone()
    sig = lambda v: 1 / (1 + math.exp(-v))  # noqa: E731
    starts = case.qsl.tolist()
    for b, slot in enumerate(case.slots.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        for ch in range(WIDTH):
            h = float(states[slot, ch])
            for t in range(starts[b], starts[b + 1]):
                inp = float(x[t, ch]) * sig(float(gates[t, ch]))
                log_a = float(c[ch]) * sig(float(gates[t, WIDTH + ch]))
                if t == starts[b] and not bool(case.init[b]):
                    h = inp
                else:
                    h = math.exp(log_a) * h + inp * math.sqrt(1 - math.exp(2 * log_a))
                out[t, ch] = h
            states[slot, ch] = h
    return out, states


def _varlen(op, case: RGLRUCase) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    states = case.h_states.clone()
    out = op(case.x, case.gates, case.log_a_scale, states, case.qsl, case.slots, case.init)
    return out, states


def test_reference_equals_a_float64_loop() -> None:
    out, states = _varlen(rglru_varlen_ref, make_case())
    want, want_states = _f64_loop(make_case())
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states.double(), want_states, atol=1e-5, rtol=1e-5)
    assert not out[sum(LENS) :].any()  # padding tokens


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpp", marks=needs_cpp)])
def test_chunked_and_decoded_equal_whole(impl: str) -> None:
    """A 41-token sequence in chunks of 7, 1 and 20 from a reset, then decoded token by token
    for the last 13, equals the whole-sequence scan."""
    varlen = rglru_varlen_ref if impl == "ref" else cpu_kernels.rglru_varlen
    update = rglru_update_ref if impl == "ref" else cpu_kernels.rglru_update
    case = make_case()
    x, gates = case.x[10:51], case.gates[10:51]  # sequence 2
    whole_states = case.h_states.clone()
    slot = torch.tensor([0])
    whole = varlen(x, gates, case.log_a_scale, whole_states, torch.tensor([0, 41]), slot,
                   torch.tensor([False]))  # fmt: skip
    states, parts, done = case.h_states.clone(), [], 0
    for size in (7, 1, 20):
        qsl = torch.tensor([0, size])
        init = torch.tensor([done > 0])
        parts.append(varlen(x[done : done + size], gates[done : done + size],
                            case.log_a_scale, states, qsl, slot, init))  # fmt: skip
        done += size
    for t in range(done, 41):
        parts.append(update(x[t : t + 1], gates[t : t + 1], case.log_a_scale, states, slot))
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states, whole_states, atol=1e-6, rtol=1e-6)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_matches_reference(dtype: torch.dtype) -> None:
    case = make_case(dtype, seed=1)
    out, states = _varlen(cpu_kernels.rglru_varlen, case)
    ref, ref_states = _varlen(rglru_varlen_ref, case)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(out, ref, **tol)
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5)
    rows = torch.tensor([6, PAD_SLOT_ID, 2])
    x, gates = case.x[:3], case.gates[:3]
    got_states, ref_states = case.h_states.clone(), case.h_states.clone()
    got = cpu_kernels.rglru_update(x, gates, case.log_a_scale, got_states, rows)
    want = rglru_update_ref(x, gates, case.log_a_scale, ref_states, rows)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got_states, ref_states, atol=1e-5, rtol=1e-5)
    assert not got[1].any()  # the padding row


@needs_cpp
def test_cpp_rejects_bad_shapes() -> None:
    case = make_case()
    with pytest.raises(RuntimeError, match="gates must be"):
        cpu_kernels.rglru_update(case.x[:2], case.gates[:2, :WIDTH], case.log_a_scale,
                                 case.h_states, torch.tensor([0, 1]))  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the state slots"):
        cpu_kernels.rglru_update(case.x[:1], case.gates[:1], case.log_a_scale, case.h_states,
                                 torch.tensor([8]))  # fmt: skip
