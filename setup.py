"""Builds vllm_mamba, with the C++ CPU kernels in csrc/ as torch extensions, one per ISA level.

The same sources compile once per level into `vllm_mamba._C_<level>`: on x86-64 `generic`
(the baseline x86-64 ISA), `avx2` (x86-64-v3: AVX2, FMA, F16C) and `avx512` (x86-64-v4:
AVX-512 F/BW/CD/DQ/VL); on aarch64 `neon` (armv8-a). At run time `vllm_mamba/ops/cpu_isa.py`
imports the best build the CPU supports (`VLLM_MAMBA_CPU_ISA` forces a lower one) and falls
back to the next lower level whose build is there. Nothing is built with `-march=native`.

Which levels are built, `VLLM_MAMBA_CPU_ISAS`:

- `native`, the default of a local build (`pip install -e .`, `setup.py build_ext --inplace`):
  `generic` and the best level this CPU runs (the levels of `cpu_isa.supported_levels()`);
- `supported`: every level this CPU runs (what `tests/ops/test_cpu_isa.py` compares);
- `all`, the default of a wheel (`pip wheel .`, `pip install .`) and of the Docker image:
  every level of the architecture, so the wheel runs on any CPU of it;
- a list, e.g. `avx2,avx512`.

The files compile in parallel (ninja, `MAX_JOBS` caps the jobs) with one line per compiled
file and the total time at the end (`VLLM_MAMBA_BUILD_VERBOSE=1` adds the compiler's warnings;
a failed file's errors always show); pip hides these lines unless run with `-v`, so `make`
runs `python setup.py build_ext --inplace` itself. The extensions compile against the
installed torch: install with `pip install --no-build-isolation -e .` after torch.
`VLLM_MAMBA_NO_EXT=1` skips the extensions (the pure-PyTorch references then run).
"""

import glob
import importlib.util
import os
import platform
import re
import subprocess
import sys
import time

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))

# Compiler flags of each level, per machine architecture.
ISA_FLAGS = {
    "x86_64": {
        "generic": ["-march=x86-64", "-mtune=generic"],
        "avx2": ["-march=x86-64-v3", "-mtune=generic"],
        "avx512": ["-march=x86-64-v4", "-mtune=generic"],
    },
    "aarch64": {"neon": ["-march=armv8-a"]},
}
ENV_VAR = "VLLM_MAMBA_CPU_ISAS"
WHEEL_COMMANDS = ("bdist_wheel", "bdist", "sdist", "bdist_egg")


