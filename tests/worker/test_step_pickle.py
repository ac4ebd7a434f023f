"""A step is plain data: every step an engine runs, pickled and sent to another process (spawned,
so it shares nothing with this one), runs on a `Worker` built there on the same checkpoint and
gives exactly the `StepResult` the engine got in its own process.

The workload makes the steps carry what a step can carry: prefill chunks and decodes of a
hybrid (block tables, copy-on-write KV block copies of forks), forks (`n > 1`), seeded sampling
(the generators live in each worker, made from the seed in the step), a grammar (its bitmask
filled on the engine's side), prompt logprobs, prefix-cache snapshots and hits (state copies,
a prompt logprob scored from a saved hidden row), and n-gram speculative chains (drafts,
verification, rollbacks from the spare slots, one of them made by the next step after a stop
token cut an accepted run).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.helpers.runners import VllmRunner
from tests.helpers.spec_oracle import OracleProposer
from tests.tiny_models import tiny_model_dir
from vllm_mamba import SamplingParams
from vllm_mamba.distributed.parallel_state import SINGLE
from vllm_mamba.executor.uniproc import UniProcExecutor
from vllm_mamba.sampling_params import StructuredOutputsParams
from vllm_mamba.worker.step import Step, StepResult
from vllm_mamba.worker.worker import Worker

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ENGINE = dict(
    device="cpu",
    threads=1,  # a fixed thread count on both sides (no governor): the same float sums
    enable_prefix_caching=True,
    speculative_config=NGRAM,
    max_num_batched_tokens=40,
    block_size=16,
    prefix_snapshot_interval=16,
)


def run_steps_elsewhere(
    config: Any, num_slots: int, sizing: Any, runner_config: Any, steps: list[bytes]
) -> list[bytes]:
    """In a spawned process: a `Worker` on the same checkpoint, its caches and runner as the
    engine's, then every pickled step in order; the pickled results."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_worker_main, args=(child, config, num_slots, sizing, runner_config, steps)
    )
    proc.start()
    child.close()
    try:
        kind, payload = parent.recv()
    finally:
        proc.join(60)
    assert kind == "ok", payload
    return payload


def _worker_main(
    conn: Any, config: Any, num_slots: int, sizing: Any, runner_config: Any, steps: list[bytes]
) -> None:
    try:
        worker = Worker(config, SINGLE, torch.device("cpu"))
        worker.init_caches(num_slots, sizing)
        worker.init_runner(runner_config)
        results = [pickle.dumps(worker.execute(pickle.loads(data))) for data in steps]
        conn.send(("ok", results))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        import traceback

        conn.send(("error", f"{err!r}\n{traceback.format_exc()}"))


def plain(value: Any) -> Any:
    """A result as nested tuples of plain values (tensors as their values and dtypes), so two
    results compare exactly with `==`."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.flatten().tolist())
    if isinstance(value, dict):
        return tuple(sorted((k, plain(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return tuple(plain(v) for v in value)
    if hasattr(value, "__dataclass_fields__"):
        return (type(value).__name__, plain(vars(value)))
    return value


def test_pickled_steps_run_in_another_process(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[tuple[bytes, bytes]] = []
    original = UniProcExecutor.execute

    def record(self: UniProcExecutor, step: Step) -> StepResult:
        data = pickle.dumps(step)
        result = original(self, step)
        recorded.append((data, pickle.dumps(result)))
        return result

    path = tiny_model_dir("qwen3_5-gqa")
    echo = [7, 8, 9, 10, 11, 12] * 4
    with VllmRunner(path, device="cpu", threads=1) as plain_runner:
        ref = plain_runner.generate({"prompt_token_ids": echo}, GREEDY)[0].outputs[0].token_ids
    monkeypatch.setattr(UniProcExecutor, "execute", record)  # from the engine's warm-up on
    system = list(range(300, 340))
    prompts = [
        {"prompt_token_ids": echo},
        {"prompt_token_ids": [20, 21, 22, 20, 21, 22, 20, 21]},
        {"prompt_token_ids": system + [5, 6, 7]},
    ]
    params = [
        # A stop token inside an accepted run: the engine cuts the chain (a rollback).
        SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, stop_token_ids=[ref[6]]),
        SamplingParams(temperature=0.9, n=2, seed=7, max_tokens=8, logprobs=1, ignore_eos=True),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=8,
            structured_outputs=StructuredOutputsParams(choice=["yes", "no", "maybe so"]),
        ),
    ]
    hit_params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=1)
    with VllmRunner(path, **ENGINE) as runner:
        # Drafts: the greedy continuation of the echo prompt, every third one made wrong.
        runner.engine.spec_steps.proposer = OracleProposer({tuple(echo): ref}, every=3)
        runner.generate(prompts, params)
        runner.generate({"prompt_token_ids": system + [8, 9]}, hit_params)
        runner.generate({"prompt_token_ids": system + [10, 11]}, hit_params)
        engine = runner.engine
        config, runner_config = engine.config, engine.executor.runner.config
        num_slots = engine.cache.num_slots
        sizing = engine.kv_cache.sizing if engine.kv_cache is not None else None
    steps = [pickle.loads(data) for data, _ in recorded]
    seqs = [s for step in steps for s in step.seqs]
    samples = [spec for s in seqs for spec in s.samples]
    # The workload's steps carry every kind of field.
    assert any(s.is_spec for s in seqs) and any(s.forks for s in seqs)
    assert any(s.block_table for s in seqs) and any(step.block_copies for step in steps)
    assert any(spec.seed is not None for spec in samples)
    assert any(spec.bitmask is not None for spec in samples)
    assert any(s.prompt_logprobs is not None for s in seqs)
    assert any(step.snapshots for step in steps) and any(step.state_copies for step in steps)
    assert any(step.hidden_logprobs for step in steps)
    assert any(step.rollbacks for step in steps)
    assert any(step.finished_seq_ids for step in steps) and steps[0].reset_generator is False
    assert any(step.reset_generator for step in steps)

    results = run_steps_elsewhere(
        config, num_slots, sizing, runner_config, [data for data, _ in recorded]
    )
    assert len(results) == len(recorded)
    for i, (theirs, (_, ours)) in enumerate(zip(results, recorded)):
        assert plain(pickle.loads(theirs)) == plain(pickle.loads(ours)), f"step {i}"
    spec_results = [pickle.loads(r) for _, r in recorded]
    assert any(r.spec for r in spec_results) and any(r.hidden_logprobs for r in spec_results)


def test_worker_package_never_imports_the_engine() -> None:
    """The worker runs a step from its data alone: importing every worker module pulls in no
    `vllm_mamba.engine` module (no `Sequence`, scheduler or grammar matcher)."""
    code = (
        "import sys\n"
        "import vllm_mamba.worker.worker, vllm_mamba.worker.model_runner\n"
        "import vllm_mamba.worker.step, vllm_mamba.worker.relay\n"
        "bad = sorted(m for m in sys.modules if m.startswith('vllm_mamba.engine'))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
