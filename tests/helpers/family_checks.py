"""The checks every model family is held to (`tests/models/test_families.py` runs them).

Against independent references: transformers (greedy tokens equal with varied references,
logprobs close; teacher-forced, `assert_matches_transformers`), each prompt run alone
(batched, queued, chunked prefill, KV pressure with preemption, forks), seeded lone
requests (forked samples), the same engine with the prefix cache off, and one rank (tensor
parallelism). Every engine is a `VllmRunner`, whose block checks on exit that no request is
left and every state slot and KV block is free. The references are computed once per
checkpoint and session (`hf_reference`, `alone`).
"""

from __future__ import annotations

import functools
import glob
import os
import random

import pytest
import torch

from tests.helpers.prompts import MAX_TOKENS, make_prompts
from tests.helpers.runners import HfRunner, VllmRunner
from tests.helpers.rwkv_checkpoints import RwkvPackageRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.tiny_models import MODEL_FAMILY, hf_class, tiny_model_dir
from vllm_mamba import RequestOutput, SamplingParams
from vllm_mamba.engine.spec_steps import NgramDrafts

GREEDY = SamplingParams(temperature=0, max_tokens=16)
LOGPROB_ATOL = 1e-4  # float32 rounding of two implementations of the same sums
TP_ATOL = 1e-3  # sums split over ranks and all-reduced, and chunked against whole prefill


def prompts() -> list[dict]:
    """`make_prompts()` (1 to 131 tokens) as `LLM.generate` inputs."""
    return [{"prompt_token_ids": p} for p in make_prompts()]


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    """The token ids of each request's first completion."""
    return [o.outputs[0].token_ids for o in outs]


@functools.cache
def hf_reference(name: str) -> list[tuple[list[int], torch.Tensor]]:
    """Greedy tokens and per-step log-softmax `(steps, V)` from transformers (RWKV-7: the
    `rwkv` package on the `.pth` twin), prompt by prompt."""
    if MODEL_FAMILY[name].reference_impl == "rwkv":
        pth = glob.glob(os.path.join(tiny_model_dir(name, "pth"), "*.pth"))[0]
        runner = RwkvPackageRunner(pth)
        return [runner.greedy_logprobs(p, MAX_TOKENS) for p in make_prompts()]
    runner = HfRunner(tiny_model_dir(name), hf_class(name))
    return runner.generate_greedy_logprobs(make_prompts(), MAX_TOKENS)


