"""Verification of draft tokens: greedy chains give exactly the tokens (and logprobs) of
`sample` called one position at a time; random chains emit tokens with exactly the target's
distribution; seeded chains reproduce; the grammar matcher is left as it was."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vllm_mamba.engine.structured_outputs import StructuredOutputs
from vllm_mamba.layers.sampler import SamplingRow, sample
from vllm_mamba.sampling_params import SamplingParams, StructuredOutputsParams
from vllm_mamba.spec_decode.rejection_sampler import Chain, rejection_sample

EOS = 0
STOP = 7
CHARS = 'abc{}":,0123456789 '
WORDS = ["ab", "abc", '"a"', "12"]
V = 32  # the tokenizer's 24 tokens, padded
REGEX = r"(ab|c)[0-9]{1,3}(a|b)+"


@pytest.fixture(scope="module")
def structured() -> Iterator[StructuredOutputs]:
    """`StructuredOutputs` on a 24-token word-level tokenizer (one token per character, a few
    longer ones)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"</s>": EOS}
    for tok in [*CHARS, *WORDS]:
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>")
    so = StructuredOutputs(hf, vocab_size=V, eos_token_id=EOS)
    so.ensure_compiler()
    yield so


def grammar_params(structured: StructuredOutputs, **kw: Any) -> SamplingParams:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX), **kw)
    structured.prepare(params)
    return params


def matcher_at(structured: StructuredOutputs, params: SamplingParams, prefix: list[int]) -> Any:
    m = structured.new_matcher(params)
    for t in prefix:
        assert m.accept_token(t)
    return m


def reference(
    logits: torch.Tensor, chain: Chain, matcher: Any, follow: bool = False
) -> tuple[list[int], list]:
    """`sample` one position at a time, the output extended by every token; stops at the
    first token that differs from its draft (unless `follow`: the greedy path), after k + 1
    tokens, or when the grammar ends. `matcher` is a copy of the chain's (advanced here)."""
    base = chain.row
    tokens: list[int] = []
    logprobs = []
    for i in range(len(chain.drafts) + 1):
        output = base.output_token_ids + tokens
        banned = base.banned_token_ids
        if len(output) < base.params.min_tokens:
            banned = banned + chain.min_tokens_banned
        row = SamplingRow(
            base.params, base.generator, base.prompt_token_ids, output, banned, matcher
        )
        r = chain.row_start + i
        out = sample(logits[r : r + 1], [row])
        t = out.token_ids[0]
        tokens.append(t)
        logprobs.append(
            (out.token_logprobs[0], out.token_ranks[0], out.topk_ids[0], out.topk_logprobs[0])
        )
        if matcher is not None:
            assert matcher.accept_token(t)
            if matcher.is_terminated():
                break
        if i == len(chain.drafts) or (t != chain.drafts[i] and not follow):
            break
    return tokens, logprobs


def state(matcher: Any) -> tuple:
    import xgrammar as xgr

    mask = xgr.allocate_token_bitmask(1, V)
    if not matcher.is_terminated():
        matcher.fill_next_token_bitmask(mask, 0)
    return mask.tolist(), matcher.is_terminated(), matcher.is_completed()


def make_drafts(path: list[int], k: int, kind: str, rng: random.Random) -> list[int]:
    """Drafts that all follow `path` (the greedy tokens), none, or a prefix of it."""
    j = {"all": k, "none": 0, "some": rng.randint(1, max(1, k - 1))}[kind]
    j = min(j, len(path), k)
    drafts = path[:j]
    while len(drafts) < k:
        t = rng.randrange(V)
        if len(drafts) == j and j < len(path) and t == path[j]:
            continue  # the first draft off the path must differ from it
        drafts.append(t)
    return drafts


def greedy_params(rng: random.Random, structured: StructuredOutputs, grammar: bool):
    kw: dict[str, Any] = {"temperature": 0.0, "max_tokens": 64, "logprobs": rng.choice([None, 3])}
    if rng.random() < 0.7:
        kw.update(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4)
    if rng.random() < 0.5:
        kw["logit_bias"] = {2: 2.5, 9: -3.0}
    if grammar:
        return grammar_params(structured, **kw)
    kw["min_tokens"] = rng.randint(0, 6)
    if rng.random() < 0.3:
        kw["allowed_token_ids"] = list(range(0, V, 2)) + [1, 3]
    params = SamplingParams(**kw)
    if rng.random() < 0.6:
        params.bad_words_token_ids = [[1, 2], [4], [3, 5, 6]]
    return params


