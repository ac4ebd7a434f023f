"""Builds vllm_mamba, with the C++ CPU kernels in csrc/ as torch extensions, one per ISA level.

The same sources compile once per level into `vllm_mamba._C_<level>`: on x86-64 `generic`
(the baseline x86-64 ISA), `avx2` (x86-64-v3: AVX2, FMA, F16C) and `avx512` (x86-64-v4:
AVX-512 F/BW/CD/DQ/VL); on aarch64 `neon` (armv8-a). At run time `vllm_mamba/ops/cpu_isa.py`
imports the best build the CPU supports (`VLLM_MAMBA_CPU_ISA` forces a lower one), so a wheel
built on one machine runs on any CPU of its architecture. Nothing is built with
`-march=native`.

The extensions compile against the installed torch, so install with
`pip install --no-build-isolation -e .` after torch. Build-time switches:
`VLLM_MAMBA_NO_EXT=1` skips the extensions (the pure-PyTorch references then run);
`VLLM_MAMBA_CPU_ISAS=avx2,avx512` builds only the listed levels (for quicker local builds).
"""

import glob
import os
import platform

from setuptools import setup

# Compiler flags of each level, per machine architecture.
ISA_FLAGS = {
    "x86_64": {
        "generic": ["-march=x86-64", "-mtune=generic"],
        "avx2": ["-march=x86-64-v3", "-mtune=generic"],
        "avx512": ["-march=x86-64-v4", "-mtune=generic"],
    },
    "aarch64": {"neon": ["-march=armv8-a"]},
}


def _levels() -> dict[str, list[str]]:
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    levels = ISA_FLAGS.get(machine, {"generic": []})
    wanted = os.environ.get("VLLM_MAMBA_CPU_ISAS", "").strip()
    if wanted:
        names = [n.strip() for n in wanted.split(",") if n.strip()]
        unknown = sorted(set(names) - set(levels))
        if unknown:
            raise ValueError(
                f"VLLM_MAMBA_CPU_ISAS: {unknown} are not levels of {machine}; use {sorted(levels)}"
            )
        levels = {n: levels[n] for n in names}
    return levels


def _ext_modules() -> tuple[list, dict]:
    sources = sorted(glob.glob("csrc/*.cpp"))
    if os.environ.get("VLLM_MAMBA_NO_EXT") == "1" or not sources:
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}

    class BuildPerLevel(BuildExtension):
        """Compiles each level's objects in a build directory of its own: the levels share
        their source paths, and would otherwise overwrite each other's objects."""

        def build_extension(self, ext):  # noqa: ANN001, ANN202
            base = self.build_temp
            self.build_temp = os.path.join(base, ext.name.rsplit(".", 1)[-1])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = base

    exts = [
        CppExtension(
            f"vllm_mamba._C_{level}",
            sources,
            extra_compile_args=["-O3", "-fopenmp", "-std=c++17", *flags],
            extra_link_args=["-fopenmp"],
        )
        for level, flags in _levels().items()
    ]
    return exts, {"build_ext": BuildPerLevel}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
