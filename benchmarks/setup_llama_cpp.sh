#!/usr/bin/env bash
# Builds llama.cpp's benchmark tools from the llama-cpp-python source package and converts the
# benchmark model to GGUF, for benchmarks/compare.py. Documentation and automation: never run
# in CI, and nothing it makes belongs in the repository.
#
#   benchmarks/setup_llama_cpp.sh [MODEL_DIR]     (default /tmp/mamba-130m-random)
#
# Layout under $LLAMA_CPP_HOME (default /tmp/llamacpp), which compare.py reads:
#   llama_cpp_python-<version>/vendor/llama.cpp   sources (with convert_hf_to_gguf.py)
#   bin/llama-bench, bin/llama-batched-bench      links to the tools built with cmake
#   gguf/<model dir name>-{f32,bf16,f16,q8_0}.gguf     the converted model
#
# Set INSTALL_PYTHON_PACKAGE=1 to also `pip install llama-cpp-python` (builds llama.cpp once
# more, about 5+ minutes on 2 cores). Steps already done are skipped.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL_DIR="${1:-/tmp/mamba-130m-random}"
LLAMA_CPP_HOME="${LLAMA_CPP_HOME:-/tmp/llamacpp}"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"

mkdir -p "$LLAMA_CPP_HOME/bin" "$LLAMA_CPP_HOME/gguf"
cd "$LLAMA_CPP_HOME"

# 1. The benchmark model (random weights, mamba-130m-hf shape, GPT-NeoX tokenizer).
if [ ! -f "$MODEL_DIR/config.json" ]; then
    "$PYTHON" "$REPO_ROOT/benchmarks/make_model.py" "$MODEL_DIR"
fi

# 2. The llama-cpp-python source package, which vendors llama.cpp.
if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: llama-cpp-python -d .
fi
SDIST="$(ls llama_cpp_python-*.tar.gz | sort -V | tail -1)"
SRC_DIR="${SDIST%.tar.gz}"
[ -d "$SRC_DIR" ] || tar xzf "$SDIST"
LLAMA_DIR="$LLAMA_CPP_HOME/$SRC_DIR/vendor/llama.cpp"

# 3. llama-bench and llama-batched-bench, tuned for this CPU (GGML_NATIVE).
if [ ! -x "$LLAMA_DIR/build/bin/llama-batched-bench" ]; then
    GENERATOR=()
    command -v ninja >/dev/null && GENERATOR=(-G Ninja)
    cmake -S "$LLAMA_DIR" -B "$LLAMA_DIR/build" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build "$LLAMA_DIR/build" -j "$JOBS" --target llama-bench llama-batched-bench
fi
ln -sf "$LLAMA_DIR/build/bin/llama-bench" "$LLAMA_DIR/build/bin/llama-batched-bench" bin/

# 4. GGUF files: F32 for the float32 table, BF16 and F16 for the bfloat16 one, Q8_0 for the
#    int8 one. The converter needs gguf-py (vendored beside it), numpy, torch, safetensors and
#    transformers.
STEM="$(basename "$(realpath "$MODEL_DIR")")"
for TYPE in f32 bf16 f16 q8_0; do
    OUT="gguf/$STEM-$TYPE.gguf"
    [ -f "$OUT" ] || PYTHONPATH="$LLAMA_DIR/gguf-py" "$PYTHON" "$LLAMA_DIR/convert_hf_to_gguf.py" "$MODEL_DIR" \
        --outtype "$TYPE" --outfile "$OUT"
done

# 5. Optionally the Python package (its own copy of llama.cpp, built by pip).
if [ "${INSTALL_PYTHON_PACKAGE:-0}" = 1 ]; then
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$PYTHON" -m pip install llama-cpp-python
fi

echo "llama.cpp tools in $LLAMA_CPP_HOME/bin, GGUF files in $LLAMA_CPP_HOME/gguf"
bin/llama-bench --help | head -1 || true
