"""The systems `compare.py` measures: this engine, `transformers`, llama.cpp's tools (and
ik_llama.cpp's, `IkLlamaCppSystem`) and the `rwkv` package (RWKV-7 `.pth` files).

Each system has a `name`, `warm_up(prompt_len)`, `prefill(prompt) -> tokens/s`,
`decode(prompts, num_tokens) -> aggregate decode tokens/s` (None when it does not run that
workload) and `notes()`, lines saying how it was measured. Every system generates greedily and
ignores EOS, so lengths are exact.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time

import torch

TOKENIZER_VOCAB = 50277  # tokens the GPT-NeoX tokenizer knows; the model's vocab is padded


def random_prompts(num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of exactly `length` random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TOKENIZER_VOCAB, (num, length), generator=g).tolist()


class EngineSystem:
    """This engine through `LLM` (prefill) and `LLMEngine.step` (decode)."""

    def __init__(
        self,
        model: str,
        dtype: str,
        max_batch: int,
        quantization: str | None = None,
        ssm_state_dtype: str = "auto",
        threads: int | None = None,
    ) -> None:
        from vllm_mamba import LLM

        self.name = "engine"
        self.dtype = dtype
        self.threads = threads
        self.llm = LLM(
            model,
            dtype=dtype,
            device="cpu",
            max_num_seqs=max_batch,
            max_num_batched_tokens=2048,
            max_model_len=4096,
            quantization=quantization,
            ssm_state_dtype=ssm_state_dtype,
            **({"threads": threads} if threads else {}),
        )
        self._ids = itertools.count()

    def _params(self, num_tokens: int):  # noqa: ANN202 - SamplingParams
        from vllm_mamba import SamplingParams

        return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)

    def warm_up(self, prompt_len: int) -> None:
        self.prefill(random_prompts(1, 64, seed=0)[0])
        self.decode(random_prompts(2, prompt_len, seed=0), 4)

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        self.llm.generate({"prompt_token_ids": prompt}, self._params(1), use_tqdm=False)
        return len(prompt) / (time.perf_counter() - start)

    def decode(self, prompts: list[list[int]], num_tokens: int) -> float:
        """Adds every prompt, steps until each has its first token, then times the rest."""
        engine = self.llm.llm_engine
        stats = engine.stats
        params = self._params(num_tokens)
        for prompt in prompts:
            engine.add_request(f"cmp-{next(self._ids)}", {"prompt_token_ids": prompt}, params)
        prefilled = stats.generation_tokens + len(prompts)
        while stats.generation_tokens < prefilled:
            engine.step()
        first, start = stats.generation_tokens, time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return (stats.generation_tokens - first) / (time.perf_counter() - start)

    def notes(self) -> list[str]:
        return [
            f"vllm_mamba {self.dtype}, torch {torch.__version__}, "
            + (f"{self.threads} threads pinned" if self.threads else "threads following the load")
            + "; prefill: LLM.generate with max_tokens=1; decode: LLMEngine.step after "
            "every prompt has its first token"
        ]


class TransformersSystem:
    """`generate` of the model's transformers class (`AutoModelForCausalLM`: Mamba, Mamba2,
    FalconMamba, ...); decode is `generate(T)` minus `generate(1)`."""

    def __init__(self, model: str, dtype: str, decode_tokens: int, max_batch: int) -> None:
        from transformers import AutoModelForCausalLM

        self.name = "transformers"
        self.dtype = dtype
        self.decode_tokens = decode_tokens
        self.max_batch = max_batch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()

    def _time_generate(self, prompts: list[list[int]], num_tokens: int) -> float:
        ids = torch.tensor(prompts)
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=num_tokens,
                min_new_tokens=num_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        elapsed = time.perf_counter() - start
        assert out.shape[1] == ids.shape[1] + num_tokens
        return elapsed

    def warm_up(self, prompt_len: int) -> None:
        self._time_generate(random_prompts(2, prompt_len, seed=0), 2)

    def prefill(self, prompt: list[int]) -> float:
        return len(prompt) / self._time_generate([prompt], 1)

    def decode(self, prompts: list[list[int]], num_tokens: int) -> float | None:
        if len(prompts) > self.max_batch:
            return None
        num_tokens = min(num_tokens, self.decode_tokens)
        first = self._time_generate(prompts, 1)
        total = self._time_generate(prompts, num_tokens)
        if total <= first:
            return None
        return len(prompts) * (num_tokens - 1) / (total - first)

    def notes(self) -> list[str]:
        import transformers

        return [
            f"transformers {transformers.__version__} {self.dtype} (no mamba-ssm / causal-conv1d: "
            f"its PyTorch path), generate greedy; decode at most {self.decode_tokens} tokens, "
            f"batches up to {self.max_batch}"
        ]


def failure_reason(error: Exception) -> str:
    """The line of a failed llama.cpp tool's output (`LlamaCppSystem` raises it) that says
    why: its last assertion or error, without the source path."""
    text = str(error)
    lines = [x for x in text.splitlines() if "ASSERT" in x or "error" in x]
    return (lines or text.splitlines()[-1:] or [""])[-1].split("/")[-1]


class LlamaCppSystem:
    """llama.cpp's `llama-bench` (prefill, decode b1) and `llama-batched-bench` (b > 1)."""

    project = "llama.cpp"

    def __init__(self, bin_dir: str, gguf: str, label: str, threads: int) -> None:
        self.name = f"{self.project} {label}"
        self.gguf = gguf
        self.threads = threads
        self.bench = os.path.join(bin_dir, "llama-bench")
        self.batched = os.path.join(bin_dir, "llama-batched-bench")
        self.build = ""
        self.stderr = ""
        self.bench_args: list[str] = []  # extra llama-bench arguments
        self.batched_args: list[str] = ["--output-format", "jsonl"]  # extra batched-bench ones

    def _run(self, cmd: list[str]) -> str:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        self.stderr = done.stderr  # the last command's
        return done.stdout

    def _llama_bench(self, n_prompt: int, n_gen: int) -> float:
        cmd = [self.bench, "-m", self.gguf, "-t", str(self.threads), "-r", "1", "-o", "json"]
        cmd += self.bench_args
        out = json.loads(self._run([*cmd, "-p", str(n_prompt), "-n", str(n_gen)]))
        self.build = f"build {out[0].get('build_commit')} ({out[0].get('cpu_info')})"
        return float(out[0]["avg_ts"])

    def warm_up(self, prompt_len: int) -> None:
        self._llama_bench(prompt_len, 0)

    def prefill(self, prompt: list[int]) -> float:
        return self._llama_bench(len(prompt), 0)

    def decode(self, prompts: list[list[int]], num_tokens: int) -> float:
        batch, prompt_len = len(prompts), len(prompts[0])
        if batch == 1:
            return self._llama_bench(0, num_tokens)
        cmd = [self.batched, "-m", self.gguf, "-t", str(self.threads), "-b", "2048"]
        cmd += ["-ub", "512", "-c", str(batch * (prompt_len + num_tokens))]
        cmd += ["-npp", str(prompt_len), "-ntg", str(num_tokens), "-npl", str(batch)]
        return self._speed_tg(self._run([*cmd, *self.batched_args]))

    def _speed_tg(self, out: str) -> float:
        """S_TG of the last row of `llama-batched-bench --output-format jsonl`."""
        rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        return float(rows[-1]["speed_tg"])

    def notes(self) -> list[str]:
        extra = " ".join(self.bench_args)
        return [
            f"{self.project}: {os.path.basename(self.gguf)}, {self.threads} threads, "
            f"{self.build}{'; ' + extra if extra else ''}; prefill and b1: llama-bench "
            "-p/-n; b>1: llama-batched-bench S_TG"
        ]


