"""`LLM`: the offline API. Load a model once, then `generate` for many prompts at once."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq

from tqdm.auto import tqdm

from vllm_mamba.engine.llm_engine import LLMEngine, PromptInput
from vllm_mamba.outputs import RequestOutput
from vllm_mamba.sampling_params import SamplingParams


class LLM:
    """A model loaded into an engine, for batch generation.

    Args:
        model: a local Hugging Face model directory or a hub id.
        tokenizer: a tokenizer directory or hub id (default: the model's).
        dtype: `auto`, `float32`, `bfloat16` or `float16`.
        max_num_seqs: sequences in flight at once (= state slots).
        max_num_batched_tokens: tokens per forward; longer prompts are prefilled in chunks.
        max_model_len: longest prompt plus output (default: from the config, else 2048).
        seed: seed of the engine's sampling generator (requests may bring their own).
        enforce_eager: never capture CUDA graphs.
        device: `auto` (CUDA when present), `cpu` or `cuda`.
        ssm_state_dtype: `auto` (the model's: float32 for Mamba) or a dtype name.
    """

    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        seed: int = 0,
        enforce_eager: bool = False,
        device: str = "auto",
        ssm_state_dtype: str = "auto",
    ) -> None:
        self.llm_engine = LLMEngine.from_args(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            seed=seed,
            enforce_eager=enforce_eager,
            device=device,
            ssm_state_dtype=ssm_state_dtype,
        )
        self._ids = itertools.count()

    def get_tokenizer(self):  # noqa: ANN201 - a transformers tokenizer
        """The engine's tokenizer."""
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Seq[PromptInput],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generates completions for all prompts together (continuous batching).

        Args:
            prompts: a string, a list of strings, token ids (`{"prompt_token_ids": [...]}`),
                or a list of those.
            sampling_params: one for all prompts, or one per prompt.
            use_tqdm: show a progress bar with token throughput.

        Returns:
            One finished `RequestOutput` per prompt, in input order.

        Raises:
            ValueError: a bad prompt or parameter; nothing is left in the engine.
        """
        prompt_list = self._as_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts"
                )
        engine = self.llm_engine
        request_ids = [f"gen-{next(self._ids)}" for _ in prompt_list]
        try:
            for rid, prompt, params in zip(request_ids, prompt_list, params_list):
                engine.add_request(rid, prompt, params)
        except Exception:
            engine.abort_request(request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    @staticmethod
    def _as_list(prompts: PromptInput | Seq[PromptInput]) -> list[PromptInput]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        if not prompts:
            raise ValueError("prompts is empty")
        return prompts

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm)
        start, out_tokens = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = max(time.perf_counter() - start, 1e-9)
                        bar.set_postfix_str(f"output: {out_tokens / elapsed:.1f} tok/s")
        except BaseException:
            engine.abort_request(request_ids)
            raise
        finally:
            bar.close()
        return [finished[rid] for rid in request_ids]
