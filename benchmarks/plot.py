"""PNG charts of benchmark results (matplotlib, Agg backend; needs only the results files).

- `serve`: from `vllm-mamba bench serve --save-result` JSONs (or `vllm bench serve`'s, same
  keys) at several request rates: median and p99 TTFT and TPOT against the request rate, one
  line per system. A result's system is its `--labels` entry, else its `label`, else its
  `backend`; `request_rate` "inf" is drawn at the right of the finite rates.
- `throughput`: tokens/s by workload, grouped bars per system, from `benchmarks/compare.py
  --json` output (`samples[system][workload]`: the median of the repetitions is drawn) or a
  CSV / JSON list of `system, workload, tokens_per_s` rows.

    python benchmarks/plot.py serve engine-*.json vllm-*.json -o latency.png
    python benchmarks/plot.py serve a.json b.json --labels engine vllm -o latency.png
    python benchmarks/plot.py throughput compare.json -o throughput.png
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import statistics
import sys
from collections import defaultdict
from typing import Any

SERVE_PANELS = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"))


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _rate(value: Any) -> float:
    return math.inf if value in (None, "inf") else float(value)


def load_serve_results(paths: list[str], labels: list[str] | None) -> dict[str, list[dict]]:
    """`{system: [result, ...]}` sorted by request rate."""
    if labels and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} --labels for {len(paths)} results")
    systems: dict[str, list[dict]] = defaultdict(list)
    for i, path in enumerate(paths):
        with open(path) as f:
            result = json.load(f)
        name = labels[i] if labels else result.get("label") or result.get("backend") or path
        systems[name].append(result)
    for results in systems.values():
        results.sort(key=lambda r: _rate(r.get("request_rate")))
    return dict(systems)


def plot_serve(systems: dict[str, list[dict]], out: str, title: str | None = None) -> None:
    """Median (solid) and p99 (dashed) TTFT and TPOT against the request rate."""
    plt = _pyplot()
    finite = [_rate(r.get("request_rate")) for rs in systems.values() for r in rs]
    finite = [x for x in finite if not math.isinf(x)]
    inf_x = (max(finite) * 1.5) if finite else 1.0
    fig, axes = plt.subplots(1, len(SERVE_PANELS), figsize=(6 * len(SERVE_PANELS), 4.5))
    for ax, (metric, ylabel) in zip(axes, SERVE_PANELS):
        for i, (name, results) in enumerate(systems.items()):
            color = f"C{i}"
            xs = [_rate(r.get("request_rate")) for r in results]
            xs = [inf_x if math.isinf(x) else x for x in xs]
            for stat, style in (("median", "-"), ("p99", "--")):
                key = f"{stat}_{metric}_ms"
                points = [(x, r[key]) for x, r in zip(xs, results) if r.get(key) is not None]
                if points:
                    px, py = zip(*points)
                    ax.plot(px, py, style, marker="o", color=color, label=f"{name} {stat}")
        ax.set_xlabel("request rate (req/s)" + (f"; inf at {inf_x:g}" if finite else ""))
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def load_throughput(path: str) -> dict[str, dict[str, float]]:
    """`{system: {workload: tokens/s}}` from compare.py's JSON or `system, workload,
    tokens_per_s` rows (CSV with a header, a JSON list of objects, or such a list under
    `"rows"` as in `benchmarks/results/current.json`)."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            rows: list[dict] = list(csv.DictReader(f))
    else:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and "samples" in data:
            return {
                system: {w: statistics.median(v) for w, v in workloads.items() if v}
                for system, workloads in data["samples"].items()
            }
        rows = data["rows"] if isinstance(data, dict) and "rows" in data else data
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for row in rows:
        table[str(row["system"]).strip()][str(row["workload"]).strip()] = float(row["tokens_per_s"])
    return dict(table)


def plot_throughput(
    table: dict[str, dict[str, float]],
    out: str,
    title: str | None,
    match: str | None = None,
    log: bool = False,
) -> None:
    """Grouped horizontal bars: one group per workload (those containing `match`), one bar
    per system, tokens/s on the x axis (logarithmic with `log`)."""
    plt = _pyplot()
    workloads: list[str] = []
    for per_system in table.values():
        workloads += [w for w in per_system if w not in workloads and (not match or match in w)]
    if not workloads:
        raise ValueError(f"no workload matches {match!r}")
    systems = [s for s in table if any(w in table[s] for w in workloads)]
    height = 0.8 / max(len(systems), 1)
    fig, ax = plt.subplots(figsize=(9.0, 1.0 + 0.22 * len(workloads) * max(len(systems), 2)))
    for i, system in enumerate(systems):
        ys = [j + (i - (len(systems) - 1) / 2) * height for j in range(len(workloads))]
        xs = [table[system].get(w, 0.0) for w in workloads]
        bars = ax.barh(ys, xs, height, label=system, color=f"C{i}")
        ax.bar_label(bars, labels=[f"{x:.0f}" if x else "" for x in xs], fontsize=7, padding=2)
    ax.set_yticks(range(len(workloads)), workloads, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s" + (" (log scale)" if log else ""))
    if log:
        ax.set_xscale("log")
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(loc="lower right")
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="kind", required=True)
    serve = sub.add_parser("serve", help="latency against request rate from bench serve JSONs")
    serve.add_argument("results", nargs="+", help="bench serve result JSONs")
    serve.add_argument("--labels", nargs="+", default=None, help="one system name per result")
    serve.add_argument("-o", "--output", default="serve_latency.png")
    serve.add_argument("--title", default=None)
    tput = sub.add_parser("throughput", help="tokens/s by workload, bars per system")
    tput.add_argument("file", help="compare.py --json output, or system,workload,tokens_per_s")
    tput.add_argument("-o", "--output", default="throughput.png")
    tput.add_argument("--title", default=None)
    tput.add_argument("--match", default=None, help="only workloads containing this text")
    tput.add_argument("--log", action="store_true", help="logarithmic tokens/s axis")
    args = parser.parse_args(argv)
    try:
        if args.kind == "serve":
            plot_serve(load_serve_results(args.results, args.labels), args.output, args.title)
        else:
            table = load_throughput(args.file)
            plot_throughput(table, args.output, args.title, args.match, args.log)
    except (OSError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