def assert_matches_transformers(name: str) -> None:
    """Greedy tokens equal, top-5 logprobs within `LOGPROB_ATOL`, the sampled token ranked
    first, references varied.

    The reference is teacher-forced: one transformers forward over each prompt and the
    engine's tokens (but the last) gives its greedy choice and log-softmax at every generated
    position. Greedy decoding by transformers gives the engine's tokens exactly when its choice
    at every position, given the tokens before, is the engine's token, so comparing the
    choices compares the greedy tokens, at a fraction of the cost of `generate`'s
    token-by-token loop. transformers' two paths (the whole-sequence forward and `generate`'s
    cached steps) round differently, which a near-tie in an MoE router can turn into logprobs
    1e-3 apart: a prompt that misses the forward's reference is held to `generate`'s, as the
    engine decodes step by step too. RWKV-7's reference (the `rwkv` package) is its own greedy
    loop (`hf_reference`).
    """
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=5)
    with VllmRunner(tiny_model_dir(name)) as runner:
        outs = runner.generate(prompts(), params)
    generated = tokens(outs)
    # A model that repeats itself proves nothing: the generations must be varied.
    assert all(len(set(t)) >= MAX_TOKENS // 2 for t in generated), generated
    assert len({tuple(t) for t in generated}) == len(generated)
    if MODEL_FAMILY[name].reference_impl == "rwkv":
        for out, (want, ref_lp) in zip(outs, hf_reference(name)):
            _assert_matches_reference(out, want, ref_lp)
        return
    hf = HfRunner(tiny_model_dir(name), hf_class(name))
    for prompt, out in zip(make_prompts(), outs):
        own = out.outputs[0].token_ids
        lp = hf.logprobs(prompt + own[:-1])[len(prompt) - 1 :]  # (steps, V)
        try:
            _assert_matches_reference(out, lp.argmax(-1).tolist(), lp)
        except AssertionError:
            _assert_matches_reference(out, *hf.generate_greedy_logprobs([prompt], MAX_TOKENS)[0])


def _assert_matches_reference(out: RequestOutput, want: list[int], ref_lp: torch.Tensor) -> None:
    """One request's greedy tokens `want` and top-5 logprobs against the reference's
    log-softmax `ref_lp (steps, V)`."""
    got = out.outputs[0]
    assert got.token_ids == want
    assert got.finish_reason == "length"
    assert len(got.logprobs) == len(want)
    for step, entry in enumerate(got.logprobs):
        top = sorted(entry.items(), key=lambda kv: -kv[1].logprob)[:5]
        ref_top = ref_lp[step].topk(5)
        # The same ranking as the reference, except that tokens whose reference logprobs
        # tie within LOGPROB_ATOL may swap (float32 rounding differs by ISA level: a
        # 3e-6 tie swapped places 4 and 5 at avx2): the engine's i-th token has the
        # reference's i-th best logprob.
        for i, (t, _) in enumerate(top):
            assert abs(ref_lp[step][t].item() - ref_top.values[i].item()) <= LOGPROB_ATOL
        assert entry[got.token_ids[step]].rank == 1
        torch.testing.assert_close(
            torch.tensor([lp.logprob for _, lp in top]),
            ref_top.values,
            rtol=0,
            atol=LOGPROB_ATOL,
        )


@functools.cache
def alone(path: str) -> list[list[int]]:
    """Each prompt run by itself, 16 greedy tokens."""
    with VllmRunner(path) as runner:
        return [tokens(runner.generate(p, GREEDY))[0] for p in prompts()]


def assert_batched_equals_alone(path: str) -> None:
    """All prompts in one batch, then queued through two slots."""
    with VllmRunner(path) as runner:
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(path)
    with VllmRunner(path, max_num_seqs=2) as runner:
        assert tokens(runner.generate(prompts(), GREEDY)) == alone(path)


def assert_speculation_equals_alone(path: str) -> None:
    """Greedy decoding with speculation gives each prompt's tokens alone: drafts that are
    partly right (`OracleProposer`: accepted runs and rejections at every position, so the
    states are rolled back all the time), then the real n-gram lookup, then draft models:
    the model itself (every draft accepted) and a tiny Mamba (or Mamba2; most rejected)."""
    want = alone(path)
    refs = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts(), want)}
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    with VllmRunner(path, speculative_config=spec) as runner:
        oracle = OracleProposer(refs)
        runner.engine.spec_steps.proposer = oracle
        assert tokens(runner.generate(prompts(), GREEDY)) == want
        counters = runner.engine.spec_steps.counters
        assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens
        assert oracle.finished == len(want)
        config = runner.engine.config
        runner.engine.spec_steps.proposer = NgramDrafts(
            config.speculative_config, config.model_config.max_model_len
        )
        assert tokens(runner.generate(prompts(), GREEDY)) == want
    other = tiny_model_dir("mamba2-groups" if path == tiny_model_dir("tied") else "tied")
    for draft, all_accepted in ((path, True), (other, False)):
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
        with VllmRunner(path, speculative_config=spec) as runner:
            assert tokens(runner.generate(prompts()[:5], GREEDY)) == want[:5]
            counters = runner.engine.spec_steps.counters
            assert (counters.num_accepted_tokens == counters.num_draft_tokens) == all_accepted
            assert runner.engine.spec_steps.proposer.slots.num_used == 0


def assert_chunked_equals_whole(path: str, budget: int) -> None:
    """Prefills cut into chunks of at most `budget` tokens (several sequences per step). At a
    budget of one token (every chunk a decode-sized step) the prompts of 5 to 31 tokens,
    longer than every tiny model's window; else those of 5 to 131."""
    chosen = slice(2, 5) if budget == 1 else slice(2, 8)
    with VllmRunner(path, max_num_batched_tokens=budget) as runner:
        assert tokens(runner.generate(prompts()[chosen], GREEDY)) == alone(path)[chosen]


def assert_kv_pressure_equals_no_pressure(path: str, blocks: int = 14) -> None:
    """8 prompts of 1..131 tokens + 16 generated need 34 blocks of 16; `blocks` forces
    preemptions (counted, and reported by the stats snapshot), and the outputs stay those of
    each prompt alone."""
    with VllmRunner(path, block_size=16, num_gpu_blocks_override=blocks) as runner:
        outs = runner.generate(prompts(), GREEDY)
        engine = runner.engine
        assert engine.stats.preemptions > 0
        assert engine.stats_snapshot().preemptions == engine.stats.preemptions
        assert engine.stats_snapshot().kv_blocks_total == blocks
        assert engine.scheduler.block_manager.num_free_blocks == blocks
    assert tokens(outs) == alone(path)


def assert_forks_and_chunks_under_pressure(path: str, blocks: int = 30) -> None:
    """Seeded forked requests under KV pressure (`blocks` of 16) and chunked prefill equal a
    free run."""
    params = [SamplingParams(temperature=1.0, max_tokens=12, n=1 + i % 3, seed=i) for i in range(8)]
    with VllmRunner(path, max_num_seqs=16) as runner:
        free = runner.generate(prompts(), params)
    with VllmRunner(
        path, max_num_seqs=16, num_gpu_blocks_override=blocks, max_num_batched_tokens=40
    ) as runner:
        tight = runner.generate(prompts(), params)
        assert runner.engine.stats.preemptions > 0
    assert [[o.token_ids for o in r.outputs] for r in tight] == [
        [o.token_ids for o in r.outputs] for r in free
    ]


