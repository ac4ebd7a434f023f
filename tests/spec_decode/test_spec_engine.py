"""Speculative decoding through the engine: exact greedy tokens and exact states whatever is
accepted, with every other engine feature.

The references are runs without speculation. Drafts come from `OracleProposer` (partly right
drafts: long accepted runs and rejections at every position) unless a test says otherwise.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.helpers.family_checks import GREEDY, alone, prompts, tokens
from tests.helpers.runners import VllmRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.tiny_models import FAMILIES, tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.engine.sequence import Sequence
from vllm_mamba.layers.decode_plan import plan_decode
from vllm_mamba.layers.mixer_base import StateSpaceMixer
from vllm_mamba.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
WITH_KV = {"glm5-next-moe", "qwen4-exp-ple"}  # their KV cache holds an indexer's keys


def _oracle(runner: VllmRunner, refs: dict, every: int = 3) -> OracleProposer:
    oracle = OracleProposer(refs, every)
    runner.engine.spec_steps.proposer = oracle
    return oracle


def _refs(path: str) -> dict[tuple[int, ...], list[int]]:
    return {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts(), alone(path))}


def _slot_state(engine: object, slot: int) -> list[torch.Tensor]:
    """Every state tensor's rows of `slot`, across layers."""
    return [t[:, slot].clone() for group in engine.cache.tensors for t in group.values()]


def _seq_kv(engine: object, seq: Sequence) -> list[torch.Tensor]:
    """The KV cache rows of `seq`'s computed tokens, every layer's tensors (keys, values, and
    an indexer's rows and its pooled keys of complete pools), gathered through its blocks."""
    kv = engine.kv_cache
    if kv is None:
        return []
    assert kv.groups.num_groups == 1
    table = engine.scheduler.block_manager.block_table(seq.seq_id)
    out = []
    for tensors in kv.layer_tensors:
        for t in tensors:  # (NB, R, ...): R rows of block_size / R tokens each
            per_row = kv.block_size // t.shape[1]
            rows = t[table].flatten(0, 1)
            out.append(rows[: seq.num_computed_tokens // per_row].clone())
    return out


def _unfused(runner: VllmRunner) -> None:
    """Switches off the fused Mamba decode layers of the runner's model (read when the layers'
    decode plans are made, so they are made again)."""
    model = runner.engine.model
    for module in model.modules():
        if isinstance(module, StateSpaceMixer):
            module.fused_decode = False
    assert not any(plan_decode(model)), "no Mamba layer may keep a fused plan"


def _states_by_length(
    runner: VllmRunner, prompt: list[int], max_tokens: int, with_kv: bool = False
) -> tuple[dict[int, list[torch.Tensor]], list[int]]:
    """Steps one request alone; after each step, its state (and with `with_kv` its KV rows,
    `_seq_kv`) keyed by computed tokens. Returns them and the request's tokens."""
    engine = runner.engine
    engine.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens)
    )
    states: dict[int, list[torch.Tensor]] = {}
    while engine.has_unfinished_requests():
        seq: Sequence = engine.scheduler.running[0].seqs[0] if engine.scheduler.running else None
        slot = seq.slot if seq is not None else None
        engine.step()
        seq = seq or engine.scheduler.running[0].seqs[0]
        kv = _seq_kv(engine, seq) if with_kv and engine.has_unfinished_requests() else []
        states[seq.num_computed_tokens] = _slot_state(engine, slot if slot is not None else 0) + kv
    return states, list(seq.output_token_ids)


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        ("tied", True),
        ("tied", False),
        ("mamba2-groups", True),
        ("mamba2-groups", False),
        ("qwen3_5-gqa", True),
        ("lfm2-gqa", True),
        ("kimi-linear-moe", True),
        ("ling-moe", True),  # single-stage KDA gates, the safe gate, gated MLA
        ("jamba-gqa", True),
        ("zaya-gqa", True),
        ("xlstm-dk16", True),
        ("recurrent-gemma-mqa", True),
        ("recurrent-gemma-gqa", True),
        ("inkling-gqa", True),
        ("inkling-mqa", True),
        ("inkling2-gqa", True),
        ("inkling2-mqa", True),
        ("inkling2-loop-gqa", True),
        ("lfm3-gqa", True),
        ("lara-mini-gqa", True),
        ("minimax-full-top2", True),
        ("minimax-window-top1", True),
        ("zamba-mha-tied", True),
        ("zamba2-lora-rope", True),
        ("glm5-next-moe", True),
        ("qwen4-exp-ple", True),  # the n-gram context with the state
        ("rwkv7-h64", True),  # the three states of the fused layer's chains
    ],
)
def test_state_after_rejections_is_bitwise_the_one_by_one_state(name: str, fused: bool) -> None:
    """After every speculative step, whatever was accepted, the sequence's state (and for the
    sparse-attention models `WITH_KV` the KV cache rows of its computed tokens, the indexer's
    rows and pooled keys included) equals bit for bit the state of decoding the accepted tokens
    one by one.

    With the fused Mamba / Mamba2 decode layers (the default) a chain runs through them in one
    call per layer, each row as a one-row call would; without them (`fused=False`, both
    engines) each op runs its one-token kernel wave by wave. Both engines run one thread: the
    thread governor would otherwise follow other processes' load, and a kernel's sums depend
    on how many threads split them."""
    path = tiny_model_dir(name)
    prompt = prompts()[3]["prompt_token_ids"]
    with_kv = name in WITH_KV
    with VllmRunner(path, max_num_seqs=2, threads=1) as plain:
        if not fused:
            _unfused(plain)
        want, plain_tokens = _states_by_length(plain, prompt, 16, with_kv)
    refs = {tuple(prompt): plain_tokens}  # the oracle's drafts: the lone greedy run's
    with VllmRunner(path, max_num_seqs=2, speculative_config=NGRAM, threads=1) as spec:
        if not fused:
            _unfused(spec)
        _oracle(spec, refs)
        got, spec_tokens = _states_by_length(spec, prompt, 16, with_kv)
        assert spec_tokens == plain_tokens
        assert spec.engine.spec_steps.counters.num_accepted_tokens > 0
    assert len(got) < len(want)  # some steps kept several tokens
    for length, state in got.items():
        assert all(torch.equal(a, b) for a, b in zip(state, want[length])), length


