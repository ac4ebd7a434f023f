"""Held-out loss of the shipped model (`tiny-stdlib`) through the engine, per precision.

The data are the held-out files of `scripts/train_tiny_mamba.py` (every 20th file of the
Python standard library, by sorted path), tokenised with the shipped tokenizer and cut into the
same 807 non-overlapping 257-token windows as its model card's "held-out loss" (3.9172 in
float32 with transformers). Each window goes through `LLM.generate` with `prompt_logprobs=1`:
the loss is the mean negative log-probability of every window token after the first, and the
top-1 token at each of those positions is compared with the float32 engine's (teacher-forced
agreement). Free-running greedy agreement: the tokens of 64-token greedy continuations of the
model card's prompts that equal the float32 ones (up to the first difference).

    python benchmarks/heldout_loss.py                  # every config below (float32 first)
    python benchmarks/heldout_loss.py --windows 200    # a quicker subset
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {
    "float32": dict(dtype="float32"),
    "int8": dict(dtype="float32", quantization="int8"),
    "int4": dict(dtype="float32", quantization="int4"),
    "w8a8": dict(dtype="float32", quantization="w8a8"),
    "w4a8": dict(dtype="float32", quantization="w4a8"),
    "w4a8_k": dict(dtype="float32", quantization="w4a8_k"),
    "bfloat16": dict(dtype="bfloat16"),
    "bfloat16 + int8": dict(dtype="bfloat16", quantization="int8"),
}
PROMPTS = ["def ", "import ", "class ", "    for ", "if __name__"]


def heldout_windows(tokenizer_file: str, limit: int | None) -> list[list[int]]:
    """The model card's held-out windows (`seq_len + 1` tokens each), the first `limit`."""
    sys.path.insert(0, os.path.join(REPO_ROOT, "scripts"))
    from tokenizers import Tokenizer
    from train_tiny_mamba import EOT, encode_stream, list_stdlib_files, read_texts, windows

    root, rels = list_stdlib_files()
    rels, texts, _ = read_texts(root, rels)
    held = [t for i, t in enumerate(texts) if i % 20 == 19]
    tok = Tokenizer.from_file(tokenizer_file)
    stream = encode_stream(tok, held, tok.token_to_id(EOT))
    wins = windows(stream, 256).tolist()
    return wins[:limit] if limit else wins


def evaluate(path: str, wins: list[list[int]], **engine_kwargs) -> dict:  # noqa: ANN003
    """Loss, per-position top-1 tokens and greedy continuations of one engine configuration."""
    from vllm_mamba import LLM, SamplingParams

    llm = LLM(path, max_num_seqs=64, **engine_kwargs)
    start = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": w} for w in wins], params, use_tqdm=False)
    total, count, top1 = 0.0, 0, []
    for win, out in zip(wins, outs):
        for pos in range(1, len(win)):
            entry = out.prompt_logprobs[pos]
            total -= entry[win[pos]].logprob
            count += 1
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)
    return {
        "loss": total / count,
        "positions": count,
        "top1": top1,
        "greedy": [o.outputs[0].token_ids for o in greedy],
        "seconds": time.perf_counter() - start,
    }


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=None, help="first N windows (default: all)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, of CONFIGS")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import torch

    from vllm_mamba.model_zoo import DEFAULT_MODEL, shipped_model_path

    torch.set_num_threads(args.threads)
    path = shipped_model_path(DEFAULT_MODEL)
    wins = heldout_windows(os.path.join(path, "tokenizer.json"), args.windows)
    load = os.getloadavg()[0]
    results = {name: evaluate(path, wins, **CONFIGS[name]) for name in args.configs.split(",")}
    base = results.get("float32")
    print(f"\n{len(wins)} windows, 1-min load average {load:.1f} before, {os.getloadavg()[0]:.1f}")
    print("| config | held-out loss | vs float32 | top-1 agreement | greedy agreement |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        rel = agree = greedy = "—"
        if base is not None:
            rel = f"{(r['loss'] / base['loss'] - 1) * 100:+.2f}%"
            same = sum(a == b for a, b in zip(r["top1"], base["top1"]))
            agree = f"{same / len(r['top1']) * 100:.2f}%"
            prefix = [common_prefix(a, b) for a, b in zip(r["greedy"], base["greedy"])]
            greedy = f"{sum(prefix)}/{sum(len(g) for g in base['greedy'])} tokens"
        print(f"| {name} | {r['loss']:.4f} | {rel} | {agree} | {greedy} |")


if __name__ == "__main__":
    main()
