"""This engine against llama.cpp on the same GGUF files: load time, resident memory, decode.

For each file, in interleaved repetitions (the engine in a fresh process each time, so that
load time and resident memory are its own):
- engine: seconds from `LLM(file)` to a ready engine, the process's peak resident memory after
  the first decode, decode b1 (one sequence, `--tokens` greedy tokens after the prompt) and b32
  (32 sequences) through `compare_systems.EngineSystem`;
- llama.cpp: `llama-bench` (b1 decode, its load time not reported) and `llama-batched-bench`
  (b32 S_TG) through `compare_systems.LlamaCppSystem`.

    python benchmarks/gguf_bench.py /tmp/llamacpp/gguf/mamba2-130m-random-{q8_0,q4_k_m}.gguf \
        --llama-bin /tmp/llamacpp/bin --reps 3

Medians of `--reps` runs are printed as a markdown table; the machine's CPU and ISA level head
it. Documentation and automation only: never run in CI.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compare_systems import LlamaCppSystem, random_prompts  # noqa: E402

PROMPT_LEN = 32


def engine_run(gguf: str, tokens: int, threads: int) -> dict[str, float]:
    """One fresh engine on `gguf`: load seconds, peak RSS MiB, b1 and b32 decode tok/s."""
    from compare_systems import EngineSystem

    start = time.perf_counter()
    system = EngineSystem(gguf, "auto", max_batch=32, threads=threads)
    load_s = time.perf_counter() - start
    system.warm_up(PROMPT_LEN)
    b1 = system.decode(random_prompts(1, PROMPT_LEN, seed=1), tokens)
    b32 = system.decode(random_prompts(32, PROMPT_LEN, seed=2), tokens)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"load_s": load_s, "peak_mib": peak_mib, "b1": b1, "b32": b32}


def _engine_in_subprocess(gguf: str, tokens: int, threads: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--engine-child", gguf, "--tokens", str(tokens)]
    cmd += ["--threads", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"engine run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--llama-bin", default="/tmp/llamacpp/bin")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        print(json.dumps(engine_run(args.files[0], args.tokens, args.threads)))
        return

    from vllm_mamba.ops import cpu_isa

    print(f"CPU: {_cpu_name()}; engine ISA level {cpu_isa.active_level()}; {args.threads} threads")
    print("| file | engine load s | engine peak RSS MiB | engine b1 | llama.cpp b1 | b1 ratio "
          "| engine b32 | llama.cpp b32 | b32 ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for gguf in args.files:
        llama = LlamaCppSystem(args.llama_bin, gguf, os.path.basename(gguf), args.threads)
        runs: dict[str, list[float]] = {}
        for _ in range(args.reps):
            for key, value in _engine_in_subprocess(gguf, args.tokens, args.threads).items():
                runs.setdefault(key, []).append(value)
            prompts1 = random_prompts(1, PROMPT_LEN, seed=1)
            runs.setdefault("llama_b1", []).append(llama.decode(prompts1, args.tokens))
            prompts32 = random_prompts(32, PROMPT_LEN, seed=2)
            runs.setdefault("llama_b32", []).append(llama.decode(prompts32, args.tokens))
        med = {key: statistics.median(values) for key, values in runs.items()}
        print(
            f"| {os.path.basename(gguf)} | {med['load_s']:.1f} | {med['peak_mib']:.0f} "
            f"| {med['b1']:.1f} | {med['llama_b1']:.1f} | {med['b1'] / med['llama_b1']:.2f}x "
            f"| {med['b32']:.1f} | {med['llama_b32']:.1f} | {med['b32'] / med['llama_b32']:.2f}x |"
        )
    print(f"medians of {args.reps} interleaved runs; decode tok/s after a {PROMPT_LEN}-token "
          f"prompt, {args.tokens} tokens; {llama.notes()[0]}")  # fmt: skip


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
