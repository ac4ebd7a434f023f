"""llama.cpp against ik_llama.cpp on the same GGUF files, in one run, with the bandwidth bound.

For each file and each system (`compare_systems.LlamaCppSystem` / `IkLlamaCppSystem`), in
interleaved repetitions: `prefill 512` (`llama-bench -p 512`), `decode b1` (`llama-bench -n`)
and `decode bN` for each `--batches` N above 1 (`llama-batched-bench` S_TG, N streams of a
16-token prompt). Medians are printed as a markdown table with ik_llama.cpp over llama.cpp,
and each b1 beside its bandwidth bound (`bandwidth_bound.py`: the file's tensor bytes one token
reads over the rate of a large `x.sum()` at `--threads` threads, measured before and after).
A run that fails (ik_llama.cpp cannot run 16 or more Qwen3.5 streams: its Gated DeltaNet graph
is built once per token of a mixed-sequence batch and outgrows its graph size,
`ggml.c: GGML_ASSERT(cgraph->n_nodes < cgraph->size)`) is reported as failing with its
assertion and not retried. No engine runs here (`gguf_bench.py` and `hybrid_bench.py` add it).

    python benchmarks/llama_cpp_bench.py /tmp/llamacpp/gguf/qwen3.5-0.8b-random-{q8_0,q4_0}.gguf \
        --llama-cpp-home /tmp/llamacpp --ik-llama-cpp-home /tmp/ikllamacpp --reps 3

Documentation and automation only: never run in CI.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bandwidth_bound import BOUND_HEAD, bound_line, gguf_bytes_per_token, read_rate  # noqa: E402
from compare_systems import IkLlamaCppSystem, LlamaCppSystem, failure_reason  # noqa: E402

PROMPT_LEN = 16  # batched rows: each stream's prompt
LLAMA_NAMES = ("llama.cpp", "ik_llama.cpp")  # the systems' `project`s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+")
    p.add_argument("--llama-cpp-home", default=os.environ.get("LLAMA_CPP_HOME", "/tmp/llamacpp"))
    p.add_argument(
        "--ik-llama-cpp-home", default=os.environ.get("IK_LLAMA_CPP_HOME", "/tmp/ikllamacpp")
    )
    p.add_argument("--ik-repack", action="store_true", help="ik_llama.cpp with -rtr")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32, help="decode tokens of the b1 row")
    p.add_argument("--batch-tokens", type=int, help="decode tokens of bN > 1 (default --tokens)")
    p.add_argument(
        "--prefill", type=int, default=512, help="prefill row's prompt length (0: no prefill row)"
    )
    p.add_argument(
        "--batches",
        type=lambda v: [int(b) for b in v.split(",")],
        default=[1, 32],
        help="decode batch sizes, comma-separated (default 1,32)",
    )
    args = p.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f} at the start; {args.threads} threads")
    rates = read_rate(args.threads)
    rows = {f"prefill {args.prefill}": lambda s: s.prefill([0] * args.prefill)}
    if args.prefill == 0:
        rows = {}
    for b in args.batches:
        tokens = args.tokens if b == 1 else args.batch_tokens or args.tokens
        rows[f"decode b{b}"] = lambda s, b=b, n=tokens: s.decode([[0] * PROMPT_LEN] * b, n)
    results: dict[tuple[str, str, str], list[float]] = {}  # (file, row, system) -> tok/s
    failed: dict[tuple[str, str, str], str] = {}  # (file, row, system) -> the failure
    systems: dict[str, list] = {}
    for gguf in args.files:
        label = os.path.basename(gguf)
        systems[gguf] = [
            LlamaCppSystem(os.path.join(args.llama_cpp_home, "bin"), gguf, label, args.threads),
            IkLlamaCppSystem(
                os.path.join(args.ik_llama_cpp_home, "bin"), gguf, label, args.threads,
                repack=args.ik_repack,
            ),
        ]  # fmt: skip
    for rep in range(args.reps):
        for gguf, pair in systems.items():
            for row, fn in rows.items():
                for s in pair:
                    key, name = (gguf, row, s.project), os.path.basename(gguf)
                    if key in failed:
                        continue
                    try:
                        value = fn(s)
                    except RuntimeError as e:
                        failed[key] = failure_reason(e)
                        print(f"rep {rep} {name} {row} {s.project} fails: {failed[key]}")
                        continue
                    results.setdefault(key, []).append(value)
                    print(f"rep {rep} {name} {row} {s.project}: {value:.2f}", flush=True)
    rates += read_rate(args.threads)
    rate = statistics.median(rates)

    print("\n| file | row | llama.cpp tok/s | ik_llama.cpp tok/s | ik / llama.cpp |")
    print("|---|---|---|---|---|")
    for gguf in args.files:
        for row in rows:
            med = [
                statistics.median(results.get((gguf, row, n)) or [float("nan")])
                for n in LLAMA_NAMES
            ]
            cells = [
                f"fails ({failed[(gguf, row, n)]})" if (gguf, row, n) in failed else f"{m:,.1f}"
                for n, m in zip(LLAMA_NAMES, med)
            ]
            ratio = f"{med[1] / med[0]:.2f}x" if med[0] == med[0] and med[1] == med[1] else "-"
            print(f"| {os.path.basename(gguf)} | {row} | {' | '.join(cells)} | {ratio} |")
    if "decode b1" in rows:
        print(f"\nBandwidth bound of decode b1 (read rate: median of {len(rates)} passes of a "
              f"512 MiB x.sum(), {min(rates) / 1e9:.1f}-{max(rates) / 1e9:.1f} GB/s)")  # fmt: skip
        print(
            BOUND_HEAD.replace("| system |", "| file | system |").replace("|---|", "|---|---|", 1)
        )
        for gguf in args.files:
            per_token = gguf_bytes_per_token(gguf)
            for n in LLAMA_NAMES:
                if (gguf, "decode b1", n) in failed:
                    continue
                measured = statistics.median(results[(gguf, "decode b1", n)])
                print(f"| {os.path.basename(gguf)} " + bound_line(n, per_token, rate, measured))
    for s in systems[args.files[-1]]:
        print(s.notes()[0])
    print(f"medians of {args.reps} interleaved repetitions; b1 {args.tokens} tokens, bN "
          f"{args.batch_tokens or args.tokens}; "
          f"load average {os.getloadavg()[0]:.2f} at the end")  # fmt: skip


if __name__ == "__main__":
    main()
