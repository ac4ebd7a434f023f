"""Decode speed with and without speculative decoding, in one run, on real text.

Each configuration is its own `LLM` (the model loaded once per configuration, before any
timing): the same engine without `speculative_config` ("none", the baseline of every
speed-up) and one engine per speculative setting (`--method`, `--k`, `--prompt-lookup-min`,
comma-separated lists give one configuration per combination). Every configuration runs the
same prompts, greedy, `ignore_eos`, so every configuration emits the same number of tokens
(and, greedy speculation being exact, the same tokens: the script checks it and reports any
difference).

Per configuration and batch size, medians of `--reps` repetitions, interleaved (repetition 1
of every configuration, then repetition 2, ...; each repetition starts one configuration later)
so that the host's slow and fast phases fall on all of them alike, after one warm-up generate
each:

- `tok/s`: generated tokens of the batch / wall time of `LLM.generate` (prefill included, model
  load excluded).
- `accept len`: tokens per verified chain, `(num_accepted_tokens + num_drafts) / num_drafts`
  (the target forwards of speculating sequences each emit this many tokens).
- `accept rate`: `num_accepted_tokens / num_draft_tokens`.
- `drafted`: the share of decode forwards that carried a draft chain (the n-gram lookup
  proposes nothing when the last n tokens occur nowhere earlier).
- `tok/fwd`: generated tokens per target forward of a sequence, chains and plain decode steps
  together (the bound on the speed-up if a chain cost as much as one plain step).
- `ms/step`: wall time per engine step (prefill included): the cost of a verification step
  against a plain one.
- `speed-up`: tok/s over the "none" configuration's, ratio of medians, then the median of
  the repetitions' own ratios ("paired").

Workloads (`--workload`), all built from the Python standard library on this machine (CPython
3.11's `Lib/`, read with `ast`; deterministic, no network):

- `code-edit`: a real function (`CODE_EDIT_FUNCTIONS`: 350-650 tokens each, from files held out
  of `vllm-mamba/tiny-stdlib`'s training data), then `# Same function, refactored:` and the
  function's header again; the model continues by copying (stream i of a batch gets function
  i).
- `summarize`: a real docstring (`SUMMARIZE_DOCSTRINGS`) in triple quotes, then `# Summary of
  the docstring above:` and an opening triple quote.
- `random`: `--random-prompt-len` random token ids: nothing to copy, so drafts are mostly
  rejected or never proposed; measures what speculation costs when it does not pay. With
  `--method ngram` this workload adds `prompt_lookup_min 1` (proposes whenever the last token
  occurred before, so it drafts often and is mostly rejected).

`--forced-reject` adds "rejected k=K": the n-gram engine with its proposer replaced by one
that drafts K random token ids at every step of every sequence (`RejectedDrafts`), so every
forward verifies a chain and almost nothing is accepted: the worst-case cost of speculation,
which no real proposer reaches (a model with random weights copies nothing, so the n-gram
lookup on it mostly proposes nothing at all). "rejected k=K" runs with the engine's back-off
after wholly rejected chains (what users get); "rejected k=K every step" switches it off to
show the raw cost of one verification step.

llama.cpp (`--llama-cpp`, single stream, code-edit prompt of stream 0): its
`llama-speculative-simple --spec-type ngram-simple` (llama.cpp's n-gram self-speculation, with
full-state checkpoints on models whose memory cannot drop a sequence's tail) and
`llama-lookup` (prompt lookup; ignores the result of `llama_memory_seq_rm`), against
`llama-lookup` with 0 draft tokens (`llama-speculative-simple` refuses to run without a
speculation type), on `--gguf`; "decode tok/s" is the tools' own figure (after the prompt),
"tok/s with prompt" divides by prompt encoding plus decoding, as the engine's tok/s does.
`--llama-cpp-only` runs these rows alone. Build them with `benchmarks/setup_llama_cpp.sh`'s
sources:

    cd /tmp/llamacpp/llama_cpp_python-*/vendor/llama.cpp
    for t in lookup/lookup speculative-simple/speculative-simple; do
      g++ -O2 -std=c++17 -march=native examples/$t.cpp -Icommon -Iinclude -Iggml/include \\
        -Ivendor -Lbuild/bin -lllama-common -lllama -lggml -lggml-base -lpthread \\
        -Wl,-rpath,$PWD/build/bin -o /tmp/llamacpp/bin/llama-$(basename $t); done

Examples:

    python benchmarks/spec_decode_bench.py --model vllm-mamba/tiny-stdlib --workload code-edit
    python benchmarks/spec_decode_bench.py --model /tmp/mamba-130m-random --workload random \\
        --batch-size 1 --output-len 128
    python benchmarks/spec_decode_bench.py --model /tmp/qwen3.5-0.8b-random --method mtp --k 1
    python benchmarks/spec_decode_bench.py --model /tmp/mamba-130m-random \\
        --method draft_model --draft-model vllm-mamba/tiny-stdlib --k 4

Never part of CI.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("none", "ngram", "draft_model", "mtp")

# (file under the stdlib, qualified name): functions of 350-650 tokens (tiny-stdlib's
# tokenizer) from files held out of tiny-stdlib's training data (index % 20 == 19).
CODE_EDIT_FUNCTIONS = [
    ("getopt.py", "gnu_getopt"),
    ("tarfile.py", "TarFile.extractall"),
    ("multiprocessing/pool.py", "worker"),
    ("unittest/loader.py", "TestLoader._find_tests"),
    ("zoneinfo/_zoneinfo.py", "_CalendarOffset.year_to_epoch"),
    ("doctest.py", "DocTestParser.parse"),
    ("xml/etree/ElementTree.py", "_serialize_xml"),
    ("importlib/_bootstrap.py", "_find_and_load_unlocked"),
]
# (file, qualified name or "" for the module): docstrings of 150-600 tokens.
SUMMARIZE_DOCSTRINGS = [
    ("getopt.py", ""),
    ("smtplib.py", "SMTP"),
    ("asyncio/protocols.py", "BaseProtocol.pause_writing"),
    ("doctest.py", ""),
    ("tarfile.py", "TarFile.__init__"),
    ("pydoc.py", ""),
    ("multiprocessing/pool.py", "Pool.imap"),
    ("unittest/loader.py", "TestLoader.loadTestsFromName"),
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="vllm-mamba/tiny-stdlib", help="path or shipped name")
    p.add_argument(
        "--method",
        default="ngram",
        help=f"comma-separated, of {', '.join(METHODS)}; 'none' (the baseline) always runs",
    )
    p.add_argument("--k", default="5", help="num_speculative_tokens, comma-separated")
    p.add_argument("--prompt-lookup-min", default="2", help="ngram: comma-separated")
    p.add_argument("--prompt-lookup-max", type=int, default=5, help="ngram")
    p.add_argument("--draft-model", default=None, help="draft_model: path or shipped name")
    p.add_argument("--batch-size", default="1,8", help="streams, comma-separated")
    p.add_argument(
        "--output-len",
        default="256,128",
        help="tokens per stream, comma-separated, one per batch size (or one for all)",
    )
    p.add_argument("--workload", default="code-edit", choices=["code-edit", "summarize", "random"])
    p.add_argument("--random-prompt-len", type=int, default=256)
    p.add_argument(
        "--forced-reject",
        action="store_true",
        help="add 'rejected k=K': every step drafts K random tokens (worst-case overhead)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--save-result", default=None, help="write every sample here (JSON)")
    p.add_argument(
        "--llama-cpp", action="store_true", help="also run llama.cpp's n-gram speculation"
    )
    p.add_argument("--gguf", default=None, help="the model as GGUF, for --llama-cpp")
    p.add_argument(
        "--llama-cpp-bin",
        default=os.environ.get("LLAMA_CPP_HOME", "/tmp/llamacpp") + "/bin",
        help="llama-lookup and llama-speculative-simple live here",
    )
    p.add_argument("--llama-cpp-timeout", type=int, default=300, help="seconds per llama.cpp run")
    p.add_argument(
        "--llama-cpp-only", action="store_true", help="only the llama.cpp rows (no engine)"
    )
    p.add_argument("--show-output", action="store_true", help="print stream 0's output")
    return p.parse_args()


# ----------------------------------------------------------------------------- workloads


def _stdlib_node(rel: str, qualname: str) -> tuple[str, ast.AST]:
    """The source of `rel` under the stdlib and the node of `qualname` in it (the module for
    an empty name)."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], rel)
    with open(path, encoding="utf-8") as f:
        src = f.read()
    node: ast.AST = ast.parse(src)
    for part in filter(None, qualname.split(".")):
        node = next(
            n
            for n in node.body  # type: ignore[attr-defined]
            if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.name == part
        )
    return src, node


