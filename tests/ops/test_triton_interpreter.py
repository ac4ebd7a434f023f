"""Every Triton kernel test module's CPU tests, in one child pytest process under the Triton
interpreter.

`TRITON_INTERPRET=1` only takes effect when it is set before triton is first imported (triton's
own `tl.sum`, `tl.sigmoid`, ... are jitted at import), so a process that imported triton without
it (a plain `pytest tests`) cannot interpret kernels: there the modules' CPU cases are not
collected (their devices are `cuda` only) and this test runs them all in a child pytest process
started with it, where they run in-process. One child for every module pays the imports of
torch and triton once.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")

HERE = Path(__file__).resolve().parent
MODULES = sorted(p for p in HERE.glob("test_triton_*.py") if p.name != Path(__file__).name)


def test_triton_kernels_in_the_interpreter() -> None:
    assert len(MODULES) >= 8, MODULES  # every kernel family's module is found
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("VLLM_MAMBA_OPS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not cuda"]
    proc = subprocess.run(
        [*cmd, *map(str, MODULES)],
        cwd=HERE.parents[1], env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.split("\n")[-2], proc.stdout[
        -2000:
    ]
