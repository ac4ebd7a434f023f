"""CPU speed of this engine against `transformers` on a hybrid of about 300M parameters, in one run.

Two models (random weights, float32, saved once to `--model`), chosen by `--arch`:

- `jamba` (default model `/tmp/jamba-300m-random`): hidden 1024, 8 layers (attention at layer 4
  only: `attn_layer_period` 8, offset 4; 16 query and 4 key/value heads of 64), Mamba d_state
  16, d_conv 4, expand 2, dense MLPs of 2048 and, every other layer from layer 1, 4 experts of
  2048 with top-2 routing, vocabulary 65,536, untied head: about 310M parameters.
- `granitemoehybrid` (default model `/tmp/granite-4.0-h-300m-random`): shaped like the dense
  Granite 4.0-H models (`granite-4.0-h-350m` / `-1b`): hidden 768, 28 layers, attention (no
  position embedding, 12 query and 4 key/value heads of 64) at layers 6, 13, 20 and 27,
  Mamba2 elsewhere (24 heads of 64, one group, d_state 128, conv 4, chunks of 256), a dense
  gated MLP of 2048 in every layer (`shared_mlp`, no experts), the Granite multipliers,
  vocabulary 100,352, tied head: about 306M parameters.

Workloads, medians of `--reps` interleaved repetitions, `--threads` threads:

- `prefill 512`: one 512-token prompt (engine: `LLM.generate` with one output token;
  transformers: one forward).
- `decode bN`: N sequences of 16 prompt tokens, aggregate tokens/s of 32 decode steps (engine:
  `LLMEngine.step` after every prompt has its first token; transformers: `generate` of 33
  tokens minus `generate` of 1).
- `step @ C`: one sequence with a C-token context, milliseconds per decode step (16 steps);
  `--no-steps` leaves these rows out.

With `--gguf` (the model converted by llama.cpp's `convert_hf_to_gguf.py`, see
`setup_llama_cpp.sh`) llama.cpp runs in the same repetitions through `compare_systems`'
`LlamaCppSystem` (`llama-bench` for prefill and b1, `llama-batched-bench` S_TG for b32; no
`step @ C` rows); its tools come from `--llama-cpp-home` / `$LLAMA_CPP_HOME`.

    python benchmarks/hybrid_bench.py --model /tmp/jamba-300m-random
    python benchmarks/hybrid_bench.py --arch granitemoehybrid --no-steps \
        --gguf /tmp/llamacpp/gguf/granite-4.0-h-300m-random-f32.gguf
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import time

import torch

JAMBA_CONFIG = dict(
    vocab_size=65536,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    attn_layer_period=8,
    attn_layer_offset=4,
    num_experts=4,
    num_experts_per_tok=2,
    expert_layer_period=2,
    expert_layer_offset=1,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    tie_word_embeddings=False,
    max_position_embeddings=8192,
)
GRANITE_CONFIG = dict(
    vocab_size=100352,
    hidden_size=768,
    num_hidden_layers=28,
    layer_types=["attention" if i % 7 == 6 else "mamba" for i in range(28)],
    num_attention_heads=12,
    num_key_value_heads=4,
    position_embedding_type=None,
    num_local_experts=0,
    num_experts_per_tok=0,  # as the dense Granite 4.0-H configs (llama.cpp asserts it)
    shared_intermediate_size=2048,
    intermediate_size=2048,  # llama.cpp sizes the dense MLP by it; transformers by the shared one
    mamba_n_heads=24,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    embedding_multiplier=12.0,
    attention_multiplier=0.015625,
    residual_multiplier=0.246,
    logits_scaling=3.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=8192,
)
ARCHS = {  # --arch: (transformers class, config, default model directory)
    "jamba": ("JambaForCausalLM", JAMBA_CONFIG, "/tmp/jamba-300m-random"),
    "granitemoehybrid": (
        "GraniteMoeHybridForCausalLM",
        GRANITE_CONFIG,
        "/tmp/granite-4.0-h-300m-random",
    ),
}
TOKENIZER_DIR = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests/data/gpt-neox-20b-tokenizer"
)
DECODE_TOKENS = 32
PROMPT_LEN = 16


def make_model(arch: str, path: str) -> int:
    """Saves the random-weight model (N(0, 0.02^2), A_log / D / norms as initialised) once."""
    import transformers

    cls_name, config, _ = ARCHS[arch]
    model_cls = getattr(transformers, cls_name)
    torch.manual_seed(0)
    model = model_cls(model_cls.config_class(**config))
    if not os.path.isfile(os.path.join(path, "config.json")):
        model.save_pretrained(path)
    for file in os.listdir(TOKENIZER_DIR):  # GPT-NeoX's tokenizer; prompts are token ids
        if file.endswith(".json"):
            shutil.copy(os.path.join(TOKENIZER_DIR, file), path)
    return sum(p.numel() for p in model.parameters())


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` random token ids below `vocab`."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


class Engine:
    """This engine through `LLM` / `LLMEngine`."""

    name = "vllm_mamba"

    def __init__(self, path: str, vocab: int) -> None:
        from vllm_mamba import LLM

        self.vocab = vocab
        self.llm = LLM(path, max_model_len=4200, max_num_seqs=32, disable_log_stats=True)

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
    """llama.cpp on the model's GGUF, through `compare_systems.LlamaCppSystem`."""

    name = "llama.cpp"

    def __init__(self, home: str, gguf: str, threads: int) -> None:
        from compare_systems import LlamaCppSystem

        self.system = LlamaCppSystem(os.path.join(home, "bin"), gguf, "F32", threads)

    def prefill(self, length: int) -> float:
        return self.system.prefill([0] * length)

    def decode(self, batch: int) -> float:
        return self.system.decode([[0] * PROMPT_LEN] * batch, DECODE_TOKENS)

    def step_ms(self, context: int) -> float:
        raise NotImplementedError("llama.cpp has no step @ C row (use --no-steps)")


