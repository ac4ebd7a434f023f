"""Prefix caching on against off, in one run: three workloads that recompute shared prefixes.

1. `system`: a shared system prompt (1,024 tokens) with 64 different 32-token questions, all
   arriving at once, 16 tokens generated each: time to first token p50 and total time.
2. `chat`: 8-turn conversations (4 at once); each turn's prompt is the last prompt plus its
   answer (32 tokens) plus a new 32-token message: time to first token per turn and the hit
   rate (cached tokens over the earlier turn's prompt plus answer).
3. `mc`: lm-eval-style multiple choice through the OpenAI server: 100 items, each a 256-token
   context with 4 continuations of 8 tokens, one `/v1/completions` request per item (its 4
   prompts as a batch, `echo`, `logprobs=1`, `max_tokens=1`, as lm-eval scores
   log-likelihoods): items per second; the continuation logprobs are compared between the two
   servers.

Workloads 1 and 2 run in process through `LLMEngine`; medians of `--reps` runs. The models:
`--arch mamba` (the `mamba-130m-hf` shape of `make_model.py`) or `--arch jamba` (a Jamba
hybrid, see `JAMBA`), random weights, float32.

    python benchmarks/prefix_cache.py --arch mamba
    python benchmarks/prefix_cache.py --arch jamba --workloads system,chat
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_model import TOKENIZER_DIR, write_model  # noqa: E402

# A Jamba hybrid of ~160M parameters: 12 layers, attention at 2, 6 and 10, dense MLPs.
JAMBA = dict(
    vocab_size=50280,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    attn_layer_period=4,
    attn_layer_offset=2,
    num_experts=1,
    num_experts_per_tok=1,
    expert_layer_period=1,
    expert_layer_offset=0,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)


def write_jamba(path: str) -> str:
    """Saves the Jamba benchmark model (seeded N(0, 0.02^2) weights) and the tokenizer."""
    import shutil

    from transformers import JambaConfig, JambaForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        JambaForCausalLM(JambaConfig(**JAMBA)).save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return path


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 50000) for _ in range(n)]


def engine(path: str, cached: bool, max_model_len: int):  # noqa: ANN201 - LLMEngine
    from vllm_mamba import EngineArgs
    from vllm_mamba.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=path,
        enable_prefix_caching=cached,
        disable_log_stats=True,
        max_model_len=max_model_len,
    )
    return LLMEngine.from_engine_args(args)


def run_all(eng, prompts: list[list[int]], max_tokens: int) -> list:  # noqa: ANN001
    """Adds every prompt at once and steps until done; the final outputs in order."""
    from vllm_mamba import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tag = f"r{time.monotonic_ns()}"
    for i, p in enumerate(prompts):
        eng.add_request(f"{tag}-{i}", {"prompt_token_ids": p}, params)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[f"{tag}-{i}"] for i in range(len(prompts))]


def ttft(out) -> float:  # noqa: ANN001
    return out.metrics["first_token_time"] - out.metrics["arrival_time"]


def system_workload(eng, args: argparse.Namespace, seed: int) -> dict:  # noqa: ANN001
    rng = random.Random(seed)
    system = ids(rng, args.system_len)
    prompts = [system + ids(rng, args.question_len) for _ in range(args.questions)]
    start = time.perf_counter()
    outs = run_all(eng, prompts, 16)
    total = time.perf_counter() - start
    return {
        "ttft_p50": statistics.median(ttft(o) for o in outs),
        "total": total,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }


def chat_workload(eng, args: argparse.Namespace, seed: int) -> dict:  # noqa: ANN001
    rng = random.Random(seed)
    convs = [ids(rng, args.message_len) for _ in range(args.conversations)]
    ttfts, rates, tokens = [], [], []
    last: list[tuple[list[int], list[int]]] = []
    for turn in range(args.turns):
        if turn:
            convs = [p + a + ids(rng, args.message_len) for p, a in last]
        outs = run_all(eng, convs, args.answer_len)
        ttfts.append(statistics.median(ttft(o) for o in outs))
        if turn:
            earlier = [len(p) + len(a) for p, a in last]
            cached = [o.num_cached_tokens or 0 for o in outs]
            rates.append(sum(cached) / sum(earlier))
        last = [(p, o.outputs[0].token_ids) for p, o in zip(convs, outs)]
        tokens += [o.outputs[0].token_ids for o in outs]
    return {"ttft_per_turn": ttfts, "hit_rate_per_turn": rates, "tokens": tokens}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mc_workload(path: str, cached: bool, args: argparse.Namespace, seed: int) -> dict:
    """Items per second through a real server, and the continuations' logprobs."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "vllm_mamba.entrypoints.cli", "serve", path, "--port", str(port)]
    cmd += ["--disable-log-stats", "--uvicorn-log-level", "warning"]
    if cached:
        cmd.append("--enable-prefix-caching")
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        deadline = time.monotonic() + 300
        while True:
            try:
                if client.get("/health").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the server did not start")
            time.sleep(0.5)
        rng = random.Random(seed)
        items = []
        for _ in range(args.items):
            context = ids(rng, args.context_len)
            items.append([context + ids(rng, args.choice_len) for _ in range(args.choices)])
        scores = []
        start = time.perf_counter()
        for prompts in items:
            body = dict(
                model=path, prompt=prompts, echo=True, logprobs=1, max_tokens=1, temperature=0
            )
            resp = client.post("/v1/completions", json=body)
            resp.raise_for_status()
            for choice in resp.json()["choices"]:
                lps = choice["logprobs"]["token_logprobs"]
                scores.append(sum(lps[args.context_len : args.context_len + args.choice_len]))
        elapsed = time.perf_counter() - start
        return {"items_per_s": args.items / elapsed, "scores": scores}
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="mamba", choices=("mamba", "jamba"))
    p.add_argument("--model", default=None, help="model directory (written when missing)")
    p.add_argument("--workloads", default="system,chat,mc")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--questions", type=int, default=64)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--message-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--context-len", type=int, default=256)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--choice-len", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    path = args.model or f"/tmp/{args.arch}-prefix-bench"
    if not os.path.isfile(os.path.join(path, "config.json")):
        write_model(path) if args.arch == "mamba" else write_jamba(path)
    workloads = args.workloads.split(",")
    max_len = 8192
    print(f"model {path} ({args.arch}), {args.threads} threads, medians of {args.reps}")

    results: dict[str, dict[bool, list[dict]]] = {w: {False: [], True: []} for w in workloads}
    in_process = set(workloads) - {"mc"}
    engines = {c: engine(path, c, max_len) for c in (False, True)} if in_process else {}
    for rep in range(args.reps):
        for cached in (False, True):
            if "system" in workloads:
                clear(engines[cached])
                results["system"][cached].append(system_workload(engines[cached], args, rep))
            if "chat" in workloads:
                clear(engines[cached])
                results["chat"][cached].append(chat_workload(engines[cached], args, rep))
            if "mc" in workloads:
                results["mc"][cached].append(mc_workload(path, cached, args, rep))
    report(results)


