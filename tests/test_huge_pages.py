"""`vllm_mamba.worker.huge_pages`: weights and caches on transparent huge pages change no value.

The mapping's `VmFlags` in `/proc/self/smaps` show `hg` once `madvise(MADV_HUGEPAGE)` took;
whether the kernel then backs it with 2 MiB pages depends on free memory, so the tests check
the advice and the values, not the page size.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.worker import huge_pages
from vllm_mamba.worker.huge_pages import HUGE_PAGE, enabled, huge_page_zeros, move_to_huge_pages

needs_thp = pytest.mark.skipif(not enabled(), reason="no transparent huge pages on this kernel")


def advised_huge(ptr: int) -> bool:
    """True when the mapping holding address `ptr` carries MADV_HUGEPAGE (`hg`)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == "VmFlags:":
                return "hg" in line.split()[1:]
    raise AssertionError(f"no mapping holds {ptr:#x}")


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        self.head = nn.Linear(64, 300, bias=False)
        self.head.weight = self.embed.weight  # one Parameter under two modules
        self.proj = nn.Linear(64, 48)
        self.register_buffer("table", torch.arange(24.0).view(4, 6).t())  # not contiguous
        self.register_buffer("bf16", torch.randn(10, dtype=torch.bfloat16))
        self.register_buffer("ids", torch.arange(7))


@needs_thp
def test_move_keeps_values_identity_and_sharing() -> None:
    torch.manual_seed(0)
    model = Tied()
    before = {name: t.clone() for name, t in model.state_dict(keep_vars=True).items()}
    strides = {name: t.stride() for name, t in model.state_dict(keep_vars=True).items()}
    params = {name: p for name, p in model.named_parameters()}
    assert move_to_huge_pages(model) == 0  # a toy model stays on its pages by default
    moved = move_to_huge_pages(model, min_bytes=0)
    assert moved >= sum(t.nbytes for t in before.values()) - model.head.weight.nbytes
    after = model.state_dict(keep_vars=True)
    for name, t in before.items():
        assert after[name].dtype == t.dtype and after[name].stride() == strides[name], name
        assert torch.equal(after[name], t), name
        assert advised_huge(after[name].data_ptr()), name
    assert all(p is dict(model.named_parameters())[n] for n, p in params.items())
    assert model.head.weight.data_ptr() == model.embed.weight.data_ptr()
    assert model.proj.weight.data_ptr() % 64 == 0
    x = torch.randn(3, 64)
    assert torch.equal(model.head(x), x @ before["embed.weight"].t())


@needs_thp
def test_an_untied_token_table_stays_on_its_pages() -> None:
    """Decode reads a few rows of a token table a step: only a table tied to the head moves."""
    model = Tied()
    model.untied = nn.Embedding(300, 64)
    table = model.untied.weight.detach().clone()
    ptr = model.untied.weight.data_ptr()
    moved = move_to_huge_pages(model, min_bytes=0)
    assert moved > 0 and model.untied.weight.data_ptr() == ptr
    assert torch.equal(model.untied.weight, table)
    assert advised_huge(model.embed.weight.data_ptr())  # the tied table: the head's weight


def test_move_is_off_with_the_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_MAMBA_HUGE_PAGES", "0")
    model = Tied()
    ptr = model.proj.weight.data_ptr()
    assert move_to_huge_pages(model, min_bytes=0) == 0
    assert model.proj.weight.data_ptr() == ptr
    assert huge_page_zeros((HUGE_PAGE,), torch.uint8).sum() == 0


@needs_thp
def test_zeros_are_zero_and_advised() -> None:
    t = huge_page_zeros((3, HUGE_PAGE // 8), torch.float32)
    assert t.shape == (3, HUGE_PAGE // 8) and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any() and advised_huge(t.data_ptr()) and t.data_ptr() % HUGE_PAGE == 0
    t[2, -1] = 5.0  # the whole mapping is writable
    small = huge_page_zeros((4, 5), torch.bfloat16)  # below one huge page: torch's allocator
    assert small.shape == (4, 5) and not small.any()


MODELS = {
    "mamba": lambda: tiny_model_dir("tied"),
    "mamba2": lambda: tiny_model_dir("mamba2-groups"),
    "jamba": lambda: tiny_model_dir("jamba-gqa"),
    "bamba": lambda: tiny_model_dir("bamba-gqa"),
}


@needs_thp
@pytest.mark.parametrize("quantization", [None, "int8"])
@pytest.mark.parametrize("arch", sorted(MODELS))
def test_engine_outputs_equal_without_huge_pages(
    vllm_runner, monkeypatch: pytest.MonkeyPatch, example_token_prompts, arch, quantization
) -> None:
    """Greedy tokens and every logprob bit-identical with huge pages on and off (the tiny
    models moved too, below the default size floor)."""
    monkeypatch.setattr(huge_pages, "MIN_MODEL_BYTES", 0)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=2, prompt_logprobs=1)
    prompts = [{"prompt_token_ids": p} for p in example_token_prompts[:4]]
    runs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("VLLM_MAMBA_HUGE_PAGES", flag)
        runner: VllmRunner
        with vllm_runner(MODELS[arch](), quantization=quantization) as runner:
            weight = runner.engine.model.lm_head.weight  # streamed every step
            assert advised_huge(weight.data_ptr()) == (flag == "1")
            outs = runner.generate(prompts, params)
            runs.append(
                [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]
            )
            runner.assert_drained()
    assert len({tuple(r[0]) for r in runs[0]}) == len(prompts)  # varied outputs
    assert runs[0] == runs[1]


def _rss() -> int:
    """Resident bytes: `statm` counts pages of the system's page size (4 KiB on x86-64, 16 or
    64 KiB on some aarch64 kernels)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_thp
def test_move_leaves_no_second_copy() -> None:
    """The old storages (8 MiB each: kept by glibc's heap unless trimmed) are given back."""
    model = nn.Sequential(*[nn.Linear(1024, 2048, bias=False) for _ in range(8)])  # 64 MiB
    before = _rss()
    assert move_to_huge_pages(model) == 8 * 1024 * 2048 * 4
    assert _rss() - before < 16 << 20