@pytest.mark.parametrize("name", ["tied", "qwen3_5-gqa"])
def test_chunked_prefill_forks_and_all_right_drafts(name: str) -> None:
    """Prefill chunks of 5 tokens beside speculating decodes, `n = 3` greedy forks (each
    child speculates in its own spare slots), and drafts that are all right."""
    path = tiny_model_dir(name)
    want = alone(path)
    with VllmRunner(path, max_num_batched_tokens=7, speculative_config=NGRAM) as runner:
        _oracle(runner, _refs(path), every=0)
        assert tokens(runner.generate(prompts(), GREEDY)) == want
        forks = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, n=3)
        outs = runner.generate(prompts()[:3], forks)
        assert [[c.token_ids for c in o.outputs] for o in outs] == [[w] * 3 for w in want[:3]]
        counters = runner.engine.spec_steps.counters
        assert counters.num_accepted_tokens == counters.num_draft_tokens > 0


def test_preemption_under_kv_pressure() -> None:
    """A hybrid with too few KV blocks: drafts are dropped first, then requests preempted and
    recomputed; the tokens stay those of each prompt alone and every block comes back."""
    path = tiny_model_dir("jamba-gqa")
    with VllmRunner(
        path, block_size=16, num_gpu_blocks_override=14, speculative_config=NGRAM
    ) as runner:
        _oracle(runner, _refs(path))
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(path)
        assert runner.engine.stats.preemptions > 0
        assert runner.engine.spec_steps.counters.num_accepted_tokens > 0


@pytest.mark.parametrize("name", ["tied", "bamba-gqa", "qwen3_5-gqa"])
def test_prefix_cache_hit_on_a_speculating_request(name: str) -> None:
    """A request that speculated saves its state at its end (after its rollback); the next
    turn hits that snapshot and gets the tokens it gets without any cache. On Qwen3.5 the
    fused GDN layers log their chains, and the rollback that `max_tokens` inside an accepted
    run makes (the engine's, after the worker's) replays the records."""
    path = tiny_model_dir(name)
    first = prompts()[4]["prompt_token_ids"]
    params = SamplingParams(temperature=0, max_tokens=12)
    with VllmRunner(path) as plain:
        out = plain.generate({"prompt_token_ids": first}, params)[0].outputs[0].token_ids
        turn = first + out + [11, 12]
        want = plain.generate({"prompt_token_ids": turn}, params)[0].outputs[0].token_ids
    with VllmRunner(path, enable_prefix_caching=True, speculative_config=NGRAM) as runner:
        _oracle(runner, {tuple(first): out, tuple(turn): want})
        got = runner.generate({"prompt_token_ids": first}, params)[0]
        assert got.outputs[0].token_ids == out
        hit = runner.generate({"prompt_token_ids": turn}, params)[0]
        assert hit.num_cached_tokens == len(first) + len(out) - 1
        assert hit.outputs[0].token_ids == want
        assert runner.engine.spec_steps.counters.num_accepted_tokens > 0


