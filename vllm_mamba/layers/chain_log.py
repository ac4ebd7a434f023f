"""A chain log: how a fused decode layer keeps a speculative chain's states without writing one
per position.

Speculative verification runs a chain of positions (the last token, then the drafts) and
keeps the state after each in a spare slot, so that a rollback after rejected drafts copies
one back (`recurrent_step`, `worker.model_runner`). For a large recurrent state that is one
full write per position: a Gated DeltaNet layer of Qwen3.5-0.8B holds 1 MiB a sequence, so a
chain of 5 moved about 11 MiB a layer against a plain step's 2.

A layer whose fused kernel logs its chains instead (the GDN's `decode_layer` with `chain_log`)
writes no position's state to the state tensor `state`: the sequence's slot keeps the chain's
start state, the chain's first spare slot gets a copy of it, and each position leaves a small
record in `tensor` (at the slot its row writes, `(S, *record)` float32). Its `replay` op brings
the start state to any position through the records, bit for bit as the chain computed it: the
step that ran the chain replays the kept positions in place in the sequence's slot (the whole
chain too), and a later rollback that the engine asks for (a chain it cut short) replays from
the spare copy.

`active` says whether the layer's last chain step ran through the logging kernel (the fused
step sets it, the layer's unfused path clears it), so the rollback (`StateCache.rollback`,
before the next forward) knows, per layer, whether to copy a spare slot back or to replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ReplayFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
"""`replay(states, log, start, records, dst)`: state `dst[i]` = the state of slot `start[i]`
advanced by the records at the slots `records[i, :]` (`-1` after the last); `states (S, ...)`,
`log (S, *record)`, `start, dst (n,)`, `records (n, R)` int64."""


@dataclass(eq=False)
class ChainLog:
    """One layer's chain log (see the module).

    Attributes:
        state: the name of the state tensor it logs (the others keep a state per position).
        record: the shape of one slot's record (GDN: `(Hv, Dk + Dv + 1)`).
        replay: the backend's replay op (`ReplayFn`).
        tensor: `(S, *record)` float32 records by slot, allocated at the first chain.
        active: the layer's last chain step was logged.
    """

    state: str
    record: tuple[int, ...]
    replay: ReplayFn
    tensor: torch.Tensor | None = None
    active: bool = False

    def buffer(self, states: torch.Tensor) -> torch.Tensor:
        """The records for `states (S, ...)`'s slots (made zero at the first call, or when
        the slot count changed)."""
        if self.tensor is None or self.tensor.shape[0] != states.shape[0]:
            shape = (states.shape[0], *self.record)
            self.tensor = torch.zeros(shape, dtype=torch.float32, device=states.device)
        return self.tensor
