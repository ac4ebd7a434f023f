"""The engine in float32, int8, bfloat16 and bfloat16 + int8, in one process, interleaved.

The same workloads as `compare.py` (its `EngineSystem`): prefill of one 512-token prompt and
decode of 1, 32 and 128 sequences (16-token prompts, 32 tokens), tokens/s, medians of `--reps`.
One repetition of every configuration runs before the next repetition of any, so a busy
minute on a shared machine hits them alike; read the ratios, and the load average printed.

    python benchmarks/compare_precisions.py --model /tmp/mamba-130m-random
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from compare_systems import EngineSystem, random_prompts

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {  # name: (dtype, quantization)
    "float32": ("float32", None),
    "int8": ("float32", "int8"),
    "bfloat16": ("bfloat16", None),
    "bfloat16 + int8": ("bfloat16", "int8"),
}
BATCHES = (1, 32, 128)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="/tmp/mamba-130m-random")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=32)
    args = p.parse_args()
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import torch

    torch.set_num_threads(args.threads)
    load, t0 = os.getloadavg()[0], time.perf_counter()
    systems = {n: EngineSystem(args.model, d, max(BATCHES), q) for n, (d, q) in CONFIGS.items()}
    for system in systems.values():
        system.warm_up(16)
    work = ["prefill 512", *(f"decode b{b}" for b in BATCHES)]
    samples: dict[str, dict[str, list[float]]] = {n: {w: [] for w in work} for n in systems}
    prefill = random_prompts(1, 512, seed=1)[0]
    for rep in range(args.reps):
        for name, system in systems.items():
            got = {"prefill 512": system.prefill(prefill)}
            for b in BATCHES:
                prompts = random_prompts(b, 16, seed=100 + b)
                got[f"decode b{b}"] = system.decode(prompts, args.decode_tokens)
            for w, v in got.items():
                samples[name][w].append(v)
            shown = ", ".join(f"{w} {v:.1f}" for w, v in got.items())
            print(f"rep {rep + 1} {name}: {shown}", flush=True)
    print(
        f"\n{args.threads} threads, medians of {args.reps}, total {time.perf_counter() - t0:.0f} "
        f"s, 1-min load average {load:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    names = list(systems)
    print("| workload (tok/s) | " + " | ".join(names) + " | int8 / float32 | bf16 / float32 |")
    print("|---|" + "---|" * (len(names) + 2))
    for w in work:
        m = {n: statistics.median(samples[n][w]) for n in names}
        ratios = f"{m['int8'] / m['float32']:.2f}x | {m['bfloat16'] / m['float32']:.2f}x"
        print(f"| {w} | " + " | ".join(f"{m[n]:.1f}" for n in names) + f" | {ratios} |")


if __name__ == "__main__":
    main()
