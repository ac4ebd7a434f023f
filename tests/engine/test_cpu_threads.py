"""CPU threads: `--threads` fixes the count; by default the worker follows the CPUs other
processes leave free (`worker/cpu_threads.py`, set up by `worker/platform.py`), checked with
scripted `/proc` readings and on the real `/proc`, whatever the machine's CPU count."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from tests.tiny_models import tiny_model_dir
from vllm_mamba import LLM, SamplingParams
from vllm_mamba.worker.cpu_threads import (
    AGREEING_SAMPLES,
    SAMPLE_INTERVAL_S,
    CpuTimes,
    ThreadGovernor,
    available_cpus,
    default_threads,
    read_cpu_times,
)

pytestmark = pytest.mark.whole_machine  # thread counts on the real /proc, every CPU


class Script:
    """A clock and CPU-time readings advanced by hand: `tick(foreign, own)` moves half a
    second on which other processes used `foreign` CPUs and this one `own`."""

    def __init__(self) -> None:
        self.now = 0.0
        self.busy = 0.0
        self.own = 0.0

    def tick(self, foreign: float, own: float = 1.0) -> None:
        self.now += SAMPLE_INTERVAL_S
        self.busy += (foreign + own) * SAMPLE_INTERVAL_S
        self.own += own * SAMPLE_INTERVAL_S

    def read(self, cpus: list[int]) -> CpuTimes:
        return CpuTimes(self.busy, self.own)


def governor(max_threads: int) -> tuple[ThreadGovernor, Script, list[int]]:
    script, applied = Script(), []

    def apply(n: int) -> int:
        applied.append(n)
        return n

    g = ThreadGovernor(
        max_threads, list(range(max_threads)), apply, script.read, lambda: script.now
    )
    return g, script, applied


def test_governor_follows_foreign_load_after_agreeing_samples() -> None:
    g, script, applied = governor(4)
    for _ in range(3):
        script.tick(foreign=0.1)
        assert g.maybe_adjust() == 4
    script.tick(foreign=1.0)
    assert g.maybe_adjust() == 4  # one sample is not enough
    script.tick(foreign=0.1)
    assert g.maybe_adjust() == 4 and applied == []
    for _ in range(AGREEING_SAMPLES):
        script.tick(foreign=2.2)
        g.maybe_adjust()
    assert g.threads == 2 and applied == [2]
    for _ in range(AGREEING_SAMPLES):
        script.tick(foreign=9.0)
        g.maybe_adjust()
    assert g.threads == 1  # never fewer than one
    for _ in range(AGREEING_SAMPLES):
        script.tick(foreign=0.0)
        g.maybe_adjust()
    assert g.threads == 4 and applied == [2, 1, 4]


def test_governor_samples_only_once_per_interval() -> None:
    g, script, applied = governor(2)
    script.tick(foreign=1.0)
    script.now -= SAMPLE_INTERVAL_S / 2  # half an interval: no sample taken
    for _ in range(5):
        assert g.maybe_adjust() == 2
    assert applied == []


def test_real_proc_readings_count_this_process() -> None:
    cpus = available_cpus()
    assert default_threads() == len(cpus) and default_threads(len(cpus) * 2) == 1
    before = read_cpu_times(cpus)
    assert before is not None
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = read_cpu_times(cpus)
    assert after is not None
    assert after.own_s - before.own_s >= 0.2
    assert after.busy_s - before.busy_s >= after.own_s - before.own_s - 0.05


def test_threads_option_fixes_the_count_and_auto_drops_under_a_busy_process() -> None:
    """`threads=1` runs one thread and no governor; the default runs one thread per available
    CPU and, with two or more, drops a thread while a busy process holds one of them and takes
    it back when the process ends (with one CPU there is nothing to drop: no governor)."""
    llm = LLM(tiny_model_dir("tied"), threads=1)
    platform = llm.llm_engine.executor.platform
    assert torch.get_num_threads() == 1 and platform.threads == 1 and platform.governor is None
    with pytest.raises(ValueError, match="threads"):
        LLM(tiny_model_dir("tied"), threads=0)
    cpus = available_cpus()
    auto = LLM(tiny_model_dir("tied"))
    platform = auto.llm_engine.executor.platform
    assert platform.threads == len(cpus) == torch.get_num_threads()
    if len(cpus) == 1:
        assert platform.governor is None
        return
    assert platform.governor is not None
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)

    def run_for(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            auto.generate("def f(x):", params, use_tqdm=False)

    busy = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\nwhile True: pass",
        ]
    )
    try:
        run_for(3.0)
        assert platform.threads <= len(cpus) - 1  # at least the busy CPU's thread dropped
    finally:
        busy.kill()
        busy.wait()
    # Back to all once the CPU is free; allow for other work on a shared test machine.
    end = time.monotonic() + 10.0
    while platform.threads != len(cpus) and time.monotonic() < end:
        before = read_cpu_times(cpus)
        run_for(1.0)
        after = read_cpu_times(cpus)
    if platform.threads != len(cpus):
        assert before is not None and after is not None
        foreign = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
        assert foreign >= 0.5, f"{platform.threads} threads on an idle machine ({foreign:.2f} busy)"
    else:
        assert torch.get_num_threads() == len(cpus)
