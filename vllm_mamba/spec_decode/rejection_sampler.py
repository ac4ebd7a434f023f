"""Verification of deterministic draft tokens (n-gram, greedy draft model, MTP argmax).

One step scores, for every sequence (a *chain*), its k draft tokens at once: row i of the
chain's k + 1 rows of logits scores the token that follows the step's first token and
`drafts[:i]`. Position i is sampled from exactly the distribution `sampler.sample` would use
had the sequence already generated `drafts[:i]`: penalties counting `output + drafts[:i]`,
logit bias, allowed ids, bad words against `output + drafts[:i]`, banned tokens (with the
EOS/stop tokens banned while `len(output) + i < min_tokens`), the grammar's bitmask after the
matcher accepted `drafts[:i]`, then temperature / top-k / top-p / min-p for random rows.

The draft distribution q is one-hot, so the rejection sampling of speculative decoding
reduces to:

- greedy rows: `y_i = argmax p_i`; `drafts[i]` is accepted iff it equals `y_i`; the output is
  the accepted drafts followed by the first mismatching `y_i` (or the bonus `y_k`), exactly the
  tokens `sample` gives one position at a time;
- random rows: `drafts[i]` is accepted with probability `p_i(drafts[i])` (a uniform from the
  row's generator: the request's seeded one when it has a seed); the first rejection emits a
  token from `p_i` without `drafts[i]`, renormalised (the residual `max(p - q, 0)`); when all
  are accepted a bonus token is drawn from `p_k`. Tokens are drawn by the sampler's
  exponential race, so every emitted token has exactly the target's distribution.

Per random chain the generator gives, in order, one uniform per checked draft
(`torch.rand(n)`) then the V exponentials of one race, so seeded runs reproduce.

Grammar: the matcher is advanced tentatively over the drafts it accepts (`accept_token`,
after checking the draft's bit in the mask just filled) and rolled back to where it was
(`rollback(n)`; xgrammar >= 0.2 rolls back without limit, `max_rollback_tokens` is
deprecated). A draft the grammar forbids is rejected at its position, and the token there is
drawn from `p_i` (which gives that draft probability 0). A draft after which the matcher
terminates (the grammar is complete and accepted the stop token) ends the chain: when it is
accepted no further token is emitted.

Log-probabilities are those of `SamplerOutput`: the raw log-softmax of each emitted
position's logits, its rank and the top-k when `params.logprobs` is set.

Glossary: R rows of logits, V vocabulary, k drafts of one chain, P verified positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_mamba.layers.sampler import (
    SamplerOutput,
    SamplingRow,
    _add_logprobs,
    _filter,
    _sample,
    apply_constraints,
    apply_penalties,
    argmax_rows,
)


@dataclass
class Chain:
    """One sequence's drafts of this step.

    Attributes:
        row_start: the first of the chain's `len(drafts) + 1` consecutive rows of `logits`.
        drafts: the draft tokens (may be empty: then the chain is an ordinary sample).
        row: the sequence as `sample` would see it before this step's tokens:
            `output_token_ids` is everything generated so far, `banned_token_ids` the tokens
            banned at every position, `matcher` the grammar matcher (left unchanged).
        min_tokens_banned: tokens banned at position i only while
            `row.num_output_tokens + i < row.params.min_tokens` (EOS and stop tokens,
            when the sequence has no grammar), so a draft may cross `min_tokens`.
        grammar: the chain's grammar plan made beforehand from its matcher (`grammar_plan`,
            where the matcher lives: the engine); None: made here from `row.matcher`.
    """

    row_start: int
    drafts: list[int]
    row: SamplingRow
    min_tokens_banned: list[int] = field(default_factory=list)
    grammar: GrammarPlan | None = None


@dataclass
class ChainOutput(SamplerOutput):
    """The emitted tokens of one chain (1 to k + 1; entry j is the token at position j, to
    append in order) with their logprobs as in `SamplerOutput`, and `num_accepted`, how many
    drafts were accepted (the tokens before the last are always accepted drafts; the last is
    a draft only when the chain ended on a draft the grammar terminates with)."""

    num_accepted: int = 0


@dataclass
class GrammarPlan:
    """Which positions of a chain are verified: drafts `[:n_check]` are checked at rows
    `row_start + i`; when `final`, one more position samples the token after them; with a
    grammar, each verified position's token bitmask."""

    n_check: int
    final: bool
    bitmask: torch.Tensor | None = None  # (n_pos, ceil(V / 32)) grammar masks

    @property
    def n_pos(self) -> int:
        return self.n_check + int(self.final)


