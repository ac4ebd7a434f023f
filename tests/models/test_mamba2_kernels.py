"""Mamba2 through the engine gives the same tokens with the C++ kernels and the references."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.ops import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="C++ extension not built")


def _prompts() -> list[dict]:
    """Eight prompts of 3 to 40 tokens: long ones cross the SSD chunks and the token budget."""
    g = torch.Generator().manual_seed(7)
    lens = [3, 40, 9, 17, 1, 33, 24, 5]
    return [{"prompt_token_ids": torch.randint(0, 50000, (n,), generator=g).tolist()} for n in lens]


def _run(name: str) -> tuple[str, list[list[int]], list[list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)
    with VllmRunner(tiny_model_dir(name), max_num_batched_tokens=23) as runner:
        outs = [o.outputs[0] for o in runner.generate(_prompts(), params)]
        backend = runner.engine.model.backbone.layers[0].mixer.ops.name
    logprobs = [[next(iter(d.values())).logprob for d in o.logprobs] for o in outs]
    return backend, [o.token_ids for o in outs], logprobs


@pytest.mark.parametrize("name", ["mamba2-groups", "mamba2-tied"])
def test_cpp_kernels_equal_reference_ops(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_MAMBA_OPS", raising=False)
    backend, want, want_lp = _run(name)
    assert backend == "cpp"
    assert len({tuple(t) for t in want}) > 4, "reference generations should be varied"
    monkeypatch.setenv("VLLM_MAMBA_OPS", "ref")
    backend, got, got_lp = _run(name)
    assert backend == "ref"
    assert got == want
    torch.testing.assert_close(torch.tensor(got_lp), torch.tensor(want_lp), rtol=0, atol=1e-4)
