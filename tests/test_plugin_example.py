"""The example plugin (`examples/ema_plugin`) runs through the engine unchanged.

Its model has a recurrent layer of its own state shape (`ema (C,)`, `last (2, C)`) with
`_ref`-only ops. Checked through `vllm_mamba.LLM` on the CPU: greedy tokens equal to the
plugin's independent full-sequence reference (and varied), batching, chunked prefill at odd
budgets, forks, preemption by recompute, prefix caching and n-gram speculative decoding (drafts
proposed, accepted and rejected; the state after every step bit for bit the state without
speculation) each equal to the plain run, and every state slot free after draining
(`VllmRunner` checks it on leaving each block).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.tiny_models import TOKENIZER_DIR
from vllm_mamba import RequestOutput, SamplingParams
from vllm_mamba.cache_specs import PAD_SLOT_ID

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples", "ema_plugin"))

import vllm_mamba_ema  # noqa: E402
from vllm_mamba_ema.ops import ema_scan_varlen_ref, ema_state_update_ref  # noqa: E402

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SPEC_GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ECHO = 8  # tokens of its own continuation an echo prompt starts with
# The speculative checks compare runs bit for bit: one thread each, so that no thread count
# chosen by the engine's governor (it follows the load of other processes) differs between them.
ONE_THREAD = {"device": "cpu", "threads": 1}
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a small dragon who",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "A state-space model keeps a fixed-size state per sequence, so memory does not grow with "
    "the number of tokens it has read, and decoding costs the same at every step.",
]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    vllm_mamba_ema.register()
    return vllm_mamba_ema.write_tiny_checkpoint(str(tmp_path_factory.mktemp("ema")), TOKENIZER_DIR)


@pytest.fixture(scope="module")
def runner(model_dir: str) -> Iterator[VllmRunner]:
    with VllmRunner(model_dir, device="cpu") as r:
        yield r


@pytest.fixture(scope="module")
def alone(runner: VllmRunner) -> list[list[int]]:
    """Each prompt by itself through the engine."""
    return [tokens(runner.generate(p, GREEDY))[0] for p in PROMPTS]


def test_ops_skip_pad_rows() -> None:
    """PAD_SLOT_ID rows and chunks are neither read nor written; real rows are unaffected."""
    g = torch.Generator().manual_seed(0)
    C, S = 4, 3
    a, w = torch.rand(C, generator=g), torch.randn(2, C, generator=g)
    ema, last = torch.randn(S, C, generator=g), torch.randn(S, 2, C, generator=g)
    ema0, last0 = ema.clone(), last.clone()
    u = torch.randn(2, C, generator=g)
    out = ema_state_update_ref(u, a, w, ema, last, torch.tensor([PAD_SLOT_ID, 1]))
    assert torch.equal(out[0], torch.zeros(C))
    assert torch.equal(ema[[0, 2]], ema0[[0, 2]]) and torch.equal(last[[0, 2]], last0[[0, 2]])
    assert torch.allclose(ema[1], a * ema0[1] + (1 - a) * u[1])
    u = torch.randn(5, C, generator=g)
    qsl, slots = torch.tensor([0, 2, 5]), torch.tensor([2, PAD_SLOT_ID])
    out = ema_scan_varlen_ref(u, a, w, ema, last, qsl, slots, torch.tensor([False, True]))
    assert torch.equal(out[2:], torch.zeros(3, C)) and out[:2].abs().sum() > 0
    assert torch.equal(ema[0], ema0[0]) and torch.equal(last[0], last0[0])
    assert torch.equal(last[2, 0], u[1]) and torch.equal(last[2, 1], u[0])


def test_greedy_equals_reference_and_is_varied(runner, model_dir, alone) -> None:
    ref_model = vllm_mamba_ema.EmaReference(
        model_dir, vllm_mamba_ema.EmaConfig.from_pretrained(model_dir)
    )
    tok = runner.llm.get_tokenizer()
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    assert len({len(i) for i in ids}) == len(ids)  # prompts of different lengths
    refs = [ref_model.greedy(i, MAX_TOKENS) for i in ids]
    assert all(len(set(r)) >= MAX_TOKENS // 2 for r in refs), refs
    assert len({tuple(r) for r in refs}) == len(refs)
    assert alone == refs


def test_batched_equals_alone(runner, model_dir, alone) -> None:
    assert tokens(runner.generate(PROMPTS, GREEDY)) == alone
    with VllmRunner(model_dir, device="cpu", max_num_seqs=2) as two_slots:
        assert tokens(two_slots.generate(PROMPTS, GREEDY)) == alone


@pytest.mark.parametrize("budget", [1, 5])
def test_chunked_prefill_equals_whole(model_dir, alone, budget: int) -> None:
    with VllmRunner(model_dir, device="cpu", max_num_batched_tokens=budget) as chunked:
        assert tokens(chunked.generate(PROMPTS[1:], GREEDY)) == alone[1:]


def test_forks_equal_independent_runs(runner, alone) -> None:
    greedy3 = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=3, ignore_eos=True)
    out = runner.generate(PROMPTS[2], greedy3)[0]
    assert [o.token_ids for o in out.outputs] == [alone[2]] * 3
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, n=3, seed=3, ignore_eos=True)
    first = runner.generate(PROMPTS[3], sampled)[0]
    again = runner.generate([PROMPTS[0], PROMPTS[3]], [GREEDY, sampled])[1]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_preemption_equals_no_preemption(runner, alone) -> None:
    """Preemption by recompute, forced as tests/engine/test_engine_invariance.py does (an
    attention-free model never runs out of blocks), of single and forked requests."""
    engine = runner.engine
    before = engine.scheduler.num_preemptions
    fork = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=3, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"pre-{i}", p, fork if i == 4 else GREEDY)
    finished: dict[str, RequestOutput] = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        if steps in (2, 6, 9) and engine.scheduler.running:
            engine.scheduler.preempt(engine.scheduler.running[-1])
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert engine.scheduler.num_preemptions - before == 3
    assert [o.token_ids for o in finished["pre-4"].outputs] == [alone[4]] * 3
    assert [finished[f"pre-{i}"].outputs[0].token_ids for i in range(4)] == alone[:4]
    assert engine.scheduler.slots.num_used == 0


def test_prefix_caching_equals_off_and_hits(model_dir, alone) -> None:
    system = PROMPTS[4] + " "
    follow = [system + "Why?", system + "How?"]
    with VllmRunner(model_dir, device="cpu") as off:
        ref = tokens(off.generate(follow, GREEDY))
    with VllmRunner(model_dir, device="cpu", enable_prefix_caching=True) as on:
        assert tokens(on.generate(PROMPTS[4], GREEDY)) == [alone[4]]
        got = [on.generate(p, GREEDY)[0] for p in follow]
        assert tokens(got) == ref
        assert all(g.num_cached_tokens > 0 for g in got), [g.num_cached_tokens for g in got]
        assert on.engine.stats_snapshot().prefix_cache_hits > 0
        assert on.engine.scheduler.slots.num_used == 0


@pytest.fixture(scope="module")
def echo_prompts(runner: VllmRunner, alone: list[list[int]]) -> list[list[int]]:
    """Prompts with a repetition that n-gram lookup drafts from: `PROMPTS[1:]`, each preceded
    by the first `ECHO` tokens of its own greedy continuation. The EMA's memory fades within
    a few tokens, so the model continues the echo prompt as it did the prompt: the lookup
    finds each new token in the copy and drafts what follows it there, accepted until the
    copy ends and rejected after (the tests assert both happen)."""
    tok = runner.llm.get_tokenizer()
    return [a[:ECHO] + tok(p)["input_ids"] for p, a in zip(PROMPTS[1:], alone[1:])]


def assert_drafts_accepted_and_rejected(engine: object) -> None:
    counters = engine.spec_steps.counters
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens, vars(counters)


def test_ngram_speculation_equals_plain(model_dir, echo_prompts) -> None:
    """Greedy tokens with n-gram drafts (some accepted, some rejected) equal those without,
    for chains side by side in one step. The mixer runs a chain's rows in waves
    (`recurrent_step`); one call over them at the sequence's slot would verify every draft on
    the chain's starting state and never write the spare slots that rollbacks restore."""
    prompts = [{"prompt_token_ids": p} for p in echo_prompts]
    with VllmRunner(model_dir, **ONE_THREAD) as plain_runner:
        plain = tokens(plain_runner.generate(prompts, SPEC_GREEDY))
    with VllmRunner(model_dir, **ONE_THREAD, speculative_config=NGRAM) as spec:
        assert tokens(spec.generate(prompts, SPEC_GREEDY)) == plain
        assert_drafts_accepted_and_rejected(spec.engine)