def rejection_sample(logits: torch.Tensor, chains: list[Chain]) -> list[ChainOutput]:
    """Verifies every chain's drafts against the target logits.

    Args:
        logits: `(R, V)` float32 raw target logits; chain b owns rows
            `row_start .. row_start + len(drafts)`.
        chains: the step's sequences.

    Returns:
        One `ChainOutput` per chain.
    """
    vocab = logits.shape[1]
    plans = [_plan(c, vocab) for c in chains]
    rows: list[SamplingRow] = []  # one per verified position, as `sample` would see it
    pos_rows: list[int] = []  # the logits row of each position
    starts: list[int] = []  # first position of each chain
    for chain, plan in zip(chains, plans):
        starts.append(len(rows))
        assert chain.row_start + len(chain.drafts) < logits.shape[0], "chain rows out of range"
        for i in range(plan.n_pos):
            rows.append(_position_row(chain, i))
            pos_rows.append(chain.row_start + i)
    constrained = [
        i for i, r in enumerate(rows) if r.params.needs_logit_masks or r.banned_token_ids
    ]
    if _modifies_logits(rows, plans, constrained):
        index = torch.tensor(pos_rows, dtype=torch.long, device=logits.device)
        work = logits[index]  # (P, V), a copy
        apply_penalties(work, rows)
        if constrained:
            apply_constraints(work, rows, constrained)
        _apply_grammar(work, plans, starts)
        work_row = list(range(len(rows)))  # position -> its row of `work`
    else:  # the raw logits are every position's: read in place (no copy of P x V)
        work, work_row = logits, pos_rows
    if work_row == list(range(work.shape[0])):
        greedy = argmax_rows(work).tolist()  # (P,)
    else:
        greedy = argmax_rows(work[torch.tensor(work_row, device=logits.device)]).tolist()
    random_pos = [i for i, r in enumerate(rows) if not r.params.greedy]
    filtered = work[:0]
    p_draft: list[float] = []  # per position: p_i(drafts[i]) of the random chains
    slot = [-1] * len(rows)  # position -> its row of `filtered`
    if random_pos:
        idx = torch.tensor([work_row[i] for i in random_pos], device=logits.device)
        filtered = _filter(work[idx], [rows[i].params for i in random_pos])  # (P', V)
        for j, i in enumerate(random_pos):
            slot[i] = j
        p_draft = _draft_probs(filtered.softmax(-1), chains, plans, starts, slot)

    emitted: list[list[int]] = []
    accepted: list[int] = []
    for chain, plan, start in zip(chains, plans, starts):
        if chain.row.params.greedy:
            tokens, n_acc = _verify_greedy(chain.drafts, plan, greedy[start : start + plan.n_pos])
        else:
            tokens, n_acc = _verify_random(
                chain, plan, p_draft[start : start + plan.n_check], filtered, slot[start]
            )
        emitted.append(tokens)
        accepted.append(n_acc)
    return _outputs(logits, chains, emitted, accepted)


def _modifies_logits(
    rows: list[SamplingRow], plans: list[GrammarPlan], constrained: list[int]
) -> bool:
    """Whether any position's logits differ from the raw ones: penalties, constraints or a
    grammar (else every position reads its raw row in place)."""
    return (
        bool(constrained)
        or any(p.bitmask is not None for p in plans)
        or any(r.params.needs_penalties for r in rows)
    )


def _plan(chain: Chain, vocab: int) -> GrammarPlan:
    """The positions to verify and, with a grammar, their masks."""
    if chain.grammar is not None:
        return chain.grammar
    return grammar_plan(chain.row.matcher, chain.drafts, vocab)


def grammar_plan(matcher: Any, drafts: list[int], vocab: int) -> GrammarPlan:
    """The positions of a chain with drafts `drafts` to verify and, with a grammar matcher,
    their masks (the matcher is advanced over the drafts it allows, then rolled back, so it
    is left as it was). `vocab` is the width of the logits."""
    k = len(drafts)
    if matcher is None:
        return GrammarPlan(n_check=k, final=True)
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(k + 1, vocab)  # (k + 1, ceil(V / 32))
    plan = GrammarPlan(n_check=k, final=True)
    advanced = 0
    try:
        for i in range(k + 1):
            matcher.fill_next_token_bitmask(bitmask, i)
            if i == k:
                break
            d = drafts[i]
            allowed = 0 <= d < vocab and (int(bitmask[i, d >> 5]) >> (d & 31)) & 1
            if not allowed or not matcher.accept_token(d):
                plan = GrammarPlan(n_check=i, final=True)  # rejected here: sample from p_i
                break
            advanced += 1
            if matcher.is_terminated():
                plan = GrammarPlan(n_check=i + 1, final=False)  # the sequence ends on drafts[i]
                break
    finally:
        if advanced:
            matcher.rollback(advanced)
    plan.bitmask = bitmask[: plan.n_pos]
    return plan


def _position_row(chain: Chain, i: int) -> SamplingRow:
    """The row `sample` would see at position i (after `drafts[:i]`); the grammar is applied
    separately."""
    base = chain.row
    output = base.output_token_ids + chain.drafts[:i] if i else base.output_token_ids
    banned = base.banned_token_ids
    if chain.min_tokens_banned and base.num_output_tokens + i < base.params.min_tokens:
        banned = banned + chain.min_tokens_banned
    return SamplingRow(
        params=base.params,
        generator=base.generator,
        prompt_token_ids=base.prompt_token_ids,
        output_token_ids=output,
        banned_token_ids=banned,
        matcher=None,
        num_output_tokens=base.num_output_tokens + i,
    )