@pytest.mark.parametrize("kind", ["all", "none", "some"])
def test_greedy_equals_sample_position_by_position(
    structured: StructuredOutputs, kind: str
) -> None:
    rng = random.Random({"all": 0, "none": 1, "some": 2}[kind])
    torch.manual_seed(rng.randrange(1000))
    for trial in range(12):
        chains, matchers = [], []
        row = 0
        logits_parts = []
        for b in range(5):
            k = rng.choice([0, 1, 3, 5]) if b else 4
            grammar = b % 2 == 1
            params = greedy_params(rng, structured, grammar)
            n_out = rng.randint(0, 4)
            lg = torch.randn(k + 1, V) * 3  # (k + 1, V)
            lg[:, [EOS, STOP, 2]] += 4.0  # makes min_tokens and the bad word [1, 2] matter
            logits_parts.append(lg)
            prefix = [rng.choice([20, 3]), 9 + rng.randrange(3)] if grammar else []
            output = prefix if grammar else [rng.randrange(V) for _ in range(n_out)]
            matcher = matcher_at(structured, params, prefix) if grammar else None
            base = SamplingRow(params, None, [5, 6, 1], output, [], matcher)
            mtb = [] if grammar else [EOS, STOP]
            # the greedy path, for drafts that follow it
            probe = Chain(row, [-1] * k, base, mtb)
            copy = matcher_at(structured, params, prefix) if grammar else None
            full = torch.cat(logits_parts)
            path, _ = reference(full, probe, copy, follow=True)
            chains.append(Chain(row, make_drafts(path, k, kind, rng), base, mtb))
            matchers.append(matcher_at(structured, params, prefix) if grammar else None)
            row += k + 1
        logits = torch.cat(logits_parts)  # (R, V)
        outs = rejection_sample(logits, chains)
        for chain, m, out in zip(chains, matchers, outs):
            tokens, logprobs = reference(logits, chain, m)
            assert out.token_ids == tokens, (trial, chain.drafts)
            matched = [t == d for t, d in zip(tokens, chain.drafts)]
            assert out.num_accepted == (matched + [False]).index(False)
            got = list(zip(out.token_logprobs, out.token_ranks, out.topk_ids, out.topk_logprobs))
            assert got == logprobs
            if kind == "all" and len(tokens) <= len(chain.drafts):
                assert chain.row.matcher is not None  # only a completed grammar stops early
            if chain.row.matcher is not None:
                # the chain's matcher was left where it was: equal to a fresh one at the prefix
                fresh = matcher_at(structured, chain.row.params, chain.row.output_token_ids)
                assert state(chain.row.matcher) == state(fresh)


def test_greedy_kinds_hit_their_cases() -> None:
    """All-matching drafts are all accepted (k + 1 tokens); a wrong first draft gives one."""
    torch.manual_seed(0)
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    logits = torch.randn(4, V)  # (k + 1, V)
    base = SamplingRow(params, None, [1], [2], [])
    path, _ = reference(logits, Chain(0, [-1] * 3, base), None, follow=True)
    assert len(path) == 4
    out = rejection_sample(logits, [Chain(0, path[:3], base)])[0]
    assert out.num_accepted == 3 and out.token_ids == path
    wrong = [(path[0] + 1) % V, *path[1:3]]
    out = rejection_sample(logits, [Chain(0, wrong, base)])[0]
    assert out.num_accepted == 0 and out.token_ids == path[:1]
    out = rejection_sample(logits, [Chain(0, [path[0], wrong[0], path[2]], base)])[0]
    assert out.num_accepted == 1 and out.token_ids == path[:2]


