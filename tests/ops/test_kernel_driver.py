"""The torch-free kernel headers (`csrc/vec.h`, `csrc/math.h`, `csrc/gemv.h`) at every ISA level
this CPU runs: `csrc/tests/kernel_test.cpp` compiled with the system g++ per level and run.

The driver checks each header function against scalar double-precision references and exits
nonzero on any failure. On x86-64 the levels are generic (always), avx2 (x86-64-v3) and avx512
(x86-64-v4) where /proc/cpuinfo has their features; on aarch64, neon natively. The Arm build
under qemu and the aarch64 syntax check of the extension's sources are
`scripts/arm_kernel_test.sh`.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DRIVER = ROOT / "csrc" / "tests" / "kernel_test.cpp"

# level -> (g++ flags, /proc/cpuinfo flags the CPU needs to run it)
X86_LEVELS = {
    "generic": ([], []),
    "avx2": (["-march=x86-64-v3"], ["avx2", "fma", "f16c"]),
    "avx512": (
        ["-march=x86-64-v4"],
        ["avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"],
    ),
}


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _levels() -> list[tuple[str, list[str]]]:
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags = _cpu_flags()
        return [
            (name, march)
            for name, (march, need) in X86_LEVELS.items()
            if all(f in flags for f in need)
        ]
    if machine in ("aarch64", "arm64"):
        return [("neon", ["-march=armv8-a"])]
    return [("generic", [])]


LEVELS = _levels()


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Compiles the driver for every level at once (about 4 s of CPU each); level -> (binary,
    compiler output), the binary missing where the compile failed."""
    cxx = shutil.which("g++")
    if cxx is None:  # the extension itself is built with g++; only a bare machine lacks it
        pytest.skip("no g++")
    out_dir = tmp_path_factory.mktemp("kernel_test")
    procs = {}
    for level, march in LEVELS:
        exe = out_dir / f"kernel_test_{level}"
        cmd = [cxx, "-O2", "-std=c++17", *march, str(DRIVER), "-o", str(exe)]
        procs[level] = (
            exe,
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True),
        )
    result = {}
    for level, (exe, proc) in procs.items():
        log, _ = proc.communicate(timeout=180)
        result[level] = (exe if proc.returncode == 0 else out_dir / "missing", log)
    return result


@pytest.mark.parametrize("level", [name for name, _ in LEVELS])
def test_kernel_headers(level: str, builds: dict[str, tuple[Path, str]]) -> None:
    exe, log = builds[level]
    assert exe.exists(), f"compiling the driver for {level} failed:\n{log}"
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"kernel_test ({level}) exited {done.returncode}:\n{out}"
    assert f"vec level: {level}" in out, out
    assert " 0 failures" in out, out
