"""GPU benchmark: vllm_mamba beside transformers on a `mamba-130m-hf`-shaped model (bfloat16).

Measures, on the same GPU and model in one run (medians of several runs):
prefill tokens/s of one 512-token prompt, single-stream decode latency per token, and
output tokens/s with 256 concurrent streams. Prints a markdown table and writes JSON.

    python benchmarks/gpu_bench.py --out gpu_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from make_model import write_model


def make_model(path: str) -> str:
    """Writes the benchmark model (`make_model.py`) to `path` once; returns `path`."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_model(path)
    return path


def timed(fn, reps: int) -> float:
    """Median wall seconds of `fn()` over `reps` runs after one warm-up, GPU synchronised."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 50000, (n, length), generator=g).tolist()


def bench_engine(path: str, dtype: str, streams: int, out_len: int, reps: int) -> dict:
    from vllm_mamba import LLM, SamplingParams

    llm = LLM(path, dtype=dtype, max_num_seqs=streams, max_num_batched_tokens=8192)

    def gen(ps: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)

    one_512 = prompts(1, 512)
    prefill_s = timed(lambda: gen(one_512, 1), reps)
    short = prompts(1, 16)
    decode_s = timed(lambda: gen(short, out_len + 1), reps) - timed(lambda: gen(short, 1), reps)
    many = prompts(streams, 16)
    batch_s = timed(lambda: gen(many, out_len), max(1, reps // 2))
    return {
        "prefill_tok_s": 512 / prefill_s,
        "decode_ms_per_token": 1000 * decode_s / out_len,
        "throughput_tok_s": streams * out_len / batch_s,
    }


def bench_transformers(path: str, dtype: str, streams: int, out_len: int, reps: int) -> dict:
    from transformers import MambaForCausalLM

    model = MambaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).cuda().eval()

    def gen(ps: list[list[int]], max_tokens: int) -> None:
        ids = torch.tensor(ps, device="cuda")
        with torch.no_grad():
            model.generate(
                ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
            )

    one_512 = prompts(1, 512)
    prefill_s = timed(lambda: gen(one_512, 1), reps)
    short = prompts(1, 16)
    decode_s = timed(lambda: gen(short, out_len + 1), reps) - timed(lambda: gen(short, 1), reps)
    many = prompts(streams, 16)
    batch_s = timed(lambda: gen(many, out_len), 1)
    return {
        "prefill_tok_s": 512 / prefill_s,
        "decode_ms_per_token": 1000 * decode_s / out_len,
        "throughput_tok_s": streams * out_len / batch_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="/tmp/mamba-130m-random")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--out-len", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    path = make_model(args.model_dir)
    results = {
        "gpu": torch.cuda.get_device_name(),
        "dtype": args.dtype,
        "vllm_mamba": bench_engine(path, args.dtype, args.streams, args.out_len, args.reps),
    }
    if not args.skip_transformers:
        results["transformers"] = bench_transformers(
            path, args.dtype, args.streams, args.out_len, args.reps
        )
    rows = [
        ("prefill, one 512-token prompt (tok/s)", "prefill_tok_s", True),
        ("decode, 1 stream (ms/token)", "decode_ms_per_token", False),
        (f"decode, {args.streams} streams (output tok/s)", "throughput_tok_s", True),
    ]
    print(f"\n{results['gpu']}, {args.dtype}, mamba-130m-shaped random weights\n")
    print("| workload | vllm_mamba | transformers | ratio |\n|---|---|---|---|")
    for label, key, higher_better in rows:
        ours = results["vllm_mamba"][key]
        theirs = results.get("transformers", {}).get(key)
        ratio = (
            "" if theirs is None else f"{(ours / theirs if higher_better else theirs / ours):.1f}x"
        )
        other = "" if theirs is None else f"{theirs:.1f}"
        print(f"| {label} | {ours:.1f} | {other} | {ratio} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