def function_source(rel: str, qualname: str) -> tuple[str, str]:
    """A stdlib function's dedented source and its header (the `def` line(s) up to the
    body)."""
    src, node = _stdlib_node(rel, qualname)
    lines = src.splitlines()
    body_start = node.body[0].lineno - 1  # type: ignore[attr-defined]
    code = textwrap.dedent("\n".join(lines[node.lineno - 1 : node.end_lineno]))  # type: ignore[attr-defined]
    n_header = body_start - (node.lineno - 1)  # type: ignore[attr-defined]
    header = "\n".join(code.splitlines()[:n_header])
    return code, header


def code_edit_texts(n: int) -> list[str]:
    """`n` code-edit prompts (cycling through `CODE_EDIT_FUNCTIONS`)."""
    texts = []
    for rel, name in itertools.islice(itertools.cycle(CODE_EDIT_FUNCTIONS), n):
        code, header = function_source(rel, name)
        texts.append(f"{code}\n\n# Same function, refactored:\n{header}")
    return texts


def summarize_texts(n: int) -> list[str]:
    """`n` summarize prompts (cycling through `SUMMARIZE_DOCSTRINGS`)."""
    texts = []
    for rel, name in itertools.islice(itertools.cycle(SUMMARIZE_DOCSTRINGS), n):
        _, node = _stdlib_node(rel, name)
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        texts.append(f'"""{doc}\n"""\n\n# Summary of the docstring above:\n"""')
    return texts


