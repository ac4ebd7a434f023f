"""Times the Gated DeltaNet ops at one Qwen3.5-0.8B-like layer (Hk = Hv = 16, Dk = Dv = 128):
prefill of one 512-token sequence and decode steps of 1, 32 and 128 rows, for the C++ kernels
(`vllm_mamba.ops.cpu_kernels`), the references (`vllm_mamba.ops.gated_delta`) and a plain torch
token-by-token recurrence. Prints the median microseconds per call.

    .venv/bin/python benchmarks/gated_delta_kernels.py [--threads 2] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_mamba.ops import cpu_kernels
from vllm_mamba.ops.gated_delta import gated_delta_update_ref, gated_delta_varlen_ref

HK, HV, DK, DV = 16, 16, 128, 128
PREFILL_TOKENS = 512
DECODE_ROWS = (1, 32, 128)


def torch_recurrent(q, k, v, a, b, A_log, dt_bias, beta_scale, ssm_states, slots):
    """The rule one token at a time over all rows at once, in plain torch ops.

    Args:
        q, k: `(L, B, Hk, Dk)`; v: `(L, B, Hv, Dv)`; a, b: `(L, B, Hv)`: L tokens of B rows.
        ssm_states: `(S, Hv, Dk, Dv)`, rows `slots (B,)` read and written back.

    Returns:
        `(L, B, Hv, Dv)` outputs.
    """
    g = -A_log.exp() * F.softplus(a.float() + dt_bias)  # (L, B, Hv)
    beta = beta_scale * torch.sigmoid(b.float())  # (L, B, Hv)
    q = F.normalize(q.float(), dim=-1, eps=1e-6) * DK**-0.5  # (L, B, Hk, Dk)
    k = F.normalize(k.float(), dim=-1, eps=1e-6)
    state = ssm_states[slots].float()  # (B, Hv, Dk, Dv)
    out = torch.empty(v.shape, dtype=torch.float32)
    for t in range(v.shape[0]):
        state.mul_(g[t].exp()[..., None, None])
        kv = torch.einsum("bhkv,bhk->bhv", state, k[t])  # (B, Hv, Dv)
        delta = (v[t].float() - kv) * beta[t][..., None]  # (B, Hv, Dv)
        state.add_(k[t][..., None] * delta[..., None, :])
        out[t] = torch.einsum("bhkv,bhk->bhv", state, q[t])
    ssm_states[slots] = state.to(ssm_states.dtype)
    return out.to(v.dtype)


def median_us(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn()` in microseconds, after two warm-up calls."""
    fn()
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def inputs(tokens: int, dtype: torch.dtype, state_dtype: torch.dtype, slots: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(tokens, HK, DK, generator=gen).to(dtype),
        "k": torch.randn(tokens, HK, DK, generator=gen).to(dtype),
        "v": torch.randn(tokens, HV, DV, generator=gen).to(dtype),
        "a": torch.randn(tokens, HV, generator=gen).to(dtype),
        "b": torch.randn(tokens, HV, generator=gen).to(dtype),
        "A_log": torch.rand(HV, generator=gen),
        "dt_bias": torch.randn(HV, generator=gen) * 0.5,
        "beta_scale": 1.0,
        "ssm_states": (torch.randn(slots, HV, DK, DV, generator=gen) * 0.1).to(state_dtype),
    }


def bench_prefill(dtype, state_dtype, repeats) -> dict[str, float]:
    x = inputs(PREFILL_TOKENS, dtype, state_dtype, 1)
    meta = {
        "query_start_loc": torch.tensor([0, PREFILL_TOKENS], dtype=torch.int32),
        "state_indices": torch.tensor([0], dtype=torch.int32),
        "has_initial_state": torch.tensor([True]),
    }
    seq = {n: x[n][:, None] for n in ("q", "k", "v", "a", "b")}  # one row: (L, 1, ...)
    recurrent = {**x, **seq, "slots": meta["state_indices"].long()}
    return {
        "cpp": median_us(lambda: cpu_kernels.gated_delta_varlen(**x, **meta), repeats),
        "ref": median_us(lambda: gated_delta_varlen_ref(**x, **meta), max(3, repeats // 4)),
        "torch": median_us(lambda: torch_recurrent(**recurrent), max(3, repeats // 4)),
    }


def bench_decode(rows, dtype, state_dtype, repeats) -> dict[str, float]:
    x = inputs(rows, dtype, state_dtype, rows)
    slots = torch.arange(rows, dtype=torch.int32)
    step = {n: x[n][None] for n in ("q", "k", "v", "a", "b")}  # one token: (1, B, ...)
    recurrent = {**x, **step, "slots": slots.long()}
    return {
        "cpp": median_us(lambda: cpu_kernels.gated_delta_update(**x, state_indices=slots), repeats),
        "ref": median_us(lambda: gated_delta_update_ref(**x, state_indices=slots), repeats),
        "torch": median_us(lambda: torch_recurrent(**recurrent), repeats),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--state-dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit("the C++ extension is not built: python setup.py build_ext --inplace")
    torch.set_num_threads(args.threads)
    dtype, state_dtype = getattr(torch, args.dtype), getattr(torch, args.state_dtype)
    rows = [("prefill 512", bench_prefill(dtype, state_dtype, args.repeats))]
    rows += [
        (f"decode {n}", bench_decode(n, dtype, state_dtype, args.repeats)) for n in DECODE_ROWS
    ]
    print(f"us/call, {args.threads} threads, inputs {args.dtype}, state {args.state_dtype}")
    print(f"{'workload':<12} {'cpp':>10} {'ref':>10} {'torch':>10} {'ref/cpp':>8} {'torch/cpp':>9}")
    for name, t in rows:
        print(
            f"{name:<12} {t['cpp']:>10.1f} {t['ref']:>10.1f} {t['torch']:>10.1f} "
            f"{t['ref'] / t['cpp']:>8.2f} {t['torch'] / t['cpp']:>9.2f}"
        )


if __name__ == "__main__":
    main()