class IkLlamaCppSystem(LlamaCppSystem):
    """ik_llama.cpp (the CPU-tuned fork, built by `setup_llama_cpp.sh` from the
    `ik-llama-cpp-python` source package) through the same tools. Its `llama-batched-bench`
    prints only a markdown table, and runs with one prompt shared by every stream (`-pps`):
    on Qwen3.5 / Qwen3-Next (`qwen35`, `qwen3next`) its batches of several sequences with
    several tokens each fall back to one token per call, and its flash attention then fails
    (`iqk_fa_templates.h: GGML_ASSERT(S > 0)`); S_TG, the decode steps alone, is measured the
    same way. `repack` turns on its run-time repacking of quantised weights into its
    interleaved-row layouts (`-rtr`), off by default as in its tools."""

    project = "ik_llama.cpp"

    def __init__(
        self, bin_dir: str, gguf: str, label: str, threads: int, repack: bool = False
    ) -> None:
        super().__init__(bin_dir, gguf, label, threads)
        self.bench_args = ["-rtr", "1"] if repack else []
        self.batched_args = ["-pps", *(["-rtr"] if repack else [])]

    def _speed_tg(self, out: str) -> float:
        """S_TG of the last row of the table `|PP|TG|B|N_KV|T_PP s|S_PP t/s|T_TG s|S_TG t/s|...`
        (on stdout or, as this build prints it, stderr)."""
        rows = [
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in (out + "\n" + self.stderr).splitlines()
            if line.lstrip().startswith("|")
        ]
        numeric = [r for r in rows if len(r) >= 8 and r[0].isdigit()]
        if not numeric:
            raise RuntimeError(
                f"no result row in ik_llama.cpp's batched-bench output:\n{out[-2000:]}"
            )
        return float(numeric[-1][7])


