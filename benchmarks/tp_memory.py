"""Memory per rank with tensor parallelism: weights and state, at TP=1 and TP=2.

For each model directory, starts an engine with `tensor_parallel_size` 1 and then 2 (CPU,
gloo) and prints, per rank: the bytes of its parameters, of its state cache (conv + SSM state
of `--max-num-seqs` slots) and the resident memory of its process (`VmRSS`, which includes
the Python and torch runtime of each process). Rank 1's parameters are those of its shard,
built here without a process group.

    python benchmarks/make_model.py /tmp/mamba-130m-random
    python benchmarks/make_model.py /tmp/mamba2-130m-random --arch mamba2
    python benchmarks/tp_memory.py /tmp/mamba-130m-random /tmp/mamba2-130m-random
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import torch

MIB = 2**20


def _rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def measure(path: str, tp: int, max_num_seqs: int) -> None:
    """Prints one line per rank of an engine with `tp` ranks on `path`."""
    from vllm_mamba import LLM
    from vllm_mamba.distributed.parallel_state import TensorParallel
    from vllm_mamba.model_loader import build_model, load_hf_config

    llm = LLM(path, device="cpu", max_num_seqs=max_num_seqs, tensor_parallel_size=tp)
    engine = llm.llm_engine
    rows = [(0, _param_bytes(engine.model), engine.cache.nbytes(), _rss_mib())]
    if tp == 2:
        worker_rss = _rss_mib(engine.executor.procs[0].pid)
        config = load_hf_config(path)
        cpu, rank1 = torch.device("cpu"), TensorParallel(1, 2)
        shard, _ = build_model(path, config, torch.float32, cpu, rank1)
        rows.append((1, _param_bytes(shard), engine.cache.nbytes(), worker_rss))
    for rank, weights, state, rss in rows:
        print(
            f"{path} tp={tp} rank={rank}: weights {weights / MIB:7.1f} MiB, "
            f"state {state / MIB:6.1f} MiB ({max_num_seqs} slots), process RSS {rss:6.1f} MiB",
            flush=True,
        )
    engine.executor.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("paths", nargs="+", help="model directories (benchmarks/make_model.py)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="state slots")
    parser.add_argument("--tp", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tp is not None:
        measure(args.paths[0], args.tp, args.max_num_seqs)
        return
    for path in args.paths:  # one process per engine, so that each RSS is that engine's alone
        for tp in (1, 2):
            cmd = [sys.executable, __file__, path, "--tp", str(tp)]
            subprocess.run([*cmd, "--max-num-seqs", str(args.max_num_seqs)], check=True)


if __name__ == "__main__":
    main()
