"""N-gram prompt lookup: proposes the tokens that followed an earlier occurrence of the
sequence's last n tokens, as vLLM's `ngram` speculative method (`prompt_lookup_min`,
`prompt_lookup_max`, `num_speculative_tokens`).

The n-gram is the longest suffix of the token list, of length n in
`[prompt_lookup_min, prompt_lookup_max]`, that also occurs earlier (ending before the last
token; occurrences may overlap the suffix). Among the occurrences of that longest n-gram the
EARLIEST one in the list is taken, as vLLM's `_find_longest_matched_ngram_and_propose_tokens`
does, and up to `num_speculative_tokens` tokens that follow it are proposed (fewer when the
list ends first; with `max_model_len`, never past that length).

Each call is linear in the list's length: one Knuth-Morris-Pratt scan of the reversed list
for its own prefix (the reversed suffix), whose failure table only covers the first
`prompt_lookup_max` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    """Proposes draft tokens by n-gram lookup in a sequence's own tokens.

    Args:
        k: `num_speculative_tokens`, the most tokens proposed (>= 1).
        min_n: `prompt_lookup_min`, the shortest n-gram matched (>= 1).
        max_n: `prompt_lookup_max`, the longest n-gram matched (>= min_n).
        max_model_len: when set, proposals never make the sequence longer than this.

    Raises:
        ValueError: a parameter is out of range (the message names it).
    """

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int | None = None) -> None:
        for name, value in (
            ("num_speculative_tokens", k),
            ("prompt_lookup_min", min_n),
            ("prompt_lookup_max", max_n),
        ):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        if min_n < 1:
            raise ValueError(f"prompt_lookup_min must be >= 1, got {min_n}")
        if max_n < min_n:
            raise ValueError(
                f"prompt_lookup_max must be >= prompt_lookup_min ({min_n}), got {max_n}"
            )
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len

    def propose(self, token_ids: Sequence[int]) -> list[int]:
        """The draft tokens for a sequence whose tokens (prompt + output) are `token_ids`;
        empty when no n-gram of an allowed length recurs."""
        total = len(token_ids)
        k = self.k
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - total)
        if total < self.min_n or k <= 0:
            return []
        n, start = find_ngram(token_ids, self.min_n, self.max_n)
        if n == 0:
            return []
        return list(token_ids[start : start + k])


def find_ngram(token_ids: Sequence[int], min_n: int, max_n: int) -> tuple[int, int]:
    """`(n, start)`: the longest n in `[min_n, max_n]` such that the last n tokens occur
    earlier, and the index just after their earliest earlier occurrence; `(0, 0)` if none.

    Scans `r`, the reversed list: a match of `r[:m]` ending at `r[j]` (j >= 1) is an
    occurrence of the last m tokens starting at original index `total - 1 - j`. KMP keeps the
    longest such m at every j (capped at `max_n`); the largest j holding the overall longest
    is the earliest occurrence.
    """
    r = list(token_ids)[::-1]
    total = len(r)
    width = min(max_n, total)
    fail = [0] * width  # fail[i]: longest proper border of r[: i + 1]
    best = 0
    best_j = 0
    m = 0  # length of the current match of r[:m] ending at r[j]
    for j in range(1, total):
        t = r[j]
        while m and (m == width or r[m] != t):
            m = fail[m - 1]
        if r[m] == t:
            m += 1
        if j < width:
            fail[j] = m
        if m >= best:
            best, best_j = m, j
    if best < min_n:
        return 0, 0
    return best, total - 1 - best_j + best
