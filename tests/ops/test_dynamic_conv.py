"""The `dynamic_conv` op family (a depthwise causal conv with per-token taps: Inkling 2's key
and value convs): the references against a float64 loop written out, chunked prefill and
one-token decode against whole prefill, and the C++ kernels (`csrc/dynamic_conv.cpp`) against
the references in float32 and bfloat16, with fresh and saved histories, an empty and a padding
sequence, widths 1 to 4 and channels that do not fill the kernels' blocks. `make_case` is shared
with the Triton tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vllm_mamba.cache_specs import PAD_SLOT_ID
from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.dynamic_conv import dynamic_conv_update_ref, dynamic_conv_varlen_ref

needs_cpp = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")
# Sequences of 7, 1, 0 (empty), 5 (padding slot) and 40 tokens; the first and last with a
# saved history, the second fresh.
LENGTHS = [7, 1, 0, 5, 40]
SLOTS = [3, 0, 5, PAD_SLOT_ID, 6]
INITIAL = [True, False, True, True, True]


@dataclass
class DynamicConvCase:
    x: torch.Tensor  # (T, C)
    static_weight: torch.Tensor  # (K, C)
    dynamic_taps: torch.Tensor  # (T, Hc, K)
    conv_states: torch.Tensor  # (S, C, K - 1) float32
    qsl: torch.Tensor
    slots: torch.Tensor
    initial: torch.Tensor

    def varlen_args(self, states: torch.Tensor) -> tuple:
        return (self.x, self.static_weight, self.dynamic_taps, states, self.qsl, self.slots,
                self.initial)  # fmt: skip


def make_case(
    width: int = 4, channels: int = 72, heads: int = 3, dtype: torch.dtype = torch.float32,
    seed: int = 0, device: str = "cpu",
) -> DynamicConvCase:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(LENGTHS) + 2  # two padding tokens after the last sequence
    qsl = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return DynamicConvCase(
        torch.randn(tokens, channels, generator=gen).to(dtype).to(device),
        (0.5 * torch.randn(width, channels, generator=gen)).to(dtype).to(device),
        (0.5 * torch.randn(tokens, heads, width, generator=gen)).to(device),
        torch.randn(8, channels, width - 1, generator=gen).to(device),
        qsl.to(device), torch.tensor(SLOTS, device=device), torch.tensor(INITIAL, device=device),
    )  # fmt: skip


def _f64_loop(case: DynamicConvCase) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv as written in the module docstring, token by token, in float64."""
    x, states = case.x.double(), case.conv_states.double().clone()
    width, channels = case.static_weight.shape
    per_head = channels // case.dynamic_taps.shape[1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    bounds = case.qsl.tolist()
    for seq, slot in enumerate(case.slots.tolist()):
        begin, end = bounds[seq], bounds[seq + 1]
        if begin == end:
            continue
        saved = slot != PAD_SLOT_ID and bool(case.initial[seq])
        history = states[slot] if saved else torch.zeros(channels, width - 1, dtype=torch.float64)
        inputs = [history[:, j] for j in range(width - 1)] + [x[t] for t in range(begin, end)]
        for t in range(begin, end):
            here = width - 1 + t - begin  # index of token t in `inputs`
            for c in range(channels):
                for lag in range(width):
                    tap = case.static_weight[lag, c].double()
                    tap += case.dynamic_taps[t, c // per_head, lag].double()
                    out[t, c] += tap * inputs[here - lag][c]
        if slot != PAD_SLOT_ID:
            states[slot] = torch.stack(inputs[len(inputs) - (width - 1) :], dim=-1)
    return out, states


def test_reference_equals_a_float64_loop() -> None:
    case = make_case(width=3, channels=6, heads=2)
    states = case.conv_states.clone()
    got = dynamic_conv_varlen_ref(*case.varlen_args(states))
    want, want_states = _f64_loop(case)
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, want_states.float(), atol=1e-6, rtol=1e-6)


CPP = {"varlen": cpu_kernels.dynamic_conv_varlen, "update": cpu_kernels.dynamic_conv_update}
REF = {"varlen": dynamic_conv_varlen_ref, "update": dynamic_conv_update_ref}


@pytest.mark.parametrize("impl", ["ref", pytest.param("cpp", marks=needs_cpp)])
@pytest.mark.parametrize("width", [1, 2, 4])
def test_chunked_and_decoded_equal_whole(impl: str, width: int) -> None:
    """One 40-token sequence: whole, in chunks of 1, 6 and 33 tokens through its slot (the
    first chunk shorter than the history), and decoded token by token after a 3-token prefill."""
    ops = REF if impl == "ref" else CPP
    case = make_case(width=width, seed=width)
    x, taps, stat = case.x[:40], case.dynamic_taps[:40], case.static_weight
    one = torch.zeros(8, x.shape[1], width - 1)

    def run(chunks: list[int]) -> torch.Tensor:
        states, outs, done = one.clone(), [], 0
        for n in chunks:
            part = slice(done, done + n)
            outs.append(
                ops["varlen"](
                    x[part], stat, taps[part], states, torch.tensor([0, n]), torch.tensor([2]),
                    torch.tensor([done > 0]),
                )
            )  # fmt: skip
            done += n
        return torch.cat(outs), states

    whole, whole_states = run([40])
    for chunks in ([1, 6, 33], [20, 20]):
        got, got_states = run(chunks)
        torch.testing.assert_close(got, whole, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_states, whole_states, atol=0, rtol=0)
    states, outs = one.clone(), []
    first = ops["varlen"](x[:3], stat, taps[:3], states, torch.tensor([0, 3]),
                          torch.tensor([2]), torch.tensor([False]))  # fmt: skip
    for t in range(3, 40):
        outs.append(ops["update"](x[t : t + 1], states, stat, taps[t : t + 1], torch.tensor([2])))
    torch.testing.assert_close(torch.cat([first, *outs]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states, whole_states, atol=0, rtol=0)


@needs_cpp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("width", "channels", "heads"), [(4, 72, 3), (3, 16, 16), (2, 40, 1)])
def test_cpp_matches_reference(dtype: torch.dtype, width: int, channels: int, heads: int) -> None:
    """Varlen over the case's sequences, then decode rows with a padding row."""
    case = make_case(width, channels, heads, dtype, seed=channels)
    got_states, ref_states = case.conv_states.clone(), case.conv_states.clone()
    got = cpu_kernels.dynamic_conv_varlen(*case.varlen_args(got_states))
    want = dynamic_conv_varlen_ref(*case.varlen_args(ref_states))
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=0, rtol=0)
    rows = torch.tensor([6, PAD_SLOT_ID, 2])
    step = (case.x[:3], case.static_weight, case.dynamic_taps[:3])
    got = cpu_kernels.dynamic_conv_update(step[0], got_states, *step[1:], rows)
    want = dynamic_conv_update_ref(step[0], ref_states, *step[1:], rows)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=0, rtol=0)


@needs_cpp
def test_cpp_rejects_bad_shapes() -> None:
    case = make_case()
    with pytest.raises(RuntimeError, match="dynamic_taps must be"):
        cpu_kernels.dynamic_conv_varlen(
            case.x, case.static_weight, case.dynamic_taps[:, :, :2], case.conv_states, case.qsl,
            case.slots, case.initial,
        )  # fmt: skip
    with pytest.raises(RuntimeError, match="outside the state slots"):
        cpu_kernels.dynamic_conv_update(
            case.x[:1], case.conv_states, case.static_weight, case.dynamic_taps[:1],
            torch.tensor([8]),
        )  # fmt: skip
