"""Engines made twice in one process: `LLM.shutdown()` and `with LLM(...)` stop the
tensor-parallel workers and leave the process group; a new `tensor_parallel_size=2` engine
starts after the first was shut down, after it was only dropped (`del`, several times in a
row: a dropped engine's finalizer must not destroy its successor's group), and after a start
that was refused at warm-up."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0)
PROMPT = "def add(a, b):"


def _tp_llm(**kwargs: object) -> LLM:
    return LLM(
        tiny_model_dir("tied"), device="cpu", tensor_parallel_size=2, max_num_seqs=4, **kwargs
    )


def _text(llm: LLM) -> str:
    return llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].text


def test_shutdown_and_context_manager_stop_workers_and_the_group() -> None:
    with _tp_llm() as llm:
        want = _text(llm)
        procs = list(llm.llm_engine.executor.procs)
        assert dist.is_initialized()
    assert not dist.is_initialized()
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPT, GREEDY)
    llm.shutdown()  # idempotent
    second = _tp_llm()
    try:
        assert _text(second) == want
    finally:
        second.shutdown()


def test_engines_dropped_without_shutdown_make_way() -> None:
    texts = []
    for _ in range(3):
        llm = _tp_llm()
        texts.append(_text(llm))
        del llm
    assert len(set(texts)) == 1
    last = _tp_llm()
    try:
        assert _text(last) == texts[0]
    finally:
        last.shutdown()
    assert not dist.is_initialized()


def test_an_engine_starts_after_a_refused_start() -> None:
    with pytest.raises(Exception, match="float16"):
        _tp_llm(dtype="float16")  # the CPU cannot run it: refused at warm-up
    with _tp_llm() as llm:
        assert _text(llm)
    assert not dist.is_initialized()
