"""The two sides of every comparison, after vLLM's `hf_runner` / `vllm_runner`.

`HfRunner` is `transformers` on a checkpoint directory (float32): the reference. `VllmRunner`
is this engine on the same directory, used as a context manager: every engine the tests build
goes through it, and leaving the block without an error checks that the engine drained (no
request left, every state slot, KV block and prefix snapshot free: `assert_drained`, the one
such check); leaving it in any way shuts the engine's workers down (tensor parallelism).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from vllm_mamba import LLM, RequestOutput, SamplingParams


class HfRunner:
    """A transformers causal LM and its tokenizer, loaded from `model_dir`."""

    def __init__(self, model_dir: str, cls_name: str = "AutoModelForCausalLM") -> None:
        import transformers

        self.model_dir = model_dir
        model_cls = getattr(transformers, cls_name)
        self.model = model_cls.from_pretrained(model_dir, dtype=torch.float32).eval()

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The tokenizer saved beside the weights."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.model_dir)

    @torch.no_grad()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        """`(len(ids), V)`: row i is log p(. | ids[: i + 1]), float32."""
        logits = self.model(torch.tensor([ids])).logits[0].float()  # (len(ids), V)
        return logits.log_softmax(-1)

    def greedy(self, ids: list[int], max_tokens: int) -> list[int]:
        """`ids` followed by `max_tokens` greedy tokens, one full forward per token."""
        ids = list(ids)
        for _ in range(max_tokens):
            ids.append(int(self.logprobs(ids)[-1].argmax()))
        return ids

    @torch.no_grad()
    def generate_greedy_logprobs(
        self, prompts: list[list[int]], max_tokens: int
    ) -> list[tuple[list[int], torch.Tensor]]:
        """Per prompt, alone: `max_tokens` greedy tokens (`generate`, with its state cache)
        and the log-softmax of each step `(max_tokens, V)`."""
        refs = []
        for prompt in prompts:
            out = self.model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            refs.append((tokens, torch.stack(out.scores)[:, 0].float().log_softmax(-1)))
        return refs


class VllmRunner:
    """This engine on `model` with `engine_kwargs` (`LLM`'s keyword arguments)."""

    def __init__(self, model: str, **engine_kwargs: Any) -> None:
        self.llm = LLM(model, **engine_kwargs)

    def __enter__(self) -> VllmRunner:
        return self

    def __exit__(self, exc_type: type | None, *_: object) -> None:
        try:
            if exc_type is None:
                self.assert_drained()
        finally:
            self.engine.executor.shutdown()

    @property
    def engine(self) -> Any:
        """The `LLMEngine` under the `LLM`."""
        return self.llm.llm_engine

    def generate(
        self, prompts: Any, params: SamplingParams | list[SamplingParams]
    ) -> list[RequestOutput]:
        """`LLM.generate` without a progress bar."""
        return self.llm.generate(prompts, params, use_tqdm=False)

    def generate_greedy(self, prompts: Any, max_tokens: int, **params: Any) -> list[list[int]]:
        """The greedy tokens of each prompt's first completion."""
        sampling = SamplingParams(temperature=0, max_tokens=max_tokens, **params)
        return [o.outputs[0].token_ids for o in self.generate(prompts, sampling)]

    def assert_drained(self) -> None:
        """`assert_drained` on this runner's engine."""
        assert_drained(self.engine)


def assert_drained(engine: Any) -> None:
    """No request waits or runs and every state slot and KV block of `engine` (an
    `LLMEngine`) is free (prefix-cache snapshots hold slots and blocks of their own: they are
    evicted first, and then the cache must hold nothing at all)."""
    assert not engine.has_unfinished_requests()
    sched = engine.scheduler
    assert not sched.running and not sched.waiting
    assert sched.slots.num_used == 0, f"{sched.slots.num_used} state slots still in use"
    cache = engine.prefix_cache
    if cache is not None:
        cache.clear()
        assert cache.num_snapshots == 0 and cache.slots.num_used == 0
        assert not cache.tree.root.children, "the prefix tree still holds paths"
    blocks = sched.block_manager.num_used_blocks
    assert blocks == 0, f"{blocks} KV blocks still in use"