class RwkvPackageSystem:
    """The `rwkv` package's RWKV-7 (`rwkv.model.RWKV` on a BlinkDL `.pth` file, CPU, JIT as
    `jit` says): prefill is one `forward` over the prompt, decode one `forward` per token with
    greedy argmax. No batching: decode runs only for one sequence (None for more)."""

    def __init__(self, pth_file: str, dtype: str, jit: bool = True) -> None:
        # read when rwkv.model is first imported
        os.environ.update(
            {"RWKV_V7_ON": "1", "RWKV_JIT_ON": "1" if jit else "0", "RWKV_CUDA_ON": "0"}
        )
        from importlib.metadata import version

        from rwkv.model import RWKV

        self.precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        self.name = f"rwkv {self.precision}"
        self.jit = jit
        self.version = version("rwkv")
        assert pth_file.endswith(".pth"), pth_file
        self.model = RWKV(model=pth_file[: -len(".pth")], strategy=f"cpu {self.precision}")

    @torch.no_grad()
    def _forward(self, tokens: list[int], state: list | None) -> tuple[torch.Tensor, list]:
        return self.model.forward(list(tokens), state)

    def warm_up(self, prompt_len: int) -> None:
        self.prefill(random_prompts(1, 64, seed=0)[0])
        self.decode(random_prompts(1, prompt_len, seed=0), 4)

    def prefill(self, prompt: list[int]) -> float:
        start = time.perf_counter()
        logits, _ = self._forward(prompt, None)
        int(logits.argmax())
        return len(prompt) / (time.perf_counter() - start)

    def decode(self, prompts: list[list[int]], num_tokens: int) -> float | None:
        """The prompt, then `num_tokens - 1` timed one-token steps (the engine's decode steps
        after the first token)."""
        if len(prompts) != 1:
            return None
        logits, state = self._forward(prompts[0], None)
        token = int(logits.argmax())
        start = time.perf_counter()
        for _ in range(num_tokens - 1):
            logits, state = self._forward([token], state)
            token = int(logits.argmax())
        return (num_tokens - 1) / (time.perf_counter() - start)

    def notes(self) -> list[str]:
        return [
            f"rwkv package {self.version} RWKV-7, strategy 'cpu {self.precision}', "
            f"RWKV_JIT_ON={int(self.jit)}, torch {torch.__version__}; prefill: one forward over "
            "the prompt; decode: one forward per token, 1 sequence only (no batching)"
        ]
