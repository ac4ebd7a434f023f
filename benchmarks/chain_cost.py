"""What one speculative verification step costs against a plain decode step, single stream.

One engine (`--model`, `--dtype`, `--quantization`, pinned to `--threads`) with speculation on
(`ngram`, `num_speculative_tokens = --k`) decodes one sequence twice per repetition,
interleaved: once with a proposer that drafts nothing (every forward a plain b1 step) and once
with one that drafts `--k` random token ids at every step (`spec_decode_bench.RejectedDrafts`:
every forward verifies a chain of k + 1 rows, which is almost always rejected), with the
engine's back-off after rejected chains switched off. Timed: the engine steps after the
prompt's (one forward each). Printed: milliseconds per forward of each (the median over
`--reps`) and their ratio, the cost of a chain in plain steps (issue 48's target: at most 1.3
for k = 4).

    python benchmarks/chain_cost.py --model /tmp/qwen3.5-0.8b-random --quantization w4a8
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

from vllm_mamba.config import QUANTIZATION_CHOICES

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class NoDrafts:
    """A proposer that never drafts: the speculative engine then runs plain steps."""

    def propose(self, seqs: list) -> list[list[int]]:
        return [[] for _ in seqs]

    def on_finished(self, seq) -> None:  # noqa: ANN001
        pass


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--quantization", default=None, choices=QUANTIZATION_CHOICES)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=24, help="tokens decoded per run")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    from spec_decode_bench import RejectedDrafts

    from vllm_mamba import LLM, SamplingParams
    from vllm_mamba.engine import spec_steps

    llm = LLM(
        args.model, dtype=args.dtype, quantization=args.quantization, threads=args.threads,
        max_num_seqs=1, max_model_len=4096, disable_log_stats=True,
        speculative_config={"method": "ngram", "num_speculative_tokens": args.k},
    )  # fmt: skip
    engine = llm.llm_engine
    vocab = engine.config.model_config.hf_config.vocab_size
    spec_steps.MAX_BACKOFF_STEPS = 0  # a chain at every step of the rejected runs
    prompt = list(range(3, 3 + args.prompt_len))
    ids = itertools.count()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    proposers = {"plain": NoDrafts(), f"k={args.k} rejected": RejectedDrafts(vocab)}

    def ms_per_forward(proposer) -> float:  # noqa: ANN001
        """One sequence's decode steps after its prompt's: milliseconds per engine step (one
        forward each: a plain step or a chain's verification)."""
        engine.spec_steps.proposer = proposer
        engine.add_request(f"r{next(ids)}", prompt, params)
        while (
            not engine.scheduler.running or not engine.scheduler.running[0].seqs[0].output_token_ids
        ):
            engine.step()  # the prompt's step, left out
        steps, start = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return 1000 * (time.perf_counter() - start) / steps

    times: dict[str, list[float]] = {name: [] for name in proposers}
    ms_per_forward(proposers["plain"])  # warm-up
    for _ in range(args.reps):
        for name, proposer in proposers.items():
            times[name].append(ms_per_forward(proposer))
    med = {name: statistics.median(v) for name, v in times.items()}
    label = args.quantization or args.dtype
    for name, v in times.items():
        print(f"{label} {name}: {med[name]:.2f} ms/forward  ({', '.join(f'{t:.2f}' for t in v)})")
    plain, chain = med["plain"], med[f"k={args.k} rejected"]
    print(f"{label}: a k={args.k} verification step costs {chain / plain:.2f}x a plain step")


if __name__ == "__main__":
    main()
