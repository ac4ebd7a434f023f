"""CPU speed of this engine against `transformers` and llama.cpp on a hybrid model, in one run.

Ten models (random weights, saved once to `--model`; shapes in `hybrid_configs.py`), chosen by
`--arch`: `jamba` (about 310M parameters, default model `/tmp/jamba-300m-random`),
`granitemoehybrid` (the dense Granite 4.0-H shape, about 306M, `/tmp/granite-4.0-h-300m-random`),
`qwen3_5` (Qwen3.5-0.8B's text model, Gated DeltaNet and gated attention,
`/tmp/qwen3.5-0.8b-random`), `qwen3_next` (Qwen3-Next's layout with 64 experts scaled to
about 1B, `/tmp/qwen3-next-1b-random`), `lfm2` (LFM2-1.2B, short convolutions and GQA,
`/tmp/lfm2-1.2b-random`), `lfm3` (LFM3-1.7B: short convolutions, sliding and full attention,
`/tmp/lfm3-1.7b-random`), `zaya` (ZAYA1-8B's layer shapes, 4 of its 40 layers: CCA attention
and a top-1 MoE of 16 experts, saved in bfloat16, `/tmp/zaya1-8b-4layers-random`),
`kimi_linear` (Kimi Linear's KDA, MLA and 64-expert layout scaled to about 1B,
`/tmp/kimi-linear-1b-random`), `ling` (Ling-3.0-Flash's layout scaled the same way,
`/tmp/ling-1b-random`), `glm5_next` (GLM-5.3-Flash's real layer shapes, 2 of its layers,
saved in bfloat16: its sparse attention reads at most 2048 tokens a step, so the `step @ C` rows
at `--steps 1024,8192,32768` show a decode step flat in the context,
`/tmp/glm-5.3-flash-2layers-random`), `qwen4_exp` (Qwen3.8-Flash-Next's real layer shapes, 4 of
its layers, 64 of its experts, saved in bfloat16, `/tmp/qwen3.8-flash-next-4layers-random`: its
indexed attention reads at most 2048 tokens a step too) and `qwen3_6_moe` (Qwen3.6-35B-A3B's
real layer shapes, 256 experts, four of its layers, saved in bfloat16: run it with `--dtype
bfloat16`, `/tmp/qwen3.6-35b-a3b-4layers-random`). `--dtype bfloat16` runs the engine and
transformers in bfloat16; `--quantization int8` / `int4` the engine with int8 / int4 weights.
The run starts by printing the recurrent state bytes one sequence holds and how many sequences
fit a GiB.

Workloads, medians of `--reps` interleaved repetitions, `--threads` threads (every system pinned
to them):

- `prefill 512`: one 512-token prompt (engine: `LLM.generate` with one output token;
  transformers: one forward).
- `decode bN`: N sequences of 16 prompt tokens, aggregate tokens/s of 32 decode steps (engine:
  `LLMEngine.step` after every prompt has its first token; transformers: `generate` of 33
  tokens minus `generate` of 1).
- `step @ C`: one sequence with a C-token context, milliseconds per decode step (16 steps), at
  the contexts of `--steps` (default 128,4096); `--no-steps` leaves these rows out.
  transformers runs no row above `--transformers-max-context` (its dense attention over a long
  context does not fit the machine's memory).

With `--gguf` (the model converted by llama.cpp's `convert_hf_to_gguf.py`, see
`setup_llama_cpp.sh`) llama.cpp runs in the same repetitions through `compare_systems`'
`LlamaCppSystem` (`llama-bench` for prefill and b1, `llama-batched-bench` S_TG for larger
batches; no `step @ C` rows); its tools come from `--llama-cpp-home` / `$LLAMA_CPP_HOME`.
`--ik-llama-cpp-home` / `$IK_LLAMA_CPP_HOME` adds ik_llama.cpp on the same GGUF, through the
same tools (`IkLlamaCppSystem`; `--ik-repack` turns on its run-time repacking, `-rtr`); the
engine's ratios are printed against every other system.

Beside each `decode b1` row the bandwidth bound is printed (`bandwidth_bound.py`): the weight
bytes one decode step reads (the engine's and transformers' from their modules, llama.cpp's
from the GGUF's tensors; the embedding left out unless tied to the head) over the read rate
of a 512 MiB `x.sum()` at `--threads` threads (median of 7 passes at the start and 7 at the
end of the run), as tokens/s and as the row's share of it.

    python benchmarks/hybrid_bench.py --model /tmp/jamba-300m-random
    python benchmarks/hybrid_bench.py --arch granitemoehybrid --no-steps \
        --gguf /tmp/llamacpp/gguf/granite-4.0-h-300m-random-f32.gguf
    python benchmarks/hybrid_bench.py --arch qwen3_5 --no-steps --batches 1,32,128 \
        --dtype bfloat16 --gguf /tmp/llamacpp/gguf/qwen3.5-0.8b-random-bf16.gguf --gguf-label BF16
    python benchmarks/hybrid_bench.py --arch qwen3_5 --no-steps --skip-transformers \
        --quantization int8 --gguf /tmp/llamacpp/gguf/qwen3.5-0.8b-random-q8_0.gguf \
        --gguf-label Q8_0 --ik-llama-cpp-home /tmp/ikllamacpp
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import time

import torch
from bandwidth_bound import (
    BOUND_HEAD,
    bound_line,
    gguf_bytes_per_token,
    module_bytes_per_token,
    read_rate,
)
from compare_systems import failure_reason
from hybrid_configs import (
    GLM5_NEXT_CONFIG,
    GRANITE_CONFIG,
    JAMBA_CONFIG,
    KIMI_LINEAR_CONFIG,
    KIMI_SHIPPED_KEYS,
    LFM2_CONFIG,
    LFM3_CONFIG,
    LING_CONFIG,
    QWEN3_5_CONFIG,
    QWEN3_6_MOE_CONFIG,
    QWEN3_NEXT_CONFIG,
    QWEN4_EXP_CONFIG,
    ZAYA_CONFIG,
)

from vllm_mamba.config import QUANTIZATION_CHOICES

ARCHS = {  # --arch: (transformers class, config, default model directory)
    "jamba": ("JambaForCausalLM", JAMBA_CONFIG, "/tmp/jamba-300m-random"),
    "granitemoehybrid": (
        "GraniteMoeHybridForCausalLM",
        GRANITE_CONFIG,
        "/tmp/granite-4.0-h-300m-random",
    ),
    "qwen3_5": ("Qwen3_5ForCausalLM", QWEN3_5_CONFIG, "/tmp/qwen3.5-0.8b-random"),
    "qwen3_next": ("Qwen3NextForCausalLM", QWEN3_NEXT_CONFIG, "/tmp/qwen3-next-1b-random"),
    "qwen3_6_moe": (
        "Qwen3_5MoeForCausalLM",
        QWEN3_6_MOE_CONFIG,
        "/tmp/qwen3.6-35b-a3b-4layers-random",
    ),
    "lfm2": ("Lfm2ForCausalLM", LFM2_CONFIG, "/tmp/lfm2-1.2b-random"),
    "lfm3": ("Lfm3ForCausalLM", LFM3_CONFIG, "/tmp/lfm3-1.7b-random"),
    "kimi_linear": ("KimiLinearForCausalLM", KIMI_LINEAR_CONFIG, "/tmp/kimi-linear-1b-random"),
    "ling": ("BailingHybridForCausalLM", LING_CONFIG, "/tmp/ling-1b-random"),
    "zaya": ("ZayaForCausalLM", ZAYA_CONFIG, "/tmp/zaya1-8b-4layers-random"),
    "glm5_next": (
        "Glm5NextForConditionalGeneration",
        GLM5_NEXT_CONFIG,
        "/tmp/glm-5.3-flash-2layers-random",
    ),
    "qwen4_exp": (
        "Qwen4ExpForCausalLM",
        QWEN4_EXP_CONFIG,
        "/tmp/qwen3.8-flash-next-4layers-random",
    ),
}
SHIPPED_KEYS = {  # config.json keys the releases carry (llama.cpp's converter reads them)
    "kimi_linear": KIMI_SHIPPED_KEYS,
    # Granite 4.0-H's releases name the layers "mamba" / "attention"; transformers saves
    # "linear_attention" / "full_attention", which the converter takes for Mamba layers
    "granitemoehybrid": {"layer_types": GRANITE_CONFIG["layer_types"]},
}
# Made and saved in bfloat16 (float32: up to 6.8 GB of disk each).
SAVED_BF16 = {"qwen3_6_moe", "lfm3", "zaya", "glm5_next", "qwen4_exp"}
TOKENIZER_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests/data/gpt-neox-20b-tokenizer"
)
DECODE_TOKENS = 32
LLAMA_MAX_SEQS = 256  # llama.cpp's LLAMA_MAX_SEQ: the most sequences one context holds
PROMPT_LEN = 16


def make_model(arch: str, path: str) -> int:
    """Saves the random-weight model (N(0, 0.02^2), A_log / D / norms as initialised) once."""
    import transformers

    cls_name, config, _ = ARCHS[arch]
    model_cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    if arch in SAVED_BF16:
        torch.set_default_dtype(torch.bfloat16)
    try:
        model = model_cls(model_cls.config_class(**config))
    finally:
        torch.set_default_dtype(default)
    config_file = os.path.join(path, "config.json")
    if not os.path.isfile(config_file):
        model.save_pretrained(path)
        if arch in SHIPPED_KEYS:
            with open(config_file) as f:
                saved = json.load(f)
            with open(config_file, "w") as f:
                json.dump({**saved, **SHIPPED_KEYS[arch]}, f, indent=2)
            _dense_mlp_names(path)
    for file in os.listdir(TOKENIZER_DIR):  # GPT-NeoX's tokenizer; prompts are token ids
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return sum(p.numel() for p in model.parameters())


def _dense_mlp_names(path: str) -> None:
    """Kimi Linear as released: transformers saves the dense layers' MLP under the MoE's name
    (`block_sparse_moe.gate_proj`, ...); the checkpoints (and llama.cpp's converter) name it
    `mlp.*`."""
    from safetensors.torch import load_file, save_file

    dense = re.compile(r"\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$")
    for file in os.listdir(path):
        if file.endswith(".safetensors"):
            tensors = load_file(os.path.join(path, file))
            renamed = {dense.sub(r".mlp.\1", k): v for k, v in tensors.items()}
            save_file(renamed, os.path.join(path, file), metadata={"format": "pt"})
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"] = {dense.sub(r".mlp.\1", k): v for k, v in data["weight_map"].items()}
        with open(index, "w") as f:
            json.dump(data, f, indent=2)


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random token ids below `vocab`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


class Engine:
    """This engine through `LLM` / `LLMEngine`."""

    name = "vllm_mamba"

    def __init__(self, path: str, vocab: int, args: argparse.Namespace) -> None:
        from vllm_mamba import LLM

        self.vocab = vocab
        # Pinned to `--threads`, as llama.cpp's `-t`: left to follow the load, the engine would
        # count the system run just before it as another process and drop a thread for a
        # second or more of its own run (b1 measured 20% low that way).
        self.llm = LLM(
            path, max_model_len=max(4200, max(args.steps) + 64), max_num_seqs=max(args.batches),
            disable_log_stats=True,
            dtype=args.dtype, quantization=args.quantization, threads=args.threads,
        )  # fmt: skip

    def state_bytes(self) -> int:
        """Recurrent state bytes one sequence holds (every layer's conv and recurrent state)."""
        return self.llm.llm_engine.cache.bytes_per_slot()

    def bytes_per_token(self, config: dict) -> int:
        """Weight bytes one decode step reads (`bandwidth_bound.module_bytes_per_token`)."""
        return module_bytes_per_token(self.llm.llm_engine.model, argparse.Namespace(**config))

    def prefill(self, length: int) -> float:
        from vllm_mamba import SamplingParams

        ids = {"prompt_token_ids": prompts(self.vocab, 1, length)[0]}
        start = time.perf_counter()
        self.llm.generate(ids, SamplingParams(max_tokens=1), use_tqdm=False)
        return length / (time.perf_counter() - start)

    def _decode(self, batch: int, context: int, steps: int) -> float:
        """Seconds of `steps` decode steps of `batch` sequences of `context` tokens."""
        from vllm_mamba import SamplingParams

        engine = self.llm.llm_engine
        params = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0)
        for i, p in enumerate(prompts(self.vocab, batch, context, seed=batch)):
            engine.add_request(f"r{i}", p, params)
        while any(not s.output_token_ids for g in engine.scheduler.waiting for s in g.seqs) or any(
            not s.output_token_ids for g in engine.scheduler.running for s in g.seqs
        ):
            engine.step()
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    def decode(self, batch: int) -> float:
        return batch * DECODE_TOKENS / self._decode(batch, PROMPT_LEN, DECODE_TOKENS)

    def step_ms(self, context: int) -> float:
        return 1000 * self._decode(1, context, 16) / 16


class LlamaCpp:
    """llama.cpp (or, with `ik`, ik_llama.cpp) on the model's GGUF, through
    `compare_systems.LlamaCppSystem` / `IkLlamaCppSystem`."""

    def __init__(
        self, home: str, gguf: str, label: str, threads: int, ik: bool = False, repack: bool = False
    ) -> None:
        from compare_systems import IkLlamaCppSystem, LlamaCppSystem

        bin_dir = os.path.join(home, "bin")
        if ik:
            self.system = IkLlamaCppSystem(bin_dir, gguf, label, threads, repack=repack)
        else:
            self.system = LlamaCppSystem(bin_dir, gguf, label, threads)
        self.name = self.system.project
        self.gguf = gguf

    def bytes_per_token(self, config: dict) -> int:
        """Weight bytes one decode step reads: the GGUF's tensors (`gguf_bytes_per_token`)."""
        return gguf_bytes_per_token(self.gguf)

    def prefill(self, length: int) -> float:
        return self.system.prefill([0] * length)

    def decode(self, batch: int) -> float:
        """Aggregate tokens/s of `batch` streams; above `LLAMA_MAX_SEQS` (llama.cpp refuses a
        context of more sequences: `n_seq_max must be <= 256`) its rate at that many, the
        most it can run at once."""
        if batch > LLAMA_MAX_SEQS:
            print(f"{self.name}: {batch} streams exceed its {LLAMA_MAX_SEQS}; run at that many")
        streams = min(batch, LLAMA_MAX_SEQS)
        return self.system.decode([[0] * PROMPT_LEN] * streams, DECODE_TOKENS)

    def step_ms(self, context: int) -> float:
        raise NotImplementedError("llama.cpp has no step @ C row (use --no-steps)")


class Transformers:
    """transformers' model class (its PyTorch paths; no mamba-ssm kernels on the CPU)."""

    name = "transformers"

    def __init__(
        self, path: str, cls_name: str, vocab: int, dtype: str, max_context: int | None = None
    ) -> None:
        import transformers

        self.vocab = vocab
        self.max_context = max_context
        model_cls = getattr(transformers, cls_name)
        self.model = model_cls.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

    def bytes_per_token(self, config: dict) -> int:
        """Weight bytes one decode step reads (`bandwidth_bound.module_bytes_per_token`)."""
        return module_bytes_per_token(self.model)

    @torch.inference_mode()
    def prefill(self, length: int) -> float:
        ids = torch.tensor(prompts(self.vocab, 1, length))
        start = time.perf_counter()
        self.model(ids)
        return length / (time.perf_counter() - start)

    @torch.inference_mode()
    def _generate(self, ids: torch.Tensor, new: int) -> float:
        start = time.perf_counter()
        self.model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return time.perf_counter() - start

    def decode(self, batch: int) -> float:
        ids = torch.tensor(prompts(self.vocab, batch, PROMPT_LEN, seed=batch))
        seconds = self._generate(ids, DECODE_TOKENS + 1) - self._generate(ids, 1)
        return batch * DECODE_TOKENS / seconds

    def step_ms(self, context: int) -> float:
        if self.max_context is not None and context > self.max_context:
            raise RuntimeError(f"context {context} is over --transformers-max-context")
        ids = torch.tensor(prompts(self.vocab, 1, context, seed=1))
        return 1000 * (self._generate(ids, 17) - self._generate(ids, 1)) / 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="jamba")
    p.add_argument("--model", help="model directory (written once); default by --arch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument(
        "--quantization",
        choices=QUANTIZATION_CHOICES,
        help="the engine's weights (not transformers')",
    )
    p.add_argument(
        "--batches",
        type=lambda v: [int(b) for b in v.split(",")],
        default=[1, 32],
        help="decode batch sizes, comma-separated (default 1,32)",
    )
    p.add_argument(
        "--gguf-label", default="F32", help="the GGUF's type, for the table (F32, BF16, Q8_0)"
    )
    p.add_argument("--no-steps", action="store_true", help="leave out the step @ C rows")
    p.add_argument(
        "--steps",
        type=lambda v: [int(c) for c in v.split(",")],
        default=[128, 4096],
        help="the contexts of the step @ C rows, comma-separated (default 128,4096)",
    )
    p.add_argument(
        "--transformers-max-context",
        type=int,
        help="the longest step @ C context transformers runs (longer rows: not run)",
    )
    p.add_argument("--gguf", help="the model as llama.cpp GGUF: adds llama.cpp to the run")
    p.add_argument(
        "--llama-cpp-home",
        default=os.environ.get("LLAMA_CPP_HOME", "/tmp/llamacpp"),
        help="bin/llama-bench and bin/llama-batched-bench live here",
    )
    p.add_argument(
        "--ik-llama-cpp-home",
        default=os.environ.get("IK_LLAMA_CPP_HOME"),
        help="ik_llama.cpp's bin/ (built by setup_llama_cpp.sh): adds it on --gguf",
    )
    p.add_argument(
        "--ik-repack", action="store_true", help="ik_llama.cpp with run-time repacking (-rtr)"
    )
    p.add_argument("--skip-llama-cpp", action="store_true", help="with --gguf: ik_llama.cpp only")
    args = p.parse_args()
    if args.gguf and not args.no_steps:
        p.error("--gguf needs --no-steps (llama.cpp has no step @ C rows)")
    cls_name, config, default_path = ARCHS[args.arch]
    path = args.model or default_path
    torch.set_num_threads(args.threads)
    # Before any thread exists, so that every worker inherits it: the engine flushes
    # denormals (as llama.cpp does), and transformers gets the same setting.
    torch.set_flush_denormal(True)
    print(f"load average {os.getloadavg()[0]:.2f} at the start")
    rates = read_rate(args.threads)
    print(f"model: {make_model(args.arch, path) / 1e6:.0f}M parameters in {path}")
    engine = Engine(path, config["vocab_size"], args)
    state = engine.state_bytes()
    print(f"state per sequence: {state / 2**10:,.1f} KiB ({2**30 // state:,} sequences per GiB)")
    systems: list = [engine]
    if not args.skip_transformers:
        systems.append(
            Transformers(
                path, cls_name, config["vocab_size"], args.dtype, args.transformers_max_context
            )
        )
    if args.gguf and not args.skip_llama_cpp:
        systems.append(LlamaCpp(args.llama_cpp_home, args.gguf, args.gguf_label, args.threads))
    if args.gguf and args.ik_llama_cpp_home:
        systems.append(
            LlamaCpp(
                args.ik_llama_cpp_home, args.gguf, args.gguf_label, args.threads,
                ik=True, repack=args.ik_repack,
            )
        )  # fmt: skip
    rows = {"prefill 512 (tok/s)": lambda s: s.prefill(512)}
    for b in args.batches:
        rows[f"decode b{b} (tok/s)"] = lambda s, b=b: s.decode(b)
    if not args.no_steps:
        for c in args.steps:
            rows[f"step @ {c} (ms)"] = lambda s, c=c: s.step_ms(c)
    results: dict[str, dict[str, list[float]]] = {r: {s.name: [] for s in systems} for r in rows}
    failed: dict[tuple[str, str], str] = {}  # (row, system) -> a llama.cpp tool's failure
    for rep in range(args.reps):
        for row, fn in rows.items():
            for system in systems:
                if (row, system.name) in failed:
                    continue
                try:
                    results[row][system.name].append(fn(system))
                except RuntimeError as e:  # a llama.cpp tool failed: the row is NaN
                    failed[row, system.name] = failure_reason(e)
                    results[row][system.name].append(float("nan"))
                    print(f"rep {rep} {row} {system.name} fails: {failed[row, system.name]}")
                    continue
                print(
                    f"rep {rep} {row} {system.name}: {results[row][system.name][-1]:.2f}",
                    flush=True,
                )
    others = systems[1:]
    head = " | ".join(s.name for s in systems) + "".join(f" | vs {s.name}" for s in others)
    print(f"\n| workload | {head} |")
    print("|---|" + "---|" * (len(systems) + len(others)))
    for row in rows:
        med = [statistics.median(results[row][s.name]) for s in systems]
        # the engine's speed-up: a rate over the other's, or the other's time over the engine's
        ratios = [(m / med[0] if "ms" in row else med[0] / m) for m in med[1:]]
        cells = [f"{m:,.1f}" if m == m else "fails" for m in med]  # NaN: a failed tool
        cells += [f"{r:.2f}x" if r == r else "-" for r in ratios]
        print(f"| {row} | " + " | ".join(cells) + " |")
    for (row, name), why in failed.items():
        print(f"{name} fails {row}: {why}")
    rates += read_rate(args.threads)
    rate = statistics.median(rates)
    b1 = "decode b1 (tok/s)"
    if b1 in rows:
        print(f"\nBandwidth bound of the b1 row ({args.threads} threads; read rate: median of "
              f"{len(rates)} passes of a 512 MiB x.sum(), {min(rates) / 1e9:.1f}-"
              f"{max(rates) / 1e9:.1f} GB/s)\n{BOUND_HEAD}")  # fmt: skip
        with open(os.path.join(path, "config.json")) as f:
            saved = json.load(f)  # the whole config (the routed experts' share), not overrides
        for s in systems:
            measured = statistics.median(results[b1][s.name])
            print(bound_line(s.name, s.bytes_per_token(saved), rate, measured))
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
