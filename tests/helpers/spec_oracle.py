"""A test proposer that knows the answer: drafts from each prompt's reference continuation
(computed without speculation), with a fixed pattern of drafts made wrong.

Real proposers on tiny random models rarely propose what the model says (n-gram lookup finds
few repeats, random draft models disagree), so they exercise rejections but hardly ever a
long accepted run. This one mixes both deterministically: in a step where the sequence has
`o` output tokens, draft `i` is wrong when `(7 * o + i) % every == every - 1`, so chains end
at every position, and every draft is right with `every=0`.
"""

from __future__ import annotations

from vllm_mamba.engine.sequence import Sequence, SequenceGroup


class OracleProposer:
    """Proposes `refs[prompt][o : o + k]` for a sequence with `o` output tokens, some made
    wrong (see the module docstring); nothing for prompts it has no reference for."""

    def __init__(self, refs: dict[tuple[int, ...], list[int]], every: int = 3) -> None:
        self.refs = refs
        self.every = every
        self.finished = 0

    def propose(self, seqs: list[tuple[SequenceGroup, Sequence, int]]) -> list[list[int]]:
        """Drafts for each `(group, seq, k)`."""
        out = []
        for _, seq, k in seqs:
            ref = self.refs.get(tuple(seq.prompt_token_ids), [])
            o = len(seq.output_token_ids)
            drafts = list(ref[o : o + k])
            for i in range(len(drafts)):
                if self.every and (7 * o + i) % self.every == self.every - 1:
                    drafts[i] = (drafts[i] + 1) % 1000
            out.append(drafts)
        return out

    def on_finished(self, seq: Sequence) -> None:
        """Counts the sequences it was told about."""
        self.finished += 1
