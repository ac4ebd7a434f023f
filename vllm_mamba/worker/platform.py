"""The process setup a rank needs before it loads its shard, done once, in one place.

On the CPU (`Platform.setup`):
- the thread count of torch's intra-op pool and of the C++ kernels: `--threads`, else the
  CPUs this process may run on shared among the machine's ranks (`cpu_threads`);
- with the default count, more than one thread and one rank on the machine, on the rank that
  runs the steps, a `cpu_threads.ThreadGovernor` that follows the CPUs other processes leave
  free (`before_step`, between steps);
- denormal floats flushed to zero (as llama.cpp does): SSM states and activations that decay
  toward zero otherwise slow every CPU kernel by an order of magnitude.

Huge pages are not a process setting: the weights (the loader) and the caches ask for them per
allocation (`huge_pages`). On CUDA there is nothing to set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_mamba.config import EngineConfig
from vllm_mamba.ops.cpu_kernels import flush_denormals
from vllm_mamba.worker.cpu_threads import (
    ThreadGovernor,
    available_cpus,
    default_threads,
    set_cpu_threads,
)


@dataclass
class Platform:
    """What a rank set up in its process.

    Attributes:
        threads: the CPU threads in use now (0 on a GPU).
        governor: the thread governor (None when the count is fixed, off the CPU, or with more
            than one rank on the machine).
    """

    threads: int = 0
    governor: ThreadGovernor | None = None

    @classmethod
    def setup(cls, config: EngineConfig, device: torch.device, runs_steps: bool) -> Platform:
        """Sets this process up for a rank on `device` (see the module docstring).

        Args:
            runs_steps: the rank receives the engine's steps (rank 0); only it gets a
                governor, which adjusts between steps.
        """
        if device.type != "cpu":
            return cls()
        ranks = config.ranks_per_machine()
        threads = set_cpu_threads(config.cpu_threads or default_threads(ranks))
        governor = None
        if runs_steps and config.cpu_threads is None and threads > 1 and ranks == 1:
            governor = ThreadGovernor(threads, available_cpus())
        flush_denormals()
        return cls(threads, governor)

    def before_step(self) -> None:
        """Lets the governor change the thread count (fewer while other processes hold CPUs)."""
        if self.governor is not None:
            self.threads = self.governor.maybe_adjust()
