# vllm_mamba, CPU build: `vllm-mamba serve` on 0.0.0.0:8000 as a non-root user.
#
#   docker build -t vllm-mamba:cpu .
#   docker run --rm -p 8000:8000 -v hf-cache:/cache/huggingface vllm-mamba:cpu            # shipped model
#   docker run --rm -p 8000:8000 -v hf-cache:/cache/huggingface -e VLLM_MAMBA_API_KEY=KEY \
#       vllm-mamba:cpu state-spaces/mamba-130m-hf --dtype float32
#
# Arguments after the image name replace CMD (the model and any `serve` flags); the entry point
# keeps --host 0.0.0.0 --port 8000. See docs/deploy.md.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: torch (CPU wheel) and the package with its C++ kernels, in /opt/venv ---
FROM ${PYTHON_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The project's torch pin (Makefile), from PyTorch's CPU index so no CUDA libraries come along.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url ${TORCH_INDEX_URL} torch==${TORCH_VERSION} \
    && pip install "setuptools>=77" wheel ninja
WORKDIR /src
COPY pyproject.toml setup.py README.md LICENSE ./
COPY csrc ./csrc
COPY vllm_mamba ./vllm_mamba
# Every kernel level of the build machine's architecture (`all`, setup.py), so the image runs
# on any CPU of that architecture; the engine picks the best one at startup. Override to build
# fewer, e.g. --build-arg VLLM_MAMBA_CPU_ISAS=avx2,avx512 (or `native`: this machine's).
# The kernels compile first in a step of their own, in parallel, a line per file (pip would
# hide them); `pip install .` then finds them built (build/) and compiles nothing again.
ARG VLLM_MAMBA_CPU_ISAS=all
RUN set -eu; \
    export VLLM_MAMBA_CPU_ISAS; \
    case "$(uname -m)" in \
        x86_64) all=generic,avx2,avx512 ;; \
        aarch64) all=neon ;; \
        *) all=generic ;; \
    esac; \
    case "$VLLM_MAMBA_CPU_ISAS" in \
        all) isas=$all ;; \
        native|supported) isas= ;; \
        *) isas=$VLLM_MAMBA_CPU_ISAS ;; \
    esac; \
    python setup.py -q build_ext; \
    pip install --no-build-isolation . ; \
    cd / && for level in $(echo "$isas" | tr , ' '); do \
        python -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm_mamba._C_$level') is None)" \
            || { echo "kernel level $level was not built" >&2; exit 1; }; \
    done; \
    python -c "import sys; from vllm_mamba.ops import cpu_isa; level = cpu_isa.active_level(); \
print('kernels of this machine:', level); sys.exit(level is None)"

# --- runtime: the venv, libgomp for the kernels' OpenMP, a non-root user ---
FROM ${PYTHON_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 1000 --shell /usr/sbin/nologin vllm \
    && mkdir -p /cache/huggingface \
    && chown vllm:vllm /cache/huggingface
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/cache/huggingface
# Downloaded checkpoints live here: mount a volume so they survive the container.
VOLUME ["/cache/huggingface"]
USER vllm
WORKDIR /home/vllm
EXPOSE 8000
# Plain http on the container's own port; with --ssl-keyfile/--ssl-certfile give
# `docker run --health-cmd ...` an https check instead (docs/deploy.md).
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status != 200)"]
ENTRYPOINT ["vllm-mamba", "serve", "--host", "0.0.0.0", "--port", "8000"]
CMD ["vllm-mamba/tiny-stdlib"]