def test_matcher_unchanged_and_terminating_draft_ends_the_chain(
    structured: StructuredOutputs,
) -> None:
    """Drafts that complete the grammar ("ab", "1", "a", EOS) end the chain on EOS; a draft the
    grammar forbids is rejected; the matcher is where it was, in both cases."""
    params = grammar_params(structured, temperature=0.0)
    ids = {"ab": 20, "1": 10, "a": 1, "b": 2}
    drafts = [ids["ab"], ids["1"], ids["a"], EOS, ids["b"]]
    logits = torch.full((len(drafts) + 1, V), -5.0)
    for i, d in enumerate(drafts):
        logits[i, d] = 5.0
    m = structured.new_matcher(params)
    base = SamplingRow(params, None, [3], [], [], m)
    before = state(m)
    out = rejection_sample(logits, [Chain(0, drafts, base)])[0]
    assert out.token_ids == drafts[:4] and out.num_accepted == 4
    assert state(m) == before
    fresh = structured.new_matcher(params)
    for t in out.token_ids:
        assert m.accept_token(t) and fresh.accept_token(t)
    assert m.is_terminated() and fresh.is_terminated()

    m = structured.new_matcher(params)
    bad = [ids["ab"], ids["a"], ids["1"]]  # "a" cannot follow "ab" (a digit must)
    logits = torch.full((4, V), -5.0)
    logits[:, ids["a"]] = 5.0  # the model wants "a" everywhere; the grammar forbids it at 1
    logits[0, ids["ab"]] = 6.0
    logits[1, ids["1"] + 2] = 4.0  # the best digit: "3"
    out = rejection_sample(logits, [Chain(0, bad, SamplingRow(params, None, [3], [], [], m))])[0]
    assert out.token_ids == [ids["ab"], ids["1"] + 2] and out.num_accepted == 1
    assert state(m) == state(structured.new_matcher(params))
    # random rows with a grammar: every emitted token is allowed, the matcher is unchanged
    params = grammar_params(structured, temperature=1.0)
    for seed in range(20):
        m = matcher_at(structured, params, [ids["ab"]])
        gen = torch.Generator().manual_seed(seed)
        row = SamplingRow(params, gen, [3], [ids["ab"]], [], m)
        out = rejection_sample(torch.randn(4, V), [Chain(0, [ids["1"], ids["a"], EOS], row)])[0]
        assert state(m) == state(matcher_at(structured, params, [ids["ab"]]))
        for t in out.token_ids:
            assert m.accept_token(t)


# --- random rows: the emitted distribution is the target's -----------------------------------

L0 = [2.0, 1.0, 0.5, 0.0, -1.0, -3.0]
L1 = [0.0, 1.5, -0.5, 1.0, 0.3, -2.0]
L2 = [0.5, 0.0, 0.0, 2.0, 0.0, 0.0]
TEMP, TOP_P, PRESENCE = 0.8, 0.9, 0.5
D0, D1 = 0, 3


def target(logits: list[float], penalised: list[int]) -> list[float]:
    """The exact target distribution: presence penalty, temperature, then top-p."""
    lg = [x - (PRESENCE if i in penalised else 0.0) for i, x in enumerate(logits)]
    w = [math.exp(x / TEMP) for x in lg]
    p = [x / sum(w) for x in w]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep, cum = set(), 0.0
    for i in order:
        if cum <= TOP_P or not keep:
            keep.add(i)
        cum += p[i]
    z = sum(p[i] for i in keep)
    return [p[i] / z if i in keep else 0.0 for i in range(len(p))]


def tv_bound(n: int, vocab: int, fail: float = 1e-5) -> float:
    """A total-variation bound that n draws exceed with probability < `fail`:
    E[TV] <= sqrt((vocab - 1) / n) / 2 (Cauchy-Schwarz) and McDiarmid (one draw moves TV by
    at most 1 / n): P(TV >= E + t) <= exp(-2 n t^2)."""
    return 0.5 * math.sqrt((vocab - 1) / n) + math.sqrt(math.log(1 / fail) / (2 * n))


def tv(counts: list[int], p: list[float]) -> float:
    n = sum(counts)
    return 0.5 * sum(abs(c / n - q) for c, q in zip(counts, p))


def random_chains(seeds: range, params: SamplingParams) -> tuple[torch.Tensor, list[Chain]]:
    logits = torch.tensor([L0, L1, L2]).repeat(len(seeds), 1)  # (3 B, 6)
    chains = [
        Chain(
            3 * b,
            [D0, D1],
            SamplingRow(params, torch.Generator().manual_seed(s), [1, 2], [], []),
        )
        for b, s in enumerate(seeds)
    ]
    return logits, chains


