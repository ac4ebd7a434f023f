"""Tensor parallelism over 2 ranks (worker processes, gloo) with int8 weights: Mamba's
`tied+int8` (row-parallel layers take their whole rows' scales, the vocabulary-parallel
embedding reads the tied int8 head) gives what one rank gives.

The float checkpoints of every family whose heads split over 2 ranks (`Family.tp` in
`tests.tiny_models`) run the same check in `tests/models/test_families.py`
(`family_checks.assert_tensor_parallel_equals_one_rank`: greedy tokens, seeded forks,
logprobs within 1e-3, a prefix-cache hit copied on every rank, every slot free on both).
"""

from __future__ import annotations

from tests.helpers import family_checks as checks
from tests.tiny_models import tiny_model_dir


def test_int8_mamba_equals_one_rank() -> None:
    checks.assert_tensor_parallel_equals_one_rank(tiny_model_dir("tied"), quantization="int8")
