"""What is Jamba's own beyond the family checks (`tests/models/test_families.py`): forks share
the prompt's full KV blocks and copy the partial one, requests that can never fit the KV cache
are refused (and the engine goes on), the banner reports the KV cache, and a checkpoint
sharded into many files loads the same model."""

from __future__ import annotations

import pathlib

import pytest

from tests.helpers import family_checks as checks
from tests.helpers.logs import captured
from tests.helpers.prompts import make_prompts
from tests.helpers.runners import VllmRunner
from tests.tiny_models import build_hf_model, copy_tokenizer, tiny_model_dir
from vllm_mamba import SamplingParams

MODEL = "jamba-gqa"


def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one() -> None:
    path = tiny_model_dir(MODEL)
    prompt = make_prompts()[4]  # 31 tokens: one full block of 16 and a partial one of 15
    with VllmRunner(path, max_num_seqs=4, num_gpu_blocks_override=32) as runner:
        engine = runner.engine
        blocks = engine.scheduler.block_manager
        engine.add_request("fork", {"prompt_token_ids": prompt}, SamplingParams(n=3, seed=1))
        engine.step()  # the prompt, then the fork
        group = engine.scheduler.running[0]
        tables = [blocks.block_table(s.seq_id) for s in group.seqs]
        assert len(group.seqs) == 3 and tables[0] == tables[1] == tables[2]
        assert len(tables[0]) == 2 and blocks.num_used_blocks == 2
        assert [blocks.ref_count(b) for b in tables[0]] == [3, 3]
        engine.step()  # each child writes position 31 into the partial block: two copies
        tables = [blocks.block_table(s.seq_id) for s in group.seqs]
        assert len({t[0] for t in tables}) == 1 and blocks.ref_count(tables[0][0]) == 3
        assert len({t[1] for t in tables}) == 3 and blocks.num_used_blocks == 4
        engine.abort_request("fork")
        assert blocks.num_used_blocks == 0


def test_request_that_can_never_fit_is_refused() -> None:
    path = tiny_model_dir(MODEL)
    prompts = make_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=8)
    with VllmRunner(path, num_gpu_blocks_override=8, max_model_len=512) as runner:
        first = runner.generate({"prompt_token_ids": prompts[3]}, greedy)
        with pytest.raises(ValueError, match=r"whole KV cache holds \(8 blocks, 128 tokens\)"):
            runner.generate({"prompt_token_ids": prompts[7]}, greedy)  # 131 tokens
        with pytest.raises(ValueError, match="KV cache"):
            runner.generate({"prompt_token_ids": prompts[5]}, SamplingParams(max_tokens=65))
        with pytest.raises(ValueError, match="KV cache"):  # 3 x 3 blocks > 8
            runner.generate({"prompt_token_ids": prompts[4]}, SamplingParams(n=3, max_tokens=10))
        with pytest.raises(ValueError, match=r"maximum context length is 512 tokens"):
            runner.generate({"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=500))
        runner.assert_drained()
        again = runner.generate({"prompt_token_ids": prompts[3]}, greedy)
        assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids
        # Without max_tokens a request gets what the pool holds.
        params = SamplingParams(max_tokens=None, ignore_eos=True)
        out = runner.generate({"prompt_token_ids": prompts[5]}, params)
        assert len(out[0].outputs[0].token_ids) == 128 - 64


def test_banner_reports_the_kv_cache(caplog: pytest.LogCaptureFixture) -> None:
    with (
        captured(caplog),
        VllmRunner(tiny_model_dir(MODEL), num_gpu_blocks_override=40, max_model_len=256),
    ):
        pass
    text = caplog.text
    for part in (
        "state slots",
        "KV cache (2 attention layers, num_gpu_blocks_override): 40 blocks x 16 tokens",
        "= 640 tokens",
        "2.5 sequences of max_model_len 256 fit",
    ):
        assert part in text, (part, text)


def test_sharded_checkpoint_loads_the_same_model(tmp_path: pathlib.Path) -> None:
    build_hf_model("jamba-dense").save_pretrained(tmp_path, max_shard_size="200KB")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    copy_tokenizer(str(tmp_path))
    prompt = checks.prompts()[4]
    with VllmRunner(str(tmp_path)) as runner:
        sharded = checks.tokens(runner.generate(prompt, checks.GREEDY))
    assert sharded == [checks.alone(tiny_model_dir("jamba-dense"))[4]]
