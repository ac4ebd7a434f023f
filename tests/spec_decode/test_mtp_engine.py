"""Speculative method `mtp` through the engine: Qwen3.5 (dense, MoE), Qwen3-Next (and, for the
greedy check, Nemotron-H, Ling 3, GLM-5-Next and Qwen4-Exp) targets with random MTP heads (most
drafts rejected, so rollbacks run), against runs without speculation, and the head's first
draft against the independent dense reference of `test_mtp_head` fed the target's own hidden
rows."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.family_checks import GREEDY, prompts, tokens
from tests.helpers.mtp_checkpoints import (
    VARIANTS,
    save_tiny_glm5_with_mtp,
    save_tiny_ling_with_mtp,
    save_tiny_nemotron_with_mtp,
    save_tiny_qwen4_with_mtp,
    save_tiny_with_mtp,
)
from tests.helpers.runners import VllmRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.helpers.tmp_dirs import make_tmp_dir
from tests.spec_decode.test_mtp_head import Reference
from vllm_mamba import SamplingParams

FAMILIES = sorted(VARIANTS)


def _checkpoint(family: str) -> str:
    path = make_tmp_dir(f"tiny-{family}-mtp-engine-")
    if family == "nemotron_h":  # Nemotron 3's head: tests/spec_decode/test_nemotron_mtp.py
        return save_tiny_nemotron_with_mtp(path)
    if family == "ling":  # Ling 3's MTP layer: tests/spec_decode/test_ling_mtp.py
        return save_tiny_ling_with_mtp(path)
    if family == "glm5_next":  # GLM-5-Next's: tests/spec_decode/test_frontier_mtp.py
        return save_tiny_glm5_with_mtp(path)
    if family == "qwen4_exp":  # Qwen4-Exp's streams head: tests/spec_decode/test_frontier_mtp.py
        return save_tiny_qwen4_with_mtp(path)
    return save_tiny_with_mtp(family, path)


@pytest.mark.parametrize("family", [*FAMILIES, "nemotron_h", "ling", "glm5_next", "qwen4_exp"])
def test_mtp_greedy_equals_no_speculation(family: str) -> None:
    """k = 1 and k = 3 (further drafts fed the head's own output, their KV written ahead),
    with chunked prefill and prefix caching on: the tokens of the run without speculation."""
    path = _checkpoint(family)
    with VllmRunner(path) as plain:
        want = tokens(plain.generate(prompts(), GREEDY))
    for k in (1, 3):
        spec = {"method": "mtp", "num_speculative_tokens": k}
        with VllmRunner(
            path, speculative_config=spec, max_num_batched_tokens=40, enable_prefix_caching=True
        ) as runner:
            assert tokens(runner.generate(prompts(), GREEDY)) == want
            counters = runner.engine.spec_steps.counters
            assert counters.num_draft_tokens > counters.num_drafts * (k - 1)


def test_mtp_rollback_with_accepted_runs() -> None:
    """The head's drafts replaced by partly right ones (accepted runs and rejections): the
    head still runs over every row (its KV at every position) and the tokens are exact."""
    path = _checkpoint("qwen3_5")
    with VllmRunner(path) as plain:
        want = tokens(plain.generate(prompts(), GREEDY))
    refs = {tuple(p["prompt_token_ids"]): w for p, w in zip(prompts(), want)}
    spec = {"method": "mtp", "num_speculative_tokens": 4}
    with VllmRunner(path, speculative_config=spec) as runner:
        runner.engine.spec_steps.proposer = OracleProposer(refs)
        assert tokens(runner.generate(prompts(), GREEDY)) == want
        assert runner.engine.spec_steps.counters.num_accepted_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_first_draft_is_the_reference_heads_prediction(family: str) -> None:
    """After a prompt's prefill, the first draft is the argmax of the reference head over
    the target's hidden rows and the following tokens (the sampled one last)."""
    path = _checkpoint(family)
    prompt = prompts()[5]["prompt_token_ids"][:40]
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with VllmRunner(path, speculative_config=spec) as runner:
        engine = runner.engine
        captured: list[torch.Tensor] = []
        hook = engine.model.register_forward_hook(lambda m, i, out: captured.append(out.clone()))
        engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0))
        engine.step()  # the whole prompt: hidden rows of positions 0 .. P
        hook.remove()
        seq = engine.scheduler.running[0].seqs[0]
        draft = seq.spec_token_ids[0]  # proposed at the end of the step
        engine.abort_request("r")
    following = torch.tensor(prompt[1:] + seq.output_token_ids[:1])
    _, logits = Reference(path)(captured[0][: len(prompt)], following)
    assert draft == int(logits[-1].argmax())


def test_mtp_refused_without_a_head_and_with_tensor_parallelism() -> None:
    """A model without an MTP head, and `mtp` with two ranks, are ValueErrors at startup."""
    from tests.tiny_models import tiny_model_dir

    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="multi-token prediction head"):
        VllmRunner(tiny_model_dir("tied"), speculative_config=spec)
    with pytest.raises(ValueError, match="tensor_parallel_size 2"):
        VllmRunner(_checkpoint("qwen3_5"), speculative_config=spec, tensor_parallel_size=2)
