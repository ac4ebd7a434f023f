"""The worker package: its imports point down only, the runner is configured when it is built,
the other ranks make rank 0's calls, and CUDA graphs follow the backend's declared
capability."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.attention.backends.paged import PagedAttentionBackend
from vllm_mamba.attention.backends.placeholder import PlaceholderAttentionBackend
from vllm_mamba.cache_specs import StateSpec, StateTensor
from vllm_mamba.state_cache import StateCache
from vllm_mamba.worker.caches import LocalCopies
from vllm_mamba.worker.relay import Command
from vllm_mamba.worker.worker import Worker, captures_decode


def test_worker_package_never_imports_the_executor() -> None:
    """The worker sits under the executor: importing every worker module pulls in no
    `vllm_mamba.executor` module (the executor hands the worker what it needs)."""
    code = (
        "import sys\n"
        "import vllm_mamba.worker.worker, vllm_mamba.worker.model_runner\n"
        "import vllm_mamba.worker.platform, vllm_mamba.worker.relay\n"
        "bad = sorted(m for m in sys.modules if m.startswith('vllm_mamba.executor'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_other_ranks_make_rank_0s_calls() -> None:
    """Ranks 1..N-1 run what rank 0's executor sends them: the same call on their own worker
    (`init_caches`, `init_runner`, `execute` with the same step); nothing else."""
    calls: list[tuple] = []

    class Probe(Worker):
        def __init__(self) -> None:  # no model: only the dispatch is under test
            pass

        def init_caches(self, *args: object) -> None:
            calls.append(("init_caches", *args))

        def init_runner(self, *args: object) -> None:  # type: ignore[override]
            calls.append(("init_runner", *args))

        def execute(self, *args: object) -> None:  # type: ignore[override]
            calls.append(("execute", *args))

    worker = Probe()
    sent: list[Command] = [("init_caches", 4, None), ("init_runner", "config"), ("execute", "s")]
    for command in sent:
        worker.handle(command)
    assert calls == sent
    with pytest.raises(ValueError, match="unknown worker command 'forward'"):
        worker.handle(("forward", None, None))


def test_local_copies_copy_every_state_of_a_slot() -> None:
    spec = StateSpec(
        (
            StateTensor("conv", (3, 2), "conv", torch.float32),
            StateTensor("ssm", (3, 4), "recurrent", torch.float32),
        )
    )
    cache = StateCache([spec, spec], num_slots=4, device=torch.device("cpu"))
    for group in cache.tensors:
        for t in group.values():
            t.copy_(torch.randn_like(t))
    before = [{k: t.clone() for k, t in g.items()} for g in cache.tensors]
    LocalCopies(cache, None).copy_slots([0, 2], [3, 1])
    for group, old in zip(cache.tensors, before):
        for name, t in group.items():
            assert torch.equal(t[:, 3], old[name][:, 0]) and torch.equal(t[:, 1], old[name][:, 2])
            assert torch.equal(t[:, 0], old[name][:, 0]) and torch.equal(t[:, 2], old[name][:, 2])


def test_cuda_graphs_are_a_declared_backend_capability() -> None:
    """Attention-free decode metadata is only the slots: capturable; paged metadata carries
    each step's block tables: not. The worker captures only on CUDA, with one rank, unless
    `enforce_eager`, and only for a backend that declares it."""
    assert PlaceholderAttentionBackend.decode_cuda_graphs is True
    assert PagedAttentionBackend.decode_cuda_graphs is False
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert captures_decode(PlaceholderAttentionBackend, cuda, 1, enforce_eager=False)
    assert not captures_decode(PagedAttentionBackend, cuda, 1, enforce_eager=False)
    assert not captures_decode(PlaceholderAttentionBackend, cuda, 1, enforce_eager=True)
    assert not captures_decode(PlaceholderAttentionBackend, cuda, 2, enforce_eager=False)
    assert not captures_decode(PlaceholderAttentionBackend, cpu, 1, enforce_eager=False)

    class Declared(PagedAttentionBackend):
        decode_cuda_graphs = True

    assert captures_decode(Declared, cuda, 1, enforce_eager=False)  # the flag, not the class


def test_runner_is_configured_when_built() -> None:
    """The engine's decisions reach the runner in its `RunnerConfig`; rank 0's worker is the
    executor's, and on the CPU no CUDA graphs are captured."""
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with VllmRunner(
        tiny_model_dir("tied"), max_num_seqs=3, enable_prefix_caching=True, speculative_config=spec
    ) as runner:
        engine = runner.engine
        worker = engine.executor.worker
        assert isinstance(worker, Worker) and worker.tp.size == 1
        config = engine.executor.runner.config
        assert config.spare_slot_base == 3 + engine.num_snapshot_slots
        assert config.max_drafts == 2 and config.keep_sampled_hidden
        assert config.eos_token_id == engine.eos_token_id
        assert engine.executor.runner.cuda_graphs is None
        assert engine.executor.runner.mtp is None
        out = runner.generate({"prompt_token_ids": [5, 6, 7, 5, 6, 7, 5, 6]}, _greedy())
        assert len(out[0].outputs[0].token_ids) == 8
    with VllmRunner(tiny_model_dir("tied"), max_num_seqs=3) as runner:
        config = runner.engine.executor.runner.config
        assert config.max_drafts == 0 and not config.keep_sampled_hidden
        assert config.spare_slot_base == 3


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
