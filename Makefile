# Two commands for a newcomer: `make demo` (install what running needs, then generate from the
# shipped model) and `make test` (install the dev extras and Chromium too, then run the test
# suite). Both create .venv when it is missing, and print each step as it goes.
# The venv sees the system's packages, so an installed torch is reused; when there is none,
# torch==2.13.0 is installed first so that pip never pulls a multi-GB CUDA build.
#
# The C++ kernels are compiled by `setup.py build_ext --inplace`, a step of its own so that
# its line per compiled file shows (pip hides a build's output); pip then installs the package
# editable without compiling again (VLLM_MAMBA_NO_EXT=1). `make demo` builds the kernel levels
# this CPU needs (generic and its best), `make test` every level this CPU runs (the suite
# compares them); wheels and the Docker image build every level of the architecture (setup.py).

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TOOLS := $(VENV)/.tools-stamp
RUNTIME := $(VENV)/.runtime-stamp
DEV := $(VENV)/.dev-stamp
KERNEL_SOURCES := setup.py vllm_mamba/ops/cpu_isa.py $(wildcard csrc/*)
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CONVERT := .cache/llama-cpp-convert/convert_hf_to_gguf.py
LLAMA_SRC := llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp

.PHONY: install install-dev kernels browser test lint format demo clean

# The venv, torch, and the build tools (ninja compiles the kernels in parallel).
$(TOOLS):
	@echo "==> $(VENV): a virtual environment with torch and the build tools"
	test -x $(VPY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install torch==2.13.0
	$(VPY) -m pip install --progress-bar off "setuptools>=77" wheel ninja
	touch $@

# What running needs: the dependencies of pyproject.toml, not the dev extras.
$(RUNTIME): pyproject.toml setup.py | $(TOOLS)
	@echo "==> the runtime dependencies, and vllm_mamba installed editable"
	VLLM_MAMBA_NO_EXT=1 $(VPY) -m pip install --progress-bar off --no-build-isolation -e .
	touch $@

# What the tests need from pip besides: the `dev` extra (pytest, the reference libraries).
$(DEV): $(RUNTIME) pyproject.toml
	@echo "==> the dev extras (tests, lint)"
	VLLM_MAMBA_NO_EXT=1 $(VPY) -m pip install --progress-bar off --no-build-isolation -e ".[dev]"
	touch $@

# The kernels, in place (vllm_mamba/_C_<level>*.so); % is a VLLM_MAMBA_CPU_ISAS value.
$(VENV)/.kernels-%: $(KERNEL_SOURCES) | $(TOOLS)
	@echo "==> the C++ kernels ($*)"
	VLLM_MAMBA_CPU_ISAS=$* $(VPY) setup.py -q build_ext --inplace
	touch $@

kernels: $(VENV)/.kernels-native

install: $(RUNTIME) $(VENV)/.kernels-native

install-dev: $(DEV) $(VENV)/.kernels-supported $(LLAMA_CONVERT)

# llama.cpp's converter (convert_hf_to_gguf.py, its conversion/ package and gguf-py/), from the
# llama-cpp-python source package, for the GGUF tests (tests/gguf): they write tiny models as
# GGUF files with it. Only those paths are extracted; nothing is built. pip prepares the source
# package's metadata with its build backend installed in the venv (--no-build-isolation): in an
# isolated environment `--no-binary :all:` builds the backend's own dependencies from source
# first (more than ten minutes on 2 cores).
$(LLAMA_CONVERT): | $(TOOLS)
	@echo "==> llama.cpp's GGUF converter (llama-cpp-python $(LLAMA_CPP_PYTHON) source) into .cache/llama-cpp-convert"
	rm -rf .cache/llama-cpp-convert .cache/llama-cpp-sdist && mkdir -p .cache/llama-cpp-sdist .cache/llama-cpp-convert
	$(VPY) -m pip install --progress-bar off scikit-build-core
	$(VPY) -m pip download --no-deps --no-binary :all: --no-build-isolation --progress-bar off -d .cache/llama-cpp-sdist llama-cpp-python==$(LLAMA_CPP_PYTHON)
	tar -xzf .cache/llama-cpp-sdist/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C .cache/llama-cpp-convert --strip-components=3 $(LLAMA_SRC)/convert_hf_to_gguf.py $(LLAMA_SRC)/conversion $(LLAMA_SRC)/gguf-py
	rm -rf .cache/llama-cpp-sdist

# Chromium for tests/entrypoints/test_web_ui.py, through apt when it is missing; `make test`
# checks it first, and where it cannot install it, says how to and fails before installing.
browser:
	@scripts/install_chromium.sh

# The suite runs in parallel over the machine's CPUs (pytest-xdist; each worker pinned to its
# share, see tests/conftest.py), then the tests that need the whole machine (timing, thread
# counts, soak) one at a time. TEST_JOBS=1 runs the first part serially.
TEST_JOBS ?= auto

test: browser install-dev
	$(VPY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup -m "not whole_machine" tests
	$(VPY) -m pytest -q -m whole_machine tests

lint: $(DEV)
	$(VPY) -m ruff check vllm_mamba tests benchmarks scripts
	$(VPY) -m ruff format --check vllm_mamba tests benchmarks scripts

format: $(DEV)
	$(VPY) -m ruff check --fix vllm_mamba tests benchmarks scripts
	$(VPY) -m ruff format vllm_mamba tests benchmarks scripts

demo: install
	$(VENV)/bin/vllm-mamba generate "def fibonacci(n):" "class Stack:" "def read_config(path):" --max-tokens 48

clean:
	rm -rf $(VENV) build *.egg-info vllm_mamba/_C*.so
