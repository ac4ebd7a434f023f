"""This engine against llama.cpp on the same GGUF files: load time, resident memory, decode.

For each file, in interleaved repetitions (the engine in a fresh process each time, so that
load time and resident memory are its own):
- engine: seconds from `LLM(file)` to a ready engine, the process's peak resident memory after
  the first decode, decode b1 (one sequence, `--tokens` greedy tokens after the prompt) and b32
  (32 sequences) through `compare_systems.EngineSystem`;
- llama.cpp: `llama-bench` (b1 decode, its load time not reported) and `llama-batched-bench`
  (b32 S_TG) through `compare_systems.LlamaCppSystem`;
- ik_llama.cpp, with `--ik-llama-cpp-home` / `$IK_LLAMA_CPP_HOME` (`setup_llama_cpp.sh`
  builds it): the same through `compare_systems.IkLlamaCppSystem` (`--ik-repack`: its
  run-time repacking, `-rtr`).

    python benchmarks/gguf_bench.py /tmp/llamacpp/gguf/mamba2-130m-random-{q8_0,q4_k_m}.gguf \
        --llama-bin /tmp/llamacpp/bin --ik-llama-cpp-home /tmp/ikllamacpp --reps 3

Medians of `--reps` runs are printed as a markdown table, the engine's ratios against each
other system, and the bandwidth bound of b1 (`bandwidth_bound.py`: the file's tensor bytes one
token reads over the read rate of a large `x.sum()` at `--threads` threads, measured before
and after the runs) with each system's b1 as a share of it; the machine's CPU and ISA level
head it. Documentation and automation only: never run in CI.
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

from bandwidth_bound import gguf_bytes_per_token, read_rate  # noqa: E402
from compare_systems import (  # noqa: E402
    IkLlamaCppSystem,
    LlamaCppSystem,
    failure_reason,
    random_prompts,
)

from vllm_mamba.config import QUANTIZATION_CHOICES  # noqa: E402

PROMPT_LEN = 32


def engine_run(
    gguf: str, tokens: int, threads: int, quantization: str | None = None
) -> dict[str, float]:
    """One fresh engine on `gguf`: load seconds, peak RSS MiB, b1 and b32 decode tok/s."""
    from compare_systems import EngineSystem

    start = time.perf_counter()
    system = EngineSystem(gguf, "auto", max_batch=32, threads=threads, quantization=quantization)
    load_s = time.perf_counter() - start
    system.warm_up(PROMPT_LEN)
    b1 = system.decode(random_prompts(1, PROMPT_LEN, seed=1), tokens)
    b32 = system.decode(random_prompts(32, PROMPT_LEN, seed=2), tokens)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"load_s": load_s, "peak_mib": peak_mib, "b1": b1, "b32": b32}


def _engine_in_subprocess(
    gguf: str, tokens: int, threads: int, quantization: str | None
) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--engine-child", gguf, "--tokens", str(tokens)]
    cmd += ["--threads", str(threads)]
    if quantization:
        cmd += ["--quantization", quantization]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise RuntimeError(f"engine run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+")
    parser.add_argument("--llama-bin", default="/tmp/llamacpp/bin")
    parser.add_argument(
        "--ik-llama-cpp-home",
        default=os.environ.get("IK_LLAMA_CPP_HOME"),
        help="ik_llama.cpp's bin/ lives here: adds it as a system",
    )
    parser.add_argument("--ik-repack", action="store_true", help="ik_llama.cpp with -rtr")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        help="the engine's load-time quantization (w4a8 / w4a8_k: the file's Q4_0 / Q4_K "
        "layers take integer dots)",
    )
    parser.add_argument("--engine-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine_child:
        print(json.dumps(engine_run(args.files[0], args.tokens, args.threads, args.quantization)))
        return

    from vllm_mamba.ops import cpu_isa

    print(f"CPU: {_cpu_name()}; engine ISA level {cpu_isa.active_level()}; {args.threads} threads")
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    rates = read_rate(args.threads)
    names = ["llama.cpp"] + (["ik_llama.cpp"] if args.ik_llama_cpp_home else [])
    rows: list[tuple[str, dict[str, float]]] = []
    for gguf in args.files:
        label = os.path.basename(gguf)
        others: dict[str, LlamaCppSystem] = {
            "llama.cpp": LlamaCppSystem(args.llama_bin, gguf, label, args.threads)
        }
        if args.ik_llama_cpp_home:
            others["ik_llama.cpp"] = IkLlamaCppSystem(
                os.path.join(args.ik_llama_cpp_home, "bin"), gguf, label, args.threads,
                repack=args.ik_repack,
            )  # fmt: skip
        runs: dict[str, list[float]] = {}
        for _ in range(args.reps):
            run = _engine_in_subprocess(gguf, args.tokens, args.threads, args.quantization)
            for key, value in run.items():
                runs.setdefault(key, []).append(value)
            for name, system in others.items():
                for b, seed in ((1, 1), (32, 2)):
                    try:
                        value = system.decode(random_prompts(b, PROMPT_LEN, seed), args.tokens)
                    except RuntimeError as e:  # a tool that fails: NaN, its reason printed
                        print(f"{name} b{b} on {label} fails: {failure_reason(e)}")
                        value = float("nan")
                    runs.setdefault(f"{name} b{b}", []).append(value)
        rows.append((gguf, {key: statistics.median(values) for key, values in runs.items()}))
    rates += read_rate(args.threads)
    rate = statistics.median(rates)

    cols = ["engine load s", "engine peak RSS MiB", "bound b1", "engine b1"]
    cols += [f"{n} b1" for n in names] + [f"b1 vs {n}" for n in names]
    cols += ["engine b32"] + [f"{n} b32" for n in names] + [f"b32 vs {n}" for n in names]
    print(f"| file | {' | '.join(cols)} |\n|---|" + "---|" * len(cols))
    for gguf, med in rows:
        bound = rate / gguf_bytes_per_token(gguf)
        cells = [f"{med['load_s']:.1f}", f"{med['peak_mib']:.0f}", f"{bound:.1f}"]
        for b in ("b1", "b32"):
            values = [med[b]] + [med[f"{n} {b}"] for n in names]
            # b1 with its share of the bound in brackets
            cells += [
                f"{v:.1f}" + (f" ({100 * v / bound:.0f}%)" if b == "b1" else "") for v in values
            ]
            cells += [f"{values[0] / v:.2f}x" for v in values[1:]]
        print(f"| {os.path.basename(gguf)} | {' | '.join(cells)} |")
    print(f"medians of {args.reps} interleaved runs; decode tok/s after a {PROMPT_LEN}-token "
          f"prompt, {args.tokens} tokens; bound b1: the file's tensor bytes per token "
          f"(embedding out unless tied) at {rate / 1e9:.1f} GB/s (x.sum(), median of "
          f"{len(rates)}), each b1's share of it in brackets; load average "
          f"{os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    for system in others.values():
        print(system.notes()[0])


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