def clear(eng) -> None:  # noqa: ANN001
    """Empties the engine's prefix cache, so every repetition starts cold."""
    if eng.prefix_cache is not None:
        eng.prefix_cache.clear()


def report(results: dict) -> None:
    med = statistics.median
    if "system" in results:
        r = results["system"]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(r[False], r[True]))
        off, on = med(x["ttft_p50"] for x in r[False]), med(x["ttft_p50"] for x in r[True])
        t_off, t_on = med(x["total"] for x in r[False]), med(x["total"] for x in r[True])
        print("\n(1) shared system prompt")
        print("| | cache off | cache on | ratio |\n|---|---|---|---|")
        print(f"| TTFT p50 (s) | {off:.3f} | {on:.3f} | {off / on:.1f}x |")
        print(f"| total (s) | {t_off:.2f} | {t_on:.2f} | {t_off / t_on:.1f}x |")
        print(f"greedy tokens equal: {same}")
    if "chat" in results:
        r = results["chat"]
        same = all(a["tokens"] == b["tokens"] for a, b in zip(r[False], r[True]))
        turns = len(r[False][0]["ttft_per_turn"])
        print("\n(2) multi-turn chat")
        print("| turn | TTFT off (s) | TTFT on (s) | ratio | hit rate |\n|---|---|---|---|---|")
        for t in range(turns):
            off = med(x["ttft_per_turn"][t] for x in r[False])
            on = med(x["ttft_per_turn"][t] for x in r[True])
            rate = med(x["hit_rate_per_turn"][t - 1] for x in r[True]) if t else 0.0
            print(f"| {t + 1} | {off:.3f} | {on:.3f} | {off / on:.1f}x | {100 * rate:.1f}% |")
        print(f"greedy tokens equal: {same}")
    if "mc" in results:
        r = results["mc"]
        off, on = med(x["items_per_s"] for x in r[False]), med(x["items_per_s"] for x in r[True])
        diff = max(
            abs(a - b) for x, y in zip(r[False], r[True]) for a, b in zip(x["scores"], y["scores"])
        )
        print("\n(3) multiple choice through /v1/completions (echo)")
        print("| | cache off | cache on | ratio |\n|---|---|---|---|")
        print(f"| items/s | {off:.2f} | {on:.2f} | {on / off:.1f}x |")
        print(f"largest continuation log-likelihood difference: {diff:.2e}")


if __name__ == "__main__":
    main()
