"""How many CPU threads the model's kernels run on, and how that follows a shared machine.

- `--threads N` (`EngineArgs.threads`, every entry point): torch's intra-op pool and the C++
  kernels (which size their OpenMP teams from it) run exactly `N` threads.
- By default each rank starts with one thread per CPU this process may run on (its affinity
  mask: a container or `taskset` limit counts), shared among the tensor-parallel ranks of one
  machine, and then follows the load: a kernel splits each stage over its threads and meets at
  a barrier, so when another process keeps one of those CPUs busy, the thread the scheduler
  parks there holds every barrier for a time slice (single-stream decode fell from about 2,000
  to 200-400 tokens/s on two cores with a busy loop on one). `ThreadGovernor` samples
  `/proc/stat` twice a second, subtracts this process's own CPU time, and runs one thread
  fewer for each CPU other processes keep busy (never fewer than one), and more again when
  they leave. A change needs two samples in a row that agree, so a short burst changes
  nothing. OpenMP's own waiting (spin, then sleep) is left at its defaults: bounding the spin
  (`GOMP_SPINCOUNT=0` or `OMP_WAIT_POLICY=passive`) rescues the busy case but makes every
  barrier of the idle case a futex wake (single-stream decode 2,500 -> 600 tokens/s).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 0.5
AGREEING_SAMPLES = 2


def available_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity mask, else all of the machine's)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def default_threads(ranks_per_machine: int = 1) -> int:
    """The default thread count: the available CPUs shared among the machine's ranks."""
    return max(1, len(available_cpus()) // max(1, ranks_per_machine))


def set_cpu_threads(threads: int) -> int:
    """Sizes torch's intra-op pool (and so the C++ kernels' teams) for this process."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads


@dataclass
class CpuTimes:
    """Cumulative CPU seconds: busy on the watched CPUs, and used by this process."""

    busy_s: float
    own_s: float


def read_cpu_times(cpus: list[int]) -> CpuTimes | None:
    """Busy seconds of `cpus` from `/proc/stat` and this process's from `/proc/self/stat`
    (None where `/proc` is not Linux's)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        wanted = {f"cpu{c}" for c in cpus}
        busy = 0
        with open("/proc/stat") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] in wanted:
                    # user nice system idle iowait irq softirq steal ...
                    values = [int(v) for v in fields[1:9]]
                    busy += sum(values) - values[3] - values[4]
        with open("/proc/self/stat") as f:
            stat = f.read().rsplit(")", 1)[1].split()
        own = int(stat[11]) + int(stat[12])  # utime, stime (fields 14, 15)
        return CpuTimes(busy / tick, own / tick)
    except (OSError, ValueError, IndexError):
        return None


class ThreadGovernor:
    """Runs one kernel thread per CPU that other processes leave free (see the module
    docstring). Call `maybe_adjust` between steps, on the engine's thread.

    Args:
        max_threads: the most threads (the default thread count).
        cpus: the CPUs watched.
        apply: sets the thread count (torch's, by default).
        read: reads the CPU times (from `/proc`, by default).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        max_threads: int,
        cpus: list[int],
        apply: Callable[[int], int] = set_cpu_threads,
        read: Callable[[list[int]], CpuTimes | None] = read_cpu_times,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max_threads
        self.cpus = cpus
        self.apply = apply
        self.read = read
        self.clock = clock
        self.threads = max_threads
        self._last = (clock(), read(cpus))
        self._pending: tuple[int, int] | None = None  # (target, samples agreeing)

    def target(self, foreign_cpus: float) -> int:
        """The thread count when other processes keep `foreign_cpus` CPUs busy."""
        return max(1, min(self.max_threads, self.max_threads - int(foreign_cpus + 0.5)))

    def maybe_adjust(self) -> int:
        """Samples the load when the interval has passed and changes the thread count once
        two samples agree; returns the count in use."""
        now = self.clock()
        last_time, last = self._last
        if now - last_time < SAMPLE_INTERVAL_S:
            return self.threads
        times = self.read(self.cpus)
        self._last = (now, times)
        if times is None or last is None:
            return self.threads
        wall = now - last_time
        foreign = max(0.0, (times.busy_s - last.busy_s) - (times.own_s - last.own_s))
        target = self.target(foreign / wall)
        if target == self.threads:
            self._pending = None
            return self.threads
        agreeing = self._pending[1] + 1 if self._pending and self._pending[0] == target else 1
        self._pending = (target, agreeing)
        if agreeing >= AGREEING_SAMPLES:
            logger.info(
                "CPU threads %d -> %d (other processes keep %.1f of %d CPUs busy)",
                self.threads,
                target,
                foreign / wall,
                len(self.cpus),
            )
            self.threads = self.apply(target)
            self._pending = None
        return self.threads