def _apply_grammar(work: torch.Tensor, plans: list[GrammarPlan], starts: list[int]) -> None:
    """Masks the positions of the chains with a grammar, in place."""
    with_grammar = [(p, s) for p, s in zip(plans, starts) if p.bitmask is not None and p.n_pos]
    if not with_grammar:
        return
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(work.shape[0], work.shape[1])  # (P, ceil(V / 32))
    indices: list[int] = []
    for plan, start in with_grammar:
        assert plan.bitmask is not None
        bitmask[start : start + plan.n_pos] = plan.bitmask
        indices.extend(range(start, start + plan.n_pos))
    xgr.apply_token_bitmask_inplace(work, bitmask.to(work.device), indices=indices)


def _verify_greedy(
    drafts: list[int], plan: GrammarPlan, argmax: list[int]
) -> tuple[list[int], int]:
    """Accepts drafts while they equal the argmax; then the argmax at the first mismatch."""
    for i in range(plan.n_check):
        if drafts[i] != argmax[i]:
            return drafts[:i] + [argmax[i]], i
    tail = [argmax[plan.n_check]] if plan.final else []
    return drafts[: plan.n_check] + tail, plan.n_check


def _draft_probs(
    probs: torch.Tensor,
    chains: list[Chain],
    plans: list[GrammarPlan],
    starts: list[int],
    slot: list[int],
) -> list[float]:
    """`p_i(drafts[i])` at every checked position of the random chains, gathered at once from
    `probs (P', V)` (0 for a draft outside the vocabulary); other positions get 0."""
    vocab = probs.shape[1]
    out = [0.0] * len(slot)
    where: list[int] = []
    rows: list[int] = []
    ids: list[int] = []
    for chain, plan, start in zip(chains, plans, starts):
        if chain.row.params.greedy:
            continue
        for i, d in enumerate(chain.drafts[: plan.n_check]):
            if 0 <= d < vocab:
                where.append(start + i)
                rows.append(slot[start + i])
                ids.append(d)
    if where:
        device = probs.device
        index = torch.tensor(rows, device=device), torch.tensor(ids, device=device)
        for w, q in zip(where, probs[index].tolist()):
            out[w] = q
    return out


def _verify_random(
    chain: Chain, plan: GrammarPlan, p_draft: list[float], filtered: torch.Tensor, first: int
) -> tuple[list[int], int]:
    """Accepts `drafts[i]` with probability `p_i(drafts[i])` (`p_draft[i]`); at the first
    rejection samples the residual (p_i without the draft), else the bonus from `p_k`.
    `filtered[first + i]` are position i's logits after temperature, top-k, top-p, min-p."""
    drafts, gen = chain.drafts, chain.row.generator
    n = plan.n_check
    n_acc = n
    if n:
        device = gen.device if gen is not None else filtered.device
        u = torch.rand(n, generator=gen, device=device).tolist()  # (n,)
        n_acc = next((i for i in range(n) if u[i] >= p_draft[i]), n)
    if n_acc == n and not plan.final:
        return drafts[:n], n
    f = filtered[first + n_acc]
    if n_acc < n and 0 <= drafts[n_acc] < f.shape[0]:
        f = f.clone()
        f[drafts[n_acc]] = float("-inf")  # the residual max(p - q, 0), renormalised
    token = int(_sample(f[None], [chain.row])[0])
    return drafts[:n_acc] + [token], n_acc


def _outputs(
    logits: torch.Tensor, chains: list[Chain], emitted: list[list[int]], accepted: list[int]
) -> list[ChainOutput]:
    """Splits the emitted tokens per chain, with their raw logprobs."""
    flat_rows = [c.row_start + j for c, toks in zip(chains, emitted) for j in range(len(toks))]
    flat_tokens = [t for toks in emitted for t in toks]
    flat_sampling = [c.row for c, toks in zip(chains, emitted) for _ in toks]
    n = len(flat_tokens)
    out = SamplerOutput(
        token_ids=flat_tokens,
        token_logprobs=[0.0] * n,
        token_ranks=[0] * n,
        topk_ids=[[] for _ in range(n)],
        topk_logprobs=[[] for _ in range(n)],
    )
    if any(r.params.logprobs is not None for r in flat_sampling):
        index = torch.tensor(flat_rows, dtype=torch.long, device=logits.device)
        tokens = torch.tensor(flat_tokens, dtype=torch.long, device=logits.device)
        _add_logprobs(logits[index], tokens, flat_sampling, out)
    results = []
    pos = 0
    for toks, n_acc in zip(emitted, accepted):
        end = pos + len(toks)
        results.append(
            ChainOutput(
                token_ids=out.token_ids[pos:end],
                token_logprobs=out.token_logprobs[pos:end],
                token_ranks=out.token_ranks[pos:end],
                topk_ids=out.topk_ids[pos:end],
                topk_logprobs=out.topk_logprobs[pos:end],
                num_accepted=n_acc,
            )
        )
        pos = end
    return results