class Transformers:
    """transformers' model class (its PyTorch paths; no mamba-ssm kernels on the CPU)."""

    name = "transformers"

    def __init__(self, path: str, cls_name: str, vocab: int) -> None:
        import transformers

        self.vocab = vocab
        model_cls = getattr(transformers, cls_name)
        self.model = model_cls.from_pretrained(path, dtype=torch.float32).eval()

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
        ids = torch.tensor(prompts(self.vocab, 1, context, seed=1))
        return 1000 * (self._generate(ids, 17) - self._generate(ids, 1)) / 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=sorted(ARCHS), default="jamba")
    p.add_argument("--model", help="model directory (written once); default by --arch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--no-steps", action="store_true", help="leave out the step @ C rows")
    p.add_argument("--gguf", help="the model as llama.cpp GGUF: adds llama.cpp to the run")
    p.add_argument(
        "--llama-cpp-home",
        default=os.environ.get("LLAMA_CPP_HOME", "/tmp/llamacpp"),
        help="bin/llama-bench and bin/llama-batched-bench live here",
    )
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
    print(f"model: {make_model(args.arch, path) / 1e6:.0f}M parameters in {path}")
    systems = [Engine(path, config["vocab_size"])]
    if not args.skip_transformers:
        systems.append(Transformers(path, cls_name, config["vocab_size"]))
    if args.gguf:
        systems.append(LlamaCpp(args.llama_cpp_home, args.gguf, args.threads))
    rows = {
        "prefill 512 (tok/s)": lambda s: s.prefill(512),
        "decode b1 (tok/s)": lambda s: s.decode(1),
        "decode b32 (tok/s)": lambda s: s.decode(32),
    }
    if not args.no_steps:
        rows["step @ 128 (ms)"] = lambda s: s.step_ms(128)
        rows["step @ 4096 (ms)"] = lambda s: s.step_ms(4096)
    results: dict[str, dict[str, list[float]]] = {r: {s.name: [] for s in systems} for r in rows}
    for rep in range(args.reps):
        for row, fn in rows.items():
            for system in systems:
                results[row][system.name].append(fn(system))
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
        cells = [f"{m:,.1f}" for m in med] + [f"{r:.2f}x" for r in ratios]
        print(f"| {row} | " + " | ".join(cells) + " |")
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