def test_stops_and_max_tokens_inside_an_accepted_run() -> None:
    """All-right drafts of 4: a stop string, a stop token and `max_tokens` that fall inside
    an accepted run end the output exactly where decoding one by one ends it."""
    path = tiny_model_dir("tied")
    prompt = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts()[2:6]]
    ref = alone(path)[2:6]
    cases = [
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[ref[0][5]]),
    ]
    with VllmRunner(path) as plain:
        text = plain.generate(prompt[1], GREEDY)[0].outputs[0].text
        cases.append(
            SamplingParams(temperature=0, max_tokens=20, stop=[text[len(text) // 2 :][:3]])
        )
        want = [plain.generate(prompt, p) for p in cases]
    with VllmRunner(path, speculative_config=NGRAM) as runner:
        _oracle(runner, _refs(path), every=0)
        for params, ref_outs in zip(cases, want):
            got = runner.generate(prompt, params)
            for g, r in zip(got, ref_outs):
                assert g.outputs[0].token_ids == r.outputs[0].token_ids
                assert g.outputs[0].text == r.outputs[0].text
                assert g.outputs[0].finish_reason == r.outputs[0].finish_reason


def test_logprobs_and_penalties_equal_no_speculation() -> None:
    """Greedy with a repetition penalty and logprobs: the same tokens, and each token's
    logprobs (scored at its chain position) those of decoding one by one."""
    path = tiny_model_dir("mamba2-groups")
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=3, repetition_penalty=1.3)
    with VllmRunner(path) as plain:
        want = plain.generate(prompts()[:4], params)
    refs = {tuple(p["prompt_token_ids"]): w.outputs[0].token_ids for p, w in zip(prompts(), want)}
    with VllmRunner(path, speculative_config=NGRAM) as runner:
        _oracle(runner, refs)
        got = runner.generate(prompts()[:4], params)
        assert runner.engine.spec_steps.counters.num_accepted_tokens > 0
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for g_lp, w_lp in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
            assert g_lp.keys() == w_lp.keys()
            for tid in g_lp:
                assert g_lp[tid].logprob == pytest.approx(w_lp[tid].logprob, abs=1e-5)


def test_structured_outputs_advance_over_accepted_tokens_only() -> None:
    """A regex grammar with drafts that are partly right (and some that the grammar
    forbids): the same output as without speculation, always matching the grammar."""
    path = tiny_model_dir("tied")
    so = StructuredOutputsParams(regex=r"[a-z]{3,12}( [a-z]{2,8}){2,4}")
    params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=so)
    ask = prompts()[:3]
    with VllmRunner(path) as plain:
        want = [o.outputs[0] for o in plain.generate(ask, params)]
    refs = {tuple(p["prompt_token_ids"]): w.token_ids for p, w in zip(ask, want)}
    with VllmRunner(path, speculative_config=NGRAM) as runner:
        _oracle(runner, refs)
        got = [o.outputs[0] for o in runner.generate(ask, params)]
        assert runner.engine.spec_steps.counters.num_accepted_tokens > 0
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.text for g in got] == [w.text for w in want]


def test_seeded_sampling_reproduces_and_mixes_with_plain_decodes() -> None:
    """Temperature 0.8 with seeds: two runs give the same samples; requests that do not
    speculate (no drafts) run in the same steps as those that do."""
    path = tiny_model_dir("qwen3_5-gqa")
    params = [SamplingParams(temperature=0.8, max_tokens=12, seed=s) for s in range(4)]
    refs = _refs(path)
    runs = []
    for _ in range(2):
        with VllmRunner(path, speculative_config=NGRAM) as runner:
            _oracle(runner, {k: v for i, (k, v) in enumerate(refs.items()) if i % 2})
            runs.append(tokens(runner.generate(prompts()[:4], params)))
            assert runner.engine.spec_steps.counters.num_drafts > 0
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0]}) == 4


@pytest.mark.parametrize(
    "name",  # on the worker of the family's own checks (`test_families`): one lone run each;
    # a family's first TP variant (its others shard the same state, checked without drafts)
    [
        pytest.param(f.tp[0], id=f.tp[0], marks=pytest.mark.xdist_group(f.name))
        for f in FAMILIES
        if f.tp
    ],
)
def test_tensor_parallel_speculation_equals_one_rank(name: str) -> None:
    """Every family's variants that split over 2 ranks (worker processes), with n-gram
    speculation's chains (drafts right and wrong): the same plain-data step on every rank runs
    the waves, spare-slot copies and rollbacks, and the greedy tokens equal one rank's
    without speculation."""
    path = tiny_model_dir(name)
    refs = _refs(path)
    with VllmRunner(
        path, device="cpu", tensor_parallel_size=2, max_num_seqs=8, speculative_config=NGRAM
    ) as two:
        _oracle(two, refs)
        got = tokens(two.generate(prompts(), GREEDY))
        counters = two.engine.spec_steps.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # both kinds
    assert got == alone(path)


def test_ngram_lookup_accepts_repeated_text() -> None:
    """The real n-gram proposer on a prompt the model continues by repeating it: drafts get
    accepted, and the tokens equal decoding without speculation."""
    path = tiny_model_dir("tied")
    rng = random.Random(0)
    with VllmRunner(path) as plain:
        base = [rng.randrange(100, 5000) for _ in range(12)]
        long_out = plain.generate({"prompt_token_ids": base}, GREEDY)[0].outputs[0].token_ids
        prompt = base + long_out + base
        want = plain.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
    with VllmRunner(path, speculative_config=spec) as runner:
        got = runner.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
        counters = runner.engine.spec_steps.counters
    assert got == want
    if want[: len(long_out)] == long_out:  # the model does repeat: lookup pays
        assert counters.num_accepted_tokens > 0