def test_random_rows_emit_the_target_distribution() -> None:
    params = SamplingParams(temperature=TEMP, top_p=TOP_P, presence_penalty=PRESENCE)
    n = 20_000
    logits, chains = random_chains(range(n), params)
    outs = rejection_sample(logits, chains)
    vocab = len(L0)
    first = [0] * vocab
    second = [0] * vocab
    for out in outs:
        assert 1 <= len(out.token_ids) <= 3
        assert out.num_accepted == len(out.token_ids) - 1
        assert out.token_ids[: out.num_accepted] == [D0, D1][: out.num_accepted]
        first[out.token_ids[0]] += 1
        if out.num_accepted >= 1:
            second[out.token_ids[1]] += 1
    p0 = target(L0, [])
    p1 = target(L1, [D0])  # the presence penalty counts the accepted draft
    assert [i for i, q in enumerate(p0) if q == 0] == [3, 4, 5]  # top-p drops some
    assert all(first[i] == 0 for i in (3, 4, 5))
    assert tv(first, p0) < tv_bound(n, vocab)
    n1 = sum(second)
    assert abs(n1 / n - p0[D0]) < 4 * math.sqrt(p0[D0] * (1 - p0[D0]) / n)  # acceptance rate
    assert tv(second, p1) < tv_bound(n1, vocab)


def test_seeded_chains_reproduce_whatever_the_batch() -> None:
    params = SamplingParams(temperature=1.0, seed=3)
    logits, chains = random_chains(range(50), params)
    a = [o.token_ids for o in rejection_sample(logits, chains)]
    logits, chains = random_chains(range(50), params)
    b = [o.token_ids for o in rejection_sample(logits, chains)]
    assert a == b
    assert len({tuple(t) for t in a}) > 5  # different seeds, different outputs
    # alone, or behind a greedy chain, a seeded chain gives the same tokens
    logits, chains = random_chains(range(7, 8), params)
    solo = rejection_sample(logits, chains)[0].token_ids
    logits, chains = random_chains(range(7, 8), params)
    greedy = Chain(0, [1], SamplingRow(SamplingParams(temperature=0.0), None, [1], [], []))
    shifted = Chain(2, chains[0].drafts, chains[0].row)
    both = rejection_sample(torch.cat([torch.randn(2, 6), logits]), [greedy, shifted])
    assert both[1].token_ids == solo == a[7]


def test_raw_logits_path_equals_the_copying_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains without penalties, constraints or a grammar read the raw logits in place (no
    copy of the positions' rows): greedy chains give `sample`'s tokens position by position,
    and a batch of greedy, seeded random and top-k chains gives exactly what the copying path
    gives (forced here), also where the logits hold rows no position reads."""
    from vllm_mamba.spec_decode import rejection_sampler

    rng = random.Random(5)
    torch.manual_seed(5)

    def batch() -> tuple[torch.Tensor, list[Chain]]:
        logits = torch.randn(22, V) * 3  # 21 chain rows and one no position reads
        chains, row = [], 0
        for b in range(6):
            k = [4, 0, 2, 5, 1, 3][b]
            params = [
                SamplingParams(temperature=0.0, logprobs=rng.choice([None, 2])),
                SamplingParams(temperature=0.9, seed=11 + b),
                SamplingParams(temperature=0.7, top_k=5, seed=b),
            ][b % 3]
            gen = torch.Generator().manual_seed(100 + b) if params.seed is not None else None
            sr = SamplingRow(params, gen, [1, 2], [rng.randrange(V) for _ in range(3)], [])
            drafts = [rng.randrange(V) for _ in range(k)]
            if params.greedy:  # the first half of the drafts on the greedy path
                for i in range(k // 2):
                    drafts[i] = int(logits[row + i].argmax())
            chains.append(Chain(row, drafts, sr))
            row += k + 1 + (b == 2)  # chain 2 leaves a row no position reads
        assert row == logits.shape[0]
        return logits, chains

    rng_state, torch_state = rng.getstate(), torch.get_rng_state()
    logits, chains = batch()
    fast = rejection_sample(logits, chains)
    for chain, out in zip(chains, fast):
        if chain.row.params.greedy:
            tokens, logprobs = reference(logits, chain, None)
            assert out.token_ids == tokens
            got = list(zip(out.token_logprobs, out.token_ranks, out.topk_ids, out.topk_logprobs))
            assert got == logprobs
    rng.setstate(rng_state)
    torch.set_rng_state(torch_state)
    logits2, chains2 = batch()
    assert torch.equal(logits, logits2)
    monkeypatch.setattr(rejection_sampler, "_modifies_logits", lambda *args: True)
    slow = rejection_sample(logits2, chains2)
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    assert [o.num_accepted for o in fast] == [o.num_accepted for o in slow]
    assert any(o.num_accepted for o in fast)  # some draft was accepted somewhere
