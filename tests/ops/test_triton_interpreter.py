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


def test_dispatch_selects_every_triton_kernel() -> None:
    """`VLLM_MAMBA_OPS=triton` (in a fresh process, under the interpreter) binds every op that
    `triton_ops.TRITON_OPS` lists to its Triton launcher."""
    code = (
        "import importlib\n"
        "from vllm_mamba.ops.dispatch import get_mamba_ops\n"
        "from vllm_mamba.ops.triton_ops import TRITON_OPS\n"
        "ops = get_mamba_ops('cpu')\n"
        "for family, kernels in TRITON_OPS.items():\n"
        "    for op, where in kernels.items():\n"
        "        module, name = where.split(':')\n"
        "        want = getattr(importlib.import_module('vllm_mamba.ops.' + module), name)\n"
        "        assert getattr(ops.family(family), op) is want, (family, op)\n"
        "print(sum(map(len, TRITON_OPS.values())))\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1", "VLLM_MAMBA_OPS": "triton"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=HERE.parents[1], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert int(proc.stdout.split()[-1]) >= 20  # every family's kernels were checked