def _cpu_levels() -> tuple[str, ...]:
    """The levels this CPU runs, lowest first, as the runtime decides them (`cpu_isa.py`,
    loaded from its file: the package itself cannot be imported before it is built)."""
    path = os.path.join(ROOT, "vllm_mamba", "ops", "cpu_isa.py")
    spec = importlib.util.spec_from_file_location("_vllm_mamba_build_cpu_isa", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.supported_levels()


def _levels() -> dict[str, list[str]]:
    machine = platform.machine().lower()
    machine = {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)
    levels = ISA_FLAGS.get(machine, {"generic": []})
    building_wheel = any(cmd in sys.argv[1:] for cmd in WHEEL_COMMANDS)
    wanted = os.environ.get(ENV_VAR, "").strip().lower() or ("all" if building_wheel else "native")
    if wanted == "all":
        return dict(levels)
    if wanted in ("native", "supported"):
        runs = [name for name in _cpu_levels() if name in levels] or [next(iter(levels))]
        names = runs if wanted == "supported" else sorted({runs[0], runs[-1]}, key=runs.index)
        return {n: levels[n] for n in names}
    names = [n.strip() for n in wanted.split(",") if n.strip()]
    unknown = sorted(set(names) - set(levels))
    if unknown:
        raise ValueError(
            f"{ENV_VAR}: {unknown} are not levels of {machine}; use a list of "
            f"{sorted(levels)}, or native, supported or all"
        )
    return {n: levels[n] for n in names}


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def _say(line: str) -> None:
    print(line, flush=True)


def _ext_modules() -> tuple[list, dict]:
    sources = sorted(glob.glob("csrc/*.cpp"))
    if os.environ.get("VLLM_MAMBA_NO_EXT") == "1" or not sources:
        return [], {}
    try:
        import torch.utils.cpp_extension as cpp_extension
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        return [], {}
    headers = sorted(glob.glob("csrc/*.h"))
    levels = _levels()

    class BuildPerLevel(BuildExtension):
        """Compiles each level's objects in a build directory of its own (the levels share
        their source paths, and would otherwise overwrite each other's objects), in parallel
        through ninja, printing a line per compiled file and the total at the end."""

        def build_extensions(self) -> None:
            self._started = time.monotonic()
            self._done = 0
            self._total = len(sources) * len(self.extensions)
            names = ", ".join(ext.name.rsplit("_", 1)[-1] for ext in self.extensions)
            jobs = os.environ.get("MAX_JOBS") or f"{os.cpu_count()} CPUs"
            _say(
                f"vllm_mamba: building the C++ kernels for {names} "
                f"({len(sources)} files per level, {jobs}; {ENV_VAR}=all|supported|native|"
                "a list chooses the levels)"
            )
            if not self.use_ninja:
                _say("  ninja is not installed (pip install ninja): one file at a time, silently")
            if self.inplace:
                self._drop_stale_builds()
            super().build_extensions()
            compiled = f"{self._done} files compiled" if self.use_ninja else "compiled"
            _say(
                f"vllm_mamba: {compiled}, kernels {names} ready in "
                f"{_duration(time.monotonic() - self._started)}"
            )

        def build_extension(self, ext) -> None:  # noqa: ANN001
            level = ext.name.rsplit("_", 1)[-1]
            base = self.build_temp
            self.build_temp = os.path.join(base, level)
            run_ninja = cpp_extension._run_ninja_build

            def ninja(build_dir: str, *_, **__) -> None:  # torch's (build_dir, verbose, prefix)
                self._ninja(build_dir, level)

            cpp_extension._run_ninja_build = ninja
            try:
                if not self._outdated(ext):
                    _say(f"  {level}: up to date")
                super().build_extension(ext)
            finally:
                cpp_extension._run_ninja_build = run_ninja
                self.build_temp = base

        def _outdated(self, ext) -> bool:  # noqa: ANN001
            path = self.get_ext_fullpath(ext.name)
            if self.force or not os.path.exists(path):
                return True
            built = os.path.getmtime(path)
            return any(os.path.getmtime(f) > built for f in [*ext.sources, *ext.depends])

        def _drop_stale_builds(self) -> None:
            """Removes in-place builds of levels not built now whose sources changed since:
            the runtime would import such a build before a lower, up-to-date one."""
            newest = max(os.path.getmtime(f) for f in [*sources, *headers])
            built = {ext.name.rsplit("_", 1)[-1] for ext in self.extensions}
            for path in glob.glob(os.path.join(ROOT, "vllm_mamba", "_C_*.so")):
                level = os.path.basename(path)[3:].split(".", 1)[0]
                if level not in built and os.path.getmtime(path) < newest:
                    _say(f"  removing {os.path.relpath(path, ROOT)}: older than the sources")
                    os.remove(path)

        def _ninja(self, build_dir: str, level: str) -> None:
            """Runs ninja on torch's build file: a line per compiled file; the compiler's
            messages only of a file that failed (torch's headers warn at every file), unless
            VLLM_MAMBA_BUILD_VERBOSE=1."""
            verbose = os.environ.get("VLLM_MAMBA_BUILD_VERBOSE") == "1"
            cmd = ["ninja", "-j", os.environ.get("MAX_JOBS") or str((os.cpu_count() or 1) + 2)]
            env = dict(os.environ, NINJA_STATUS="@@ninja@@ ")
            sys.stdout.flush()
            proc = subprocess.Popen(
                cmd, cwd=build_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                text=True, errors="replace",
            )  # fmt: skip
            failed = False
            for line in proc.stdout:
                if line.startswith("@@ninja@@ "):
                    source = re.search(r" (\S+\.cpp) -o ", line)
                    name = os.path.relpath(source.group(1), ROOT) if source else line[10:80]
                    self._done += 1
                    elapsed = _duration(time.monotonic() - self._started)
                    width = len(str(self._total))
                    _say(f"  [{self._done:{width}d}/{self._total}] {level:8s} {name}  ({elapsed})")
                    continue
                failed = failed or line.startswith(("FAILED:", "ninja: build stopped"))
                if line.startswith("ninja: no work to do"):
                    _say(f"  {level}: objects up to date")
                elif failed or verbose:
                    print(line, end="", flush=True)
            if proc.wait() != 0:
                raise RuntimeError(f"compiling the {level} kernels failed (the errors are above)")

    exts = [
        CppExtension(
            f"vllm_mamba._C_{level}",
            sources,
            depends=headers,
            # -g0: no debug info (Python's flags carry -g), which only slowed the build
            extra_compile_args=["-O3", "-g0", "-fopenmp", "-std=c++17", *flags],
            extra_link_args=["-fopenmp"],
        )
        for level, flags in levels.items()
    ]
    return exts, {"build_ext": BuildPerLevel}


ext_modules, cmdclass = _ext_modules()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