def slot_states_by_length(
    engine: object, prompt: list[int]
) -> tuple[dict[int, list[torch.Tensor]], list[int]]:
    """Steps one greedy request alone. Returns its slot's rows of every tensor of the engine's
    state cache after each step, keyed by the tokens it has computed, and its tokens."""
    engine.add_request("alone", {"prompt_token_ids": prompt}, SPEC_GREEDY)
    states: dict[int, list[torch.Tensor]] = {}
    seq = slot = None
    while engine.has_unfinished_requests():
        engine.step()
        if engine.scheduler.running:  # after its last step it has left (its slot as it was)
            seq = engine.scheduler.running[0].seqs[0]
            slot = seq.slot
        assert seq is not None and slot is not None
        tensors = [t for group in engine.cache.tensors for t in group.values()]  # (L, S, ...)
        states[seq.num_computed_tokens] = [t[:, slot].clone() for t in tensors]
    return states, list(seq.output_token_ids)


@pytest.mark.parametrize("proposer", ["ngram", "oracle"])
def test_state_after_rejections_is_bitwise_the_plain_state(
    model_dir, echo_prompts, proposer: str
) -> None:
    """After every step of a speculating request, whatever was accepted, its state slot holds
    bit for bit the state of the same tokens decoded without speculation: the rejected
    positions are rolled back from the spare slots the waves wrote. Drafts from the n-gram
    lookup, and from `OracleProposer` (its continuation with every third draft made wrong:
    rejections at every position of a chain)."""
    prompt = echo_prompts[1]
    with VllmRunner(model_dir, **ONE_THREAD) as plain:
        want, out = slot_states_by_length(plain.engine, prompt)
    with VllmRunner(model_dir, **ONE_THREAD, speculative_config=NGRAM) as spec:
        if proposer == "oracle":
            spec.engine.spec_steps.proposer = OracleProposer({tuple(prompt): out})
        got, spec_out = slot_states_by_length(spec.engine, prompt)
        assert_drafts_accepted_and_rejected(spec.engine)
    assert spec_out == out
    assert len(got) < len(want) and set(got) <= set(want)  # some steps kept several tokens
    for length, state in got.items():
        assert all(torch.equal(a, b) for a, b in zip(state, want[length], strict=True)), length
