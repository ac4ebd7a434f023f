"""Builds vllm_mamba, with the C++ CPU kernels in csrc/ as the torch extension `vllm_mamba._C`.

The extension compiles against the installed torch, so install with
`pip install --no-build-isolation -e .` after torch. Set `VLLM_MAMBA_NO_EXT=1` to skip it;
the pure-PyTorch references then run.
"""

import glob
import os

from setuptools import setup


def _ext_modules() -> tuple[list, dict]:
    sources = sorted(glob.glob("csrc/*.cpp"))
    if os.environ.get("VLLM_MAMBA_NO_EXT") == "1" or not sources:
        return [], {}
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    flags = ["-O3", "-fopenmp", "-std=c++17"]
    if os.environ.get("VLLM_MAMBA_PORTABLE") != "1":
        flags.append("-march=native")
    ext = CppExtension(
        "vllm_mamba._C", sources, extra_compile_args=flags, extra_link_args=["-fopenmp"]
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