def assert_forks_equal_alone(path: str) -> None:
    """Greedy `n = 3` gives three copies of the lone run; a seeded `n = 3` request (top-p)
    gives the same samples alone and beside other requests, and its samples differ."""
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, n=3, seed=3)
    with VllmRunner(path, max_num_seqs=4) as runner:
        greedy_forks = SamplingParams(temperature=0, max_tokens=GREEDY.max_tokens, n=3)
        out = runner.generate(prompts()[5], greedy_forks)[0]
        first = runner.generate(prompts()[3], sampled)[0]
        again = runner.generate([prompts()[0], prompts()[3]], [GREEDY, sampled])[1]
    assert [o.token_ids for o in out.outputs] == [alone(path)[5]] * 3
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in first.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def assert_forks_equal_independent_seeded_runs(path: str) -> None:
    """Sample `i` of a seeded `n = 3` request equals a lone request seeded `seed + 7919 * i`:
    the forks' copied state slots (and shared and copied KV blocks) hold the right values."""
    prompt = prompts()[6]  # 100 tokens: 6 full blocks and a partial one
    forked = SamplingParams(temperature=1.0, max_tokens=16, n=3, seed=11)
    with VllmRunner(path, max_num_seqs=4) as runner:
        out = runner.generate(prompt, forked)[0]
        lone = [
            runner.generate(prompt, SamplingParams(temperature=1.0, max_tokens=16, seed=s))[0]
            for s in (11, 11 + 7919, 11 + 2 * 7919)
        ]
    assert [o.token_ids for o in out.outputs] == [lo.outputs[0].token_ids for lo in lone]
    assert len({tuple(o.token_ids) for o in out.outputs}) == 3


def _assert_same_top(ea: dict, eb: dict, atol: float) -> None:
    """Two positions' logprob sets (the top k, and the sampled or prompt token): the tokens of
    both within `atol`, and each token of one set only swapped with one of the other set only
    whose logprob is within `atol` of it. Two candidates that near-tie at the k-th place may
    swap between two runs whose sums round apart (seen: two tokens at -7.637137 on an AVX2
    CPU, one rank against two)."""
    for t in ea.keys() & eb.keys():
        assert ea[t].logprob == pytest.approx(eb[t].logprob, abs=atol)
    only_a, only_b = ea.keys() - eb.keys(), eb.keys() - ea.keys()
    assert len(only_a) == len(only_b), (only_a, only_b)
    for own, other, partners in ((ea, eb, only_b), (eb, ea, only_a)):
        for t in own.keys() - other.keys():
            near = [u for u in partners if abs(other[u].logprob - own[t].logprob) <= atol]
            assert near, (t, own[t].logprob, {u: other[u].logprob for u in partners})


def _assert_close_outputs(got: RequestOutput, ref: RequestOutput, atol: float) -> None:
    """Same tokens, same top-k token sets (up to near-ties at the k-th place) and logprobs
    within `atol` (sampled and prompt)."""
    a, b = got.outputs[0], ref.outputs[0]
    assert a.token_ids == b.token_ids
    for ea, eb in zip(a.logprobs, b.logprobs):
        _assert_same_top(ea, eb, atol)
    for ea, eb in zip((got.prompt_logprobs or [])[1:], (ref.prompt_logprobs or [])[1:]):
        _assert_same_top(ea, eb, atol)


def assert_prefix_cache_on_equals_off(path: str) -> None:
    """Four prompts sharing a 37-token system prompt (an unaligned length), two one by one and
    two in one batch, then the first one's next chat turn: with the cache on, the batch reuses
    the system prompt and the turn everything but its 3 new tokens (the last generated one and
    two more); outputs equal those with the cache off."""
    rng = random.Random(5)
    system = _random_ids(rng, 37)
    asks = [system + _random_ids(rng, 3 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2)
    engine = dict(max_num_batched_tokens=48, block_size=16, prefix_snapshot_interval=32)

    def run(runner: VllmRunner) -> tuple[list[RequestOutput], RequestOutput]:
        alone = [runner.generate({"prompt_token_ids": p}, params)[0] for p in asks[:2]]
        batch = runner.generate([{"prompt_token_ids": p} for p in asks[2:]], params)
        turn = asks[0] + alone[0].outputs[0].token_ids + [11, 12]
        return [*alone, *batch], runner.generate({"prompt_token_ids": turn}, params)[0]

    with VllmRunner(path, **engine) as off:
        ref, ref_turn = run(off)
    with VllmRunner(path, enable_prefix_caching=True, **engine) as on:
        got, got_turn = run(on)
        assert on.engine.stats_snapshot().prefix_cache_hits > 0
    for g_out, r_out in zip([*got, got_turn], [*ref, ref_turn]):
        _assert_close_outputs(g_out, r_out, LOGPROB_ATOL)
    assert [g.num_cached_tokens for g in got[2:]] == [37, 37]
    assert got_turn.num_cached_tokens == len(asks[0]) + len(ref[0].outputs[0].token_ids) - 1


def _random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 50000) for _ in range(n)]


