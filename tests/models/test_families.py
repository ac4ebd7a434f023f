"""Every model family of `tests.tiny_models` held to the same checks (`family_checks`).

Per family: each variant against transformers (greedy tokens equal, varied references,
logprobs close); on its main variant, batched and queued equal to each prompt alone, chunked
prefill at the family's odd budgets equal to whole prefill, greedy and seeded forks, prefix
caching on equal to off with hits, and for hybrids KV pressure with preemption equal to no
pressure; on its second variant, seeded forks equal to independent seeded runs (for hybrids
also under KV pressure and chunked prefill); tensor parallelism over 2 ranks equal to one rank
on the variants whose heads split. Every engine checks on exit that every slot and KV block is
free; on a GPU (`cuda` marker), CUDA-graph decode equal to eager for the families that say so.
What is specific to one family lives in that family's own test module.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import family_checks as checks
from tests.tiny_models import FAMILIES, Family, tiny_model_dir

HYBRIDS = [f for f in FAMILIES if f.hybrid]
GRAPHS = [f for f in FAMILIES if f.cuda_graphs]


def _per_family(families: list[Family]) -> list:
    """`families` as parameters, each family's tests on one xdist worker (`--dist
    loadgroup`): the checkpoints and the lone runs (`checks.alone`) are made once per family."""
    return [pytest.param(f, id=f.name, marks=pytest.mark.xdist_group(f.name)) for f in families]


def _per_variant(attr: str) -> list:
    """The variants each family lists in `attr` (`reference`, `tp`), grouped by family."""
    return [
        pytest.param(n, id=n, marks=pytest.mark.xdist_group(f.name))
        for f in FAMILIES
        for n in getattr(f, attr)
    ]


@pytest.mark.parametrize("name", _per_variant("reference"))
def test_greedy_tokens_and_logprobs_equal_transformers(name: str) -> None:
    checks.assert_matches_transformers(name)


@pytest.mark.parametrize("family", _per_family(FAMILIES))
def test_batched_equals_alone(family: Family) -> None:
    checks.assert_batched_equals_alone(tiny_model_dir(family.main))


@pytest.mark.parametrize("family", _per_family(FAMILIES))
def test_speculative_decoding_equals_alone(family: Family) -> None:
    checks.assert_speculation_equals_alone(tiny_model_dir(family.main))


@pytest.mark.parametrize(
    ("family", "budget"),
    [
        pytest.param(f, b, id=f"{f.name}-{b}", marks=pytest.mark.xdist_group(f.name))
        for f in FAMILIES
        for b in f.chunk_budgets
    ],
)
def test_chunked_prefill_equals_whole(family: Family, budget: int) -> None:
    checks.assert_chunked_equals_whole(tiny_model_dir(family.main), budget)


@pytest.mark.parametrize("family", _per_family(FAMILIES))
def test_forks_equal_alone(family: Family) -> None:
    checks.assert_forks_equal_alone(tiny_model_dir(family.main))


@pytest.mark.parametrize("family", _per_family(FAMILIES))
def test_forks_equal_independent_seeded_runs(family: Family) -> None:
    checks.assert_forks_equal_independent_seeded_runs(tiny_model_dir(family.second))


@pytest.mark.parametrize("family", _per_family(HYBRIDS))
def test_kv_pressure_preempts_and_equals_no_pressure(family: Family) -> None:
    checks.assert_kv_pressure_equals_no_pressure(
        tiny_model_dir(family.main), family.kv_pressure_blocks
    )


@pytest.mark.parametrize("family", _per_family(HYBRIDS))
def test_forks_and_chunks_under_kv_pressure(family: Family) -> None:
    checks.assert_forks_and_chunks_under_pressure(
        tiny_model_dir(family.second), family.fork_pressure_blocks
    )


@pytest.mark.parametrize("family", _per_family(FAMILIES))
def test_prefix_cache_on_equals_off_and_hits(family: Family) -> None:
    checks.assert_prefix_cache_on_equals_off(tiny_model_dir(family.main))


@pytest.mark.parametrize("name", _per_variant("tp"))
def test_tensor_parallel_equals_one_rank(name: str) -> None:
    checks.assert_tensor_parallel_equals_one_rank(tiny_model_dir(name))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", _per_family(GRAPHS))
def test_gpu_graphs_equal_eager_and_cpu(family: Family, dtype: str) -> None:
    checks.assert_gpu_graphs_equal_eager_and_cpu(tiny_model_dir(family.main), dtype)
