"""Two engine steps that mix decode rows and prefill chunks over four sequences, for layer
tests against a per-sequence reference (the sparse attention layers').

Step 1 prefills the first 22, 8 and 10 tokens of sequences 0, 1 and 3; step 2 decodes the
next token of sequences 0 and 1, prefills sequence 2 whole and continues sequence 3's cached
context with its last 7 tokens. `run_mixed_steps` returns step 2's outputs per sequence and
`step_two_rows` the same rows of each sequence's whole-sequence reference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vllm_mamba.attention.backend import StepLayout
from vllm_mamba.attention.backends.paged import PagedMetadata, build_paged_metadata

LENGTHS = (23, 9, 26, 17)  # the four sequences
NUM_BLOCKS = 12  # the pool the sequences' tables name
_TABLES = [[0, 1, 2], [3, 4], [5, 6, 7, 8], [9, 10, 11]]


def run_mixed_steps(
    layer: Callable[[torch.Tensor, PagedMetadata], torch.Tensor],
    seqs: list[torch.Tensor],
    block_size: int,
) -> list[torch.Tensor]:
    """Runs both steps through `layer` (bound to a pool of `NUM_BLOCKS` blocks of
    `block_size`) over `seqs (L_i, H)`; returns step 2's outputs per sequence."""
    cpu, t = torch.device("cpu"), _TABLES
    step1 = StepLayout(
        decode_slots=[], prefill_lens=[22, 8, 10], prefill_slots=[0, 1, 3],
        prefill_context_lens=[0, 0, 0], block_size=block_size,
        prefill_block_tables=[t[0], t[1], t[3]],
    )  # fmt: skip
    step2 = StepLayout(
        decode_slots=[0, 1], prefill_lens=[26, 7], prefill_slots=[2, 3],
        prefill_context_lens=[0, 10], decode_context_lens=[22, 8], block_size=block_size,
        decode_block_tables=[t[0], t[1]], prefill_block_tables=[t[2], t[3]],
    )  # fmt: skip
    with torch.no_grad():
        layer(
            torch.cat([seqs[0][:22], seqs[1][:8], seqs[3][:10]]), build_paged_metadata(step1, cpu)
        )
        hidden = torch.cat([seqs[0][22:], seqs[1][8:], seqs[2], seqs[3][10:]])
        return list(layer(hidden, build_paged_metadata(step2, cpu)).split([1, 1, 26, 7]))


def step_two_rows(wants: list[torch.Tensor]) -> list[torch.Tensor]:
    """The rows of each sequence's reference that step 2 computes."""
    return [wants[0][22:], wants[1][8:], wants[2], wants[3][10:]]