def assert_tensor_parallel_equals_one_rank(path: str, quantization: str | None = None) -> None:
    """2 ranks (worker processes, gloo) with chunked prefill (16-token budget) against one
    rank with whole prefills, prefix caching on in both: the same greedy tokens, the same
    samples of seeded forks, logprobs (sampled and prompt) within `TP_ATOL`, and a second
    turn that hits the first one's snapshot (copied on every rank) still matches."""
    kwargs = dict(device="cpu", max_num_seqs=8, enable_prefix_caching=True)
    short = [{"prompt_token_ids": p} for p in make_prompts()[1:5]]  # 2 to 31 tokens
    greedy = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2)
    forks = SamplingParams(n=3, temperature=0.8, max_tokens=6, seed=7)
    first = make_prompts()[5]  # 100 tokens: its end is snapshotted on every rank
    hit = SamplingParams(temperature=0, max_tokens=4, logprobs=1)
    turn = [{"prompt_token_ids": first + [11, 12, 13]}]
    with (
        VllmRunner(path, quantization=quantization, **kwargs) as one,
        VllmRunner(
            path,
            quantization=quantization,
            max_num_batched_tokens=16,
            tensor_parallel_size=2,
            **kwargs,
        ) as two,
    ):
        runs = []
        for runner in (one, two):
            outs = runner.generate(short, greedy)
            sampled = runner.generate(short[:3], forks)
            runner.generate([{"prompt_token_ids": first}], hit)
            runs.append((outs, sampled, runner.generate(turn, hit)[0]))
    (ref, ref_forks, ref_turn), (got, got_forks, got_turn) = runs
    assert len({tuple(o.outputs[0].token_ids) for o in ref}) == len(ref)  # varied outputs
    for g_out, r_out in zip([*got, got_turn], [*ref, ref_turn]):
        _assert_close_outputs(g_out, r_out, TP_ATOL)
    for r, g in zip(ref_forks, got_forks):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in r.outputs]
        for rc, gc in zip(r.outputs, g.outputs):
            assert gc.cumulative_logprob == pytest.approx(rc.cumulative_logprob, abs=TP_ATOL)
    assert got_turn.num_cached_tokens == ref_turn.num_cached_tokens > 0


def assert_gpu_graphs_equal_eager_and_cpu(path: str, dtype: str) -> None:
    """On CUDA: decode through CUDA graphs equals eager; float32 matches the CPU tokens."""
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=3)
    with (
        VllmRunner(path, dtype=dtype, max_num_seqs=16, device="cuda") as graph_runner,
        VllmRunner(path, dtype=dtype, max_num_seqs=16, device="cuda", enforce_eager=True) as eager,
    ):
        assert graph_runner.engine.executor.runner.cuda_graphs is not None
        graph = tokens(graph_runner.generate(prompts()[:5], params))
        assert graph == tokens(eager.generate(prompts()[:5], params))
    if dtype == "float32":
        with VllmRunner(path, max_num_seqs=16, device="cpu") as cpu_runner:
            cpu = tokens(cpu_runner.generate(prompts()[:5], params))
        same = sum(g == c for g, c in zip(graph, cpu))
        assert same >= 4  # GPU float32 matmuls may flip one near-tie


@functools.cache
def teacher_forced(path: str, **engine: str) -> tuple[list[int], torch.Tensor]:
    """Top-1 token and the logprob of the sequence's own token at every position of two
    random sequences (9 and 50 tokens), from an engine on `path` with `engine`'s options (the
    precision checks compare a quantised or bfloat16 run with the float one)."""
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(2, 50000, (n,), generator=g).tolist() for n in (9, 50)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    with VllmRunner(path, max_num_seqs=4, **engine) as runner:
        outs = runner.generate([{"prompt_token_ids": s} for s in seqs], params)
    top1, own = [], []
    for seq, out in zip(seqs, outs):
        for pos in range(1, len(seq)):
            entry = out.prompt_logprobs[pos]
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
            own.append(entry[seq[pos]].logprob)
    return top1, torch.tensor(own, dtype=torch.float64)
