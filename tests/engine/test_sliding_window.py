"""Sliding-window attention in the engine: the KV blocks a sequence holds stay flat once its
window has passed (measured on RecurrentGemma's tiny model, whose every attention layer slides
over 16 tokens), and its outputs equal a run with enough memory for every token."""

from __future__ import annotations

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.engine.block_manager import blocks_for

WINDOW, BLOCK = 16, 16


def _blocks_per_step(runner: VllmRunner, prompt: list[int], max_tokens: int) -> list[int]:
    """Runs one greedy request step by step; the KV blocks in use after each step."""
    engine = runner.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": prompt}, params)
    used = []
    while engine.has_unfinished_requests():
        engine.step()
        used.append(engine.scheduler.block_manager.num_used_blocks)
    return used


def test_kv_blocks_stay_flat_past_the_window() -> None:
    """A 100-token prompt in chunks of 32, then 300 decoded tokens: at most the window plus a
    chunk in blocks while prefilling, then at most two blocks (the window straddles one block
    boundary) whatever the length; a full-attention layer would hold 25 by the end."""
    prompt = [(7 * i) % 50000 + 3 for i in range(100)]
    with VllmRunner(
        tiny_model_dir("recurrent-gemma-mqa"), block_size=BLOCK, max_num_batched_tokens=32
    ) as runner:
        used = _blocks_per_step(runner, prompt, 300)
    prefill_steps = blocks_for(len(prompt), 32)
    assert max(used[:prefill_steps]) <= (WINDOW - 1 + 32) // BLOCK + 2
    assert max(used[prefill_steps:-1]) <= 2  # the last step frees everything
    assert blocks_for(len(prompt) + 300, BLOCK) == 25


def test_a_pool_smaller_than_the_sequence_serves_it() -> None:
    """Six blocks (96 tokens) serve a 400-token sequence whose window is 16, with the tokens of
    an engine whose pool holds every token."""
    prompt = [(11 * i) % 50000 + 3 for i in range(120)]
    params = SamplingParams(temperature=0, max_tokens=280, ignore_eos=True)
    path = tiny_model_dir("recurrent-gemma-mqa")
    with VllmRunner(path, num_gpu_blocks_override=6, max_num_batched_tokens=32) as runner:
        small = runner.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    with VllmRunner(path) as runner:
        large = runner.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    assert small == large and len(small) == 280
