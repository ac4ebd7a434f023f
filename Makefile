# Two commands for a newcomer: `make demo` (install, then generate from the shipped model)
# and `make test` (install, then run the test suite). Both create .venv when it is missing.
# The venv sees the system's packages, so an installed torch is reused; when there is none,
# torch==2.13.0 is installed first so that pip never pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install test lint format demo bench clean

$(STAMP): pyproject.toml setup.py $(wildcard csrc/*)
	test -x $(VPY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(VPY) -c "import torch" 2>/dev/null || $(VPY) -m pip install torch==2.13.0
	$(VPY) -m pip install -q "setuptools>=64" wheel
	$(VPY) -m pip install -q --no-build-isolation -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The suite runs in parallel over the machine's CPUs (pytest-xdist; each worker pinned to its
# share, see tests/conftest.py), then the tests that need the whole machine (timing, thread
# counts, soak) one at a time. TEST_JOBS=1 runs the first part serially.
TEST_JOBS ?= auto

test: install
	$(VPY) -m pytest -q -n $(TEST_JOBS) --dist loadgroup -m "not whole_machine" tests
	$(VPY) -m pytest -q -m whole_machine tests

lint: install
	$(VPY) -m ruff check vllm_mamba tests benchmarks scripts
	$(VPY) -m ruff format --check vllm_mamba tests benchmarks scripts

format: install
	$(VPY) -m ruff check --fix vllm_mamba tests benchmarks scripts
	$(VPY) -m ruff format vllm_mamba tests benchmarks scripts

demo: install
	$(VENV)/bin/vllm-mamba generate "def fibonacci(n):" "class Stack:" "def read_config(path):" --max-tokens 48

clean:
	rm -rf $(VENV) build *.egg-info vllm_mamba/_C*.so
