"""Turns the logits of the sampled positions into tokens and log-probabilities.

Rows are processed together: penalties, then the rows' own constraints (logit bias, allowed
token ids, bad words, banned tokens, and a grammar's token bitmask, applied only to the rows
that have them), then greedy rows take the argmax (`argmax_rows`: the ops backend's
`sampling.argmax_rows`, torch.argmax's indices) and the others are
sampled after temperature, top-k, top-p and min-p, by an exponential race (argmax of p / q with
q ~ Exp(1)), drawn from each row's own generator when the request has a seed. Log-probabilities
are those of the model's raw distribution (before penalties and temperature), as in vLLM.

Glossary: R rows (sampled positions), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_mamba import envs
from vllm_mamba.ops import sampling as sampling_ops
from vllm_mamba.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm_mamba.worker.step import SamplingOptions


@dataclass
class SamplingRow:
    """What the sampler needs to know about one row.

    Attributes:
        params: the request's `SamplingParams`, or their plain copy in a step
            (`worker.step.SamplingOptions`).
        prompt_token_ids, output_token_ids: the sequence's tokens (read only by penalties and
            bad words: a step sends them only then).
        matcher: the sequence's grammar matcher (xgrammar), when it has one here; or
        bitmask: its allowed tokens at this row, `(ceil(V / 32),)` int32, filled from the
            matcher where it lives (the engine).
        num_output_tokens: tokens generated before this row (`len(output_token_ids)` when
            not given).
    """

    params: SamplingParams | SamplingOptions
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: list[int]
    matcher: Any = None
    bitmask: torch.Tensor | None = None
    num_output_tokens: int = -1

    def __post_init__(self) -> None:
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.output_token_ids)

    @property
    def has_grammar(self) -> bool:
        """True when a grammar masks this row."""
        return self.matcher is not None or self.bitmask is not None


@dataclass
class SamplerOutput:
    """Per row: the token, its raw logprob, and (when asked) the top-k tokens and their ranks."""

    token_ids: list[int]
    token_logprobs: list[float]
    token_ranks: list[int]
    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output), presence and frequency (output) penalties, in place."""
    vocab = logits.shape[1]
    for i, row in enumerate(rows):
        p = row.params
        if not p.needs_penalties:
            continue
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(
                sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long
            ).to(logits.device)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if row.output_token_ids and (p.presence_penalty or p.frequency_penalty):
            out_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
            counts.scatter_add_(0, out_ids, torch.ones_like(out_ids, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return logits


def apply_constraints(logits: torch.Tensor, rows: list[SamplingRow], idx: list[int]) -> None:
    """Logit bias, allowed token ids, bad words, banned tokens and grammar bitmasks of the rows
    `idx` of `logits (R, V)`, in place."""
    for i in idx:
        row, p = rows[i], rows[i].params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
            logits[i, ids] += bias.to(logits.device)
        if p.allowed_token_ids:
            keep = torch.full_like(logits[i], float("-inf"))
            keep[p.allowed_token_ids] = 0.0
            logits[i] += keep
        banned = row.banned_token_ids
        if p.bad_words_token_ids:
            banned = banned + _bad_word_tokens(p.bad_words_token_ids, row.output_token_ids)
        if banned:
            logits[i, banned] = float("-inf")
    grammar_rows = [i for i in idx if rows[i].has_grammar]
    if grammar_rows:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])  # (R, ceil(V / 32))
        for i in grammar_rows:
            row_mask = rows[i].bitmask
            if row_mask is not None:
                bitmask[i] = row_mask
            else:
                rows[i].matcher.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device, non_blocking=True), indices=grammar_rows
        )


