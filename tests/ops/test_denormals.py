"""Denormal floats are flushed to zero in every thread of torch's intra-op pool once an engine
starts on the CPU, including pool threads that existed before (`csrc/denormals.cpp`)."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import torch
torch.set_num_threads(2)
x = torch.full((1 << 22,), 1e-39)
(x * 1.0).sum()  # the pool's threads exist before the engine does
from vllm_mamba.ops.cpu_kernels import flush_denormals
before = int(((x * 1.0) != 0).sum())
flush_denormals()
after = int(((x * 1.0) != 0).sum())
print(before, after)
"""


def test_every_pool_thread_flushes_denormals() -> None:
    # A fresh process: the flags are per thread and would leak into other tests.
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    before, after = map(int, done.stdout.split())
    assert before > 0  # denormals survive a multiply without the flags
    assert after == 0