def random_ids(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def workload_prompts(args: argparse.Namespace, tokenizer, vocab: int, n: int) -> list[dict]:  # noqa: ANN001
    """`n` prompts as `{"prompt_token_ids": ...}`, plus `text` where the workload has one."""
    if args.workload == "random":
        return [{"prompt_token_ids": ids} for ids in random_ids(vocab, n, args.random_prompt_len)]
    texts = code_edit_texts(n) if args.workload == "code-edit" else summarize_texts(n)
    return [{"prompt_token_ids": tokenizer.encode(t, add_special_tokens=False)} for t in texts]


# ----------------------------------------------------------------------------- configurations


def configurations(args: argparse.Namespace) -> list[tuple[str, dict | None]]:
    """(label, speculative_config) of every configuration; "none" first."""
    methods = [m for m in args.method.split(",") if m and m != "none"]
    ks = [int(k) for k in args.k.split(",")]
    mins = [int(m) for m in args.prompt_lookup_min.split(",")]
    if args.workload == "random" and "ngram" in methods and 1 not in mins:
        mins.append(1)
    configs: list[tuple[str, dict | None]] = [("none", None)]
    for method in methods:
        if method not in METHODS:
            raise SystemExit(f"--method {method!r} is not one of {METHODS}")
        for k in ks:
            spec: dict = {"method": method, "num_speculative_tokens": k}
            if method == "ngram":
                for lo in mins:
                    hi = max(lo, args.prompt_lookup_max)
                    label = f"ngram k={k} n={lo}..{hi}"
                    configs.append(
                        (label, {**spec, "prompt_lookup_min": lo, "prompt_lookup_max": hi})
                    )
            elif method == "draft_model":
                if not args.draft_model:
                    raise SystemExit("--method draft_model needs --draft-model")
                name = os.path.basename(os.path.normpath(args.draft_model))
                configs.append((f"draft {name} k={k}", {**spec, "model": args.draft_model}))
            else:
                configs.append((f"mtp k={k}", spec))
    if args.forced_reject:
        for k in ks:
            spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
            configs.append((f"{REJECTED} k={k}", spec))
            configs.append((f"{REJECTED} k={k} {EVERY_STEP}", spec))
    return configs


REJECTED = "rejected"  # label prefix of the forced-rejection configurations
EVERY_STEP = "every step"  # label suffix: the back-off after rejected chains switched off


def _default_backoff() -> int:
    from vllm_mamba.engine.spec_steps import MAX_BACKOFF_STEPS

    return MAX_BACKOFF_STEPS


BACKOFF = _default_backoff()


class RejectedDrafts:
    """A proposer that drafts `k` random token ids for every decoding sequence at every step:
    almost all rejected, so speculation's full cost with nothing to show for it (the engine's
    own n-gram proposer, put back by nothing: this engine serves the benchmark only)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        import random

        self.rng = random.Random(seed)
        self.vocab = vocab

    def propose(self, seqs: list) -> list[list[int]]:
        return [[self.rng.randrange(3, self.vocab) for _ in range(k)] for _, _, k in seqs]

    def on_finished(self, seq) -> None:  # noqa: ANN001
        pass


class Run:
    """One configuration's engine."""

    def __init__(self, label: str, spec: dict | None, args: argparse.Namespace, max_seqs: int):
        from vllm_mamba import LLM

        self.label, self.spec = label, spec
        start = time.perf_counter()
        self.llm = LLM(
            args.model,
            dtype=args.dtype,
            max_num_seqs=max_seqs,
            max_model_len=args.max_model_len,
            disable_log_stats=True,
            speculative_config=spec,
        )
        self.load_s = time.perf_counter() - start
        if label.startswith(REJECTED):  # the engine's `Proposer` protocol (spec_steps.py)
            vocab = self.llm.llm_engine.config.model_config.hf_config.vocab_size
            self.llm.llm_engine.spec_steps.proposer = RejectedDrafts(vocab)

    def generate(self, prompts: list[dict], out_len: int) -> dict:
        """One timed `LLM.generate` of the batch; its tokens and the speculation counters."""
        from vllm_mamba import SamplingParams
        from vllm_mamba.engine import spec_steps

        engine = self.llm.llm_engine
        engine.spec_steps.reset()
        # "every step": a chain at every step (the raw cost of verification); otherwise the
        # engine's back-off after wholly rejected chains, as users get it.
        spec_steps.MAX_BACKOFF_STEPS = 0 if self.label.endswith(EVERY_STEP) else BACKOFF
        params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
        start = time.perf_counter()
        outs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        c = engine.spec_steps.counters
        n_out = sum(len(t) for t in tokens)
        sample = {"seconds": seconds, "tokens": n_out, "tok_s": n_out / seconds}
        if c is not None:
            # every token not emitted by a chain came from a plain step (the prefill's first
            # token included): forwards = chains + plain steps
            plain = n_out - c.num_drafts - c.num_accepted_tokens
            sample.update(
                num_drafts=c.num_drafts,
                num_draft_tokens=c.num_draft_tokens,
                num_accepted_tokens=c.num_accepted_tokens,
                accepted_per_pos=list(c.accepted_per_pos),
                forwards=c.num_drafts + plain,
            )
        return {"sample": sample, "token_ids": tokens}


def summarize_samples(samples: list[dict], base: list[dict] | None, batch: int) -> dict:
    """Medians (and summed counters) of one configuration's repetitions."""
    out = {"tok_s": statistics.median(s["tok_s"] for s in samples)}
    # wall time per engine step (a batch's sequences step together): tokens per stream for
    # plain decoding, forwards per stream with speculation
    per_stream = [s.get("forwards", s["tokens"]) / batch for s in samples]
    out["ms_step"] = statistics.median(1000 * s["seconds"] / n for s, n in zip(samples, per_stream))
    if base:
        out["speedup"] = out["tok_s"] / statistics.median(s["tok_s"] for s in base)
        out["paired"] = statistics.median(s["tok_s"] / b["tok_s"] for s, b in zip(samples, base))
    if "num_drafts" in samples[0]:
        drafts = sum(s["num_drafts"] for s in samples)
        dtoks = sum(s["num_draft_tokens"] for s in samples)
        acc = sum(s["num_accepted_tokens"] for s in samples)
        fwd = sum(s["forwards"] for s in samples)
        toks = sum(s["tokens"] for s in samples)
        out.update(
            accept_len=(acc + drafts) / drafts if drafts else None,
            accept_rate=acc / dtoks if dtoks else None,
            drafted=drafts / fwd if fwd else 0.0,
            tok_per_fwd=toks / fwd if fwd else None,
        )
    return out


def fmt(v: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "—" if v is None else f"{v:{spec}}{suffix}"


def table(results: dict) -> str:
    head = "| batch | configuration | tok/s | speed-up (paired) | accept len | accept rate | "
    head += "drafted | tok/fwd | ms/step | same tokens |"
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for batch, per_config in results.items():
        for label, r in per_config.items():
            s = r["summary"]
            speed = "1.00x" if label == "none" else f"{s['speedup']:.2f}x ({s['paired']:.2f}x)"
            cells = [
                str(batch),
                label,
                f"{s['tok_s']:,.1f}",
                speed,
                fmt(s.get("accept_len")),
                fmt(None if s.get("accept_rate") is None else 100 * s["accept_rate"], ".0f", "%"),
                "—" if label == "none" else f"{100 * s['drafted']:.0f}%",
                fmt(s.get("tok_per_fwd")),
                f"{s['ms_step']:.2f}",
                r["same_tokens"],
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- llama.cpp


def run_llama_cpp(args: argparse.Namespace, text: str, out_len: int, k: int) -> list[dict]:
    """llama.cpp's n-gram speculation on `text`, each tool with and without it; medians of
    `--reps` (each a fresh process: model load excluded by the tools' own timers)."""
    rows = []
    ngram_n = max(1, int(args.prompt_lookup_min.split(",")[0]))
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
        prompt_file = f.name
    common = ["-m", args.gguf, "-f", prompt_file, "-n", str(out_len), "-t", str(args.threads)]
    # the tools' default context and batch sizes (the prompts fit their 2048-token batch)
    common += ["--temp", "0"]
    variants = [
        ("llama-lookup k=0 (no speculation)", "llama-lookup", ["--spec-draft-n-max", "0"]),
        (
            f"llama-speculative-simple ngram-simple k={k} n={ngram_n}",
            "llama-speculative-simple",
            ["--spec-type", "ngram-simple", "--spec-draft-n-max", str(k)]
            + ["--spec-ngram-simple-size-n", str(ngram_n), "--spec-ngram-simple-size-m", str(k)],
        ),
        (f"llama-lookup k={k}", "llama-lookup", ["--spec-draft-n-max", str(k)]),
    ]
    for label, tool, extra in variants:
        binary = os.path.join(args.llama_cpp_bin, tool)
        if not os.access(binary, os.X_OK):
            rows.append({"label": label, "error": f"{binary} not built (see the docstring)"})
            continue
        samples, with_prompt, info, error = [], [], {}, None
        for _ in range(args.reps):
            try:
                proc = subprocess.run(
                    [binary, *common, *extra],
                    capture_output=True,
                    text=True,
                    errors="replace",
                    timeout=args.llama_cpp_timeout,
                )
            except subprocess.TimeoutExpired:
                error = f"timed out after {args.llama_cpp_timeout} s"
                break
            log = proc.stdout + proc.stderr
            m = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+)", log)
            if proc.returncode != 0 or not m:
                lines = [ln for ln in log.splitlines() if ln.strip()]
                tail = [ln for ln in lines if " E " in ln or "position" in ln][:4] or lines[-6:]
                error = f"exit {proc.returncode}: " + " / ".join(tail)
                break
            samples.append(float(m.group(3)))
            enc = re.search(r"encoded\s+\d+ tokens in\s+([\d.]+) seconds", log)
            if enc:  # the engine's tok/s includes its prefill: this is the comparable figure
                with_prompt.append(int(m.group(1)) / (float(enc.group(1)) + float(m.group(2))))
            for key in ("n_drafted", "n_accept", "accept"):
                km = re.search(rf"\b{key}\s*=\s*([-\w.%]+)", log)
                if km:
                    info[key] = km.group(1)
            info["checkpoints"] = "will use checkpoints" in log
            info["output"] = log
        row = {"label": label, "samples": samples, **info}
        if error:
            row["error"] = error
        if samples:
            row["tok_s"] = statistics.median(samples)
        if with_prompt:
            row["with_prompt_samples"] = with_prompt
            row["tok_s_with_prompt"] = statistics.median(with_prompt)
        rows.append(row)
        print(f"llama.cpp {label}: {row.get('tok_s', row.get('error'))}", flush=True)
    os.unlink(prompt_file)
    return rows


# ----------------------------------------------------------------------------- main


def main() -> None:
    args = parse_args()
    if REPO_ROOT not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, REPO_ROOT)
    import torch

    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    batches = [int(b) for b in args.batch_size.split(",")]
    lens = [int(n) for n in args.output_len.split(",")]
    out_lens = dict(zip(batches, lens if len(lens) == len(batches) else lens[:1] * len(batches)))
    started = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()

    configs = [] if args.llama_cpp_only else configurations(args)
    if args.llama_cpp_only and args.workload == "random":
        raise SystemExit("--llama-cpp-only needs a text workload (code-edit or summarize)")
    runs = [Run(label, spec, args, max(batches)) for label, spec in configs]
    tokenizer = runs[0].llm.get_tokenizer() if runs else None
    prompts, prompt_lens = [], [0]
    if runs:
        vocab = runs[0].llm.llm_engine.config.model_config.hf_config.vocab_size
        print(f"loaded {len(runs)} engines ({', '.join(f'{r.load_s:.1f}' for r in runs)} s)")
        prompts = workload_prompts(args, tokenizer, vocab, max(batches))
        prompt_lens = [len(p["prompt_token_ids"]) for p in prompts]
        print(f"{args.workload} prompts: {prompt_lens} tokens")

    results: dict = {}
    for batch in batches if runs else []:
        out_len = out_lens[batch]
        batch_prompts = prompts[:batch]
        for run in runs:  # warm-up
            run.generate(batch_prompts, min(out_len, 32))
        samples: dict[str, list[dict]] = {r.label: [] for r in runs}
        tokens: dict[str, list] = {}
        for rep in range(args.reps):
            # each repetition starts one configuration later, so that no configuration always
            # runs first (right after another engine's generate) or last
            for run in runs[rep % len(runs) :] + runs[: rep % len(runs)]:
                got = run.generate(batch_prompts, out_len)
                samples[run.label].append(got["sample"])
                tokens.setdefault(run.label, got["token_ids"])
                s = got["sample"]
                extra = ""
                if "num_drafts" in s and s["num_drafts"]:
                    extra = (
                        f", {s['num_drafts']} chains, {s['num_accepted_tokens']}/"
                        f"{s['num_draft_tokens']} accepted"
                    )
                print(f"b{batch} rep {rep + 1} {run.label}: {s['tok_s']:.1f} tok/s{extra}")
                sys.stdout.flush()
        base = samples["none"]
        results[batch] = {}
        for run in runs:
            same = tokens[run.label] == tokens["none"]
            if not same:
                diff = [
                    next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
                    for x, y in zip(tokens[run.label], tokens["none"])
                ]
                same_txt = f"no (first difference at {diff})"
            else:
                same_txt = "yes"
            results[batch][run.label] = {
                "spec": run.spec,
                "samples": samples[run.label],
                "summary": summarize_samples(samples[run.label], base, batch),
                "same_tokens": same_txt,
            }
        if args.show_output:
            print(repr(tokenizer.decode(tokens["none"][0])))

    llama_rows = None
    if args.llama_cpp:
        if not args.gguf:
            raise SystemExit("--llama-cpp needs --gguf")
        text = (
            code_edit_texts(1)[0]
            if args.workload == "code-edit"
            else summarize_texts(1)[0]
            if args.workload == "summarize"
            else tokenizer.decode(prompts[0]["prompt_token_ids"])
        )
        k = int(args.k.split(",")[0])
        llama_rows = run_llama_cpp(args, text, out_lens[batches[0]], k)

    header = (
        f"{started}, {args.model}, {args.dtype}, workload {args.workload}, "
        f"output {', '.join(f'{out_lens[b]} (b{b})' for b in batches)} tokens, "
        + (f"prompts {min(prompt_lens)}-{max(prompt_lens)} tokens, " if runs else "")
        + f"{args.threads} threads, medians of "
        f"{args.reps}, total {time.perf_counter() - t0:.0f} s, 1-min load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    )
    print(f"\n{header}\n")
    if results:
        print(table(results))
    if llama_rows:
        base = llama_rows[0].get("tok_s_with_prompt")
        print(
            "\n| llama.cpp (single stream) | decode tok/s | tok/s with prompt | speed-up | "
            "drafted | accepted | note |"
        )
        print("|---|---|---|---|---|---|---|")
        for row in llama_rows:
            with_prompt = row.get("tok_s_with_prompt")
            speedup = with_prompt / base if base and with_prompt else None
            note = row.get("error", "")
            if row.get("checkpoints"):
                note = "full-state checkpoints"
            print(
                f"| {row['label']} | {fmt(row.get('tok_s'), ',.1f')} | "
                f"{fmt(row.get('tok_s_with_prompt'), ',.1f')} | "
                f"{fmt(speedup, '.2f', 'x')} | "
                f"{row.get('n_drafted', '—')} | {row.get('n_accept', '—')} | {note} |"
            )
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(
                {
                    "date": started,
                    "header": header,
                    "args": vars(args),
                    "prompt_lens": prompt_lens,
                    "results": {str(b): r for b, r in results.items()},
                    "llama_cpp": [
                        {k: v for k, v in row.items() if k != "output"} for row in llama_rows or []
                    ],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