def _bad_word_tokens(words: list[list[int]], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output so far."""
    banned = []
    for word in words:
        prefix = word[:-1]
        if not prefix or output[len(output) - len(prefix) :] == prefix:
            banned.append(word[-1])
    return banned


def _filter(logits: torch.Tensor, params: list[SamplingParams | SamplingOptions]) -> torch.Tensor:
    """Temperature, then top-k / top-p / min-p masking, for the non-greedy rows `(R', V)`."""
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device)
    logits = logits / temps[:, None]
    if all(p.top_k == -1 and p.top_p == 1.0 and p.min_p == 0.0 for p in params):
        return logits
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # (R', V)
    probs = sorted_logits.softmax(-1)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    min_p = torch.tensor([p.min_p for p in params], device=device)
    ranks = torch.arange(vocab, device=device)[None, :]
    drop = ranks >= top_k[:, None]
    drop |= (probs.cumsum(-1) - probs) > top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Samples one token per row of `logits (R', V)` by an exponential race."""
    probs = logits.softmax(-1)
    q = torch.empty_like(probs)
    for i, row in enumerate(rows):
        q[i].exponential_(generator=row.generator)
    return argmax_rows(probs / q)


_ARGMAX: dict[tuple[str, str], Callable[[torch.Tensor], torch.Tensor]] = {}


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token of `x (R, V)`, `(R,)` int64: the first index of its largest
    value (the first NaN where it has one), as `torch.argmax(x, -1)`, by the ops backend's
    `sampling.argmax_rows` for float32 rows."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0:
        return x.argmax(-1)
    key = (x.device.type, envs.VLLM_MAMBA_OPS)
    op = _ARGMAX.get(key)
    if op is None:
        from vllm_mamba.ops.dispatch import get_mamba_ops

        op = _ARGMAX[key] = get_mamba_ops(x.device).family(sampling_ops.FAMILY).argmax_rows
    return op(x)


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """Samples a token for every row of `logits (R, V)` (float32).

    Args:
        logits: raw model logits of the sampled positions.
        rows: one entry per row.

    Returns:
        The tokens, and their log-probabilities for the rows that ask for them (0.0 elsewhere).
    """
    constrained = [
        i
        for i, r in enumerate(rows)
        if r.params.needs_logit_masks or r.banned_token_ids or r.has_grammar
    ]
    needs_copy = constrained or any(r.params.needs_penalties for r in rows)
    work = logits.clone() if needs_copy else logits
    apply_penalties(work, rows)
    if constrained:
        apply_constraints(work, rows, constrained)
    tokens = argmax_rows(work)  # (R,)
    random_idx = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_idx:
        idx = torch.tensor(random_idx, device=logits.device)
        filtered = _filter(work[idx], [rows[i].params for i in random_idx])
        tokens[idx] = _sample(filtered, [rows[i] for i in random_idx])
    out = SamplerOutput(
        token_ids=tokens.tolist(),
        token_logprobs=[0.0] * len(rows),
        token_ranks=[0] * len(rows),
        topk_ids=[[] for _ in rows],
        topk_logprobs=[[] for _ in rows],
    )
    _add_logprobs(logits, tokens, rows, out)
    return out


def _add_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, rows: list[SamplingRow], out: SamplerOutput
) -> None:
    """Fills the raw log-probabilities, ranks and top-k of the rows that ask for logprobs."""
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return
    idx = torch.tensor(wanted, device=logits.device)
    raw = logits[idx].log_softmax(-1)  # (W, V)
    chosen = raw.gather(1, tokens[idx, None])  # (W, 1)
    ranks = ((raw > chosen).sum(-1) + 1).tolist()
    max_k = max(rows[i].params.logprobs for i in wanted)
    lps, ids = raw.topk(max_k, dim=-1) if max_k > 0 else (raw[:, :0], raw[:, :0].long())
    lps, ids, chosen = lps.tolist(), ids.tolist(), chosen[:, 0].tolist()
    for j, i in enumerate(wanted):
        k = rows[i].params.logprobs
        out.token_logprobs[i], out.token_ranks[i] = chosen[j], ranks[j]
        out.topk_ids[i], out.topk_logprobs[i] = ids[j][:k], lps[j][:k]
