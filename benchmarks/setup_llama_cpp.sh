#!/usr/bin/env bash
# Builds llama.cpp's benchmark tools from the llama-cpp-python source package (and
# ik_llama.cpp's, the CPU-tuned fork, from the ik-llama-cpp-python one) and converts the
# benchmark model to GGUF, for benchmarks/compare.py, hybrid_bench.py and gguf_bench.py.
# Documentation and automation: never run in CI, and nothing it makes belongs in the repository.
#
#   [LEVEL=native|avx2|avx512] benchmarks/setup_llama_cpp.sh [MODEL_DIR]
#                                                   (default /tmp/mamba-130m-random)
#
# LEVEL is the x86 instruction-set level of llama.cpp's CPU backend, so that compare.py can
# measure it against the engine forced to the same level (`compare.py --isa LEVEL`):
#   native  (default) -march=native (GGML_NATIVE=ON): everything this CPU has.
#   avx2    GGML_NATIVE=OFF, SSE4.2 + AVX + AVX2 + FMA + F16C + BMI2, no AVX-512: no zmm code.
#   avx512  as avx2 plus AVX512F/CD/VL/DQ/BW, AVX512-VBMI, AVX512-VNNI and AVX512-BF16.
# Neither builds GGML_CPU_ALL_VARIANTS / GGML_BACKEND_DL, so the one CPU backend is exactly
# the level asked for (no run-time choice of a better variant).
#
# Layout under $LLAMA_CPP_HOME (default /tmp/llamacpp for native, /tmp/llamacpp-<LEVEL>
# otherwise), which compare.py reads:
#   bin/llama-bench, bin/llama-batched-bench,     links to the tools built with cmake
#   bin/llama-quantize
#   gguf/<model dir name>-{f32,bf16,f16,q8_0,q4_0,q4_k_m}.gguf     the converted model
# The sources and the GGUF files are shared by every level and live in $LLAMA_CPP_BASE
# (default /tmp/llamacpp); a level's gguf/ is a link to $LLAMA_CPP_BASE/gguf:
#   $LLAMA_CPP_BASE/llama_cpp_python-<version>/vendor/llama.cpp   sources (convert_hf_to_gguf.py)
#   .../vendor/llama.cpp/build (native), build-avx2, build-avx512  the cmake build directories
#
# F32, BF16, F16 and Q8_0 come from convert_hf_to_gguf.py; Q4_0 and Q4_K_M (which it cannot
# write) from llama-quantize run on the F32 file. A missing model directory is made with
# `make_model.py`: `--arch mamba2` or `--arch rwkv7` when its name contains "mamba2" or
# "rwkv7", else `--arch mamba` (ARCH overrides). RWKV-7 (fla-hub's layout) converts with the
# World vocabulary file `rwkv_vocab_v20230424.txt` that make_model.py puts beside it.
#
# ik_llama.cpp (IK_LLAMA_CPP=1, the default; 0 skips it) is built the same way, at the same
# level, from the ik-llama-cpp-python source package into $IK_LLAMA_CPP_BASE (default
# /tmp/ikllamacpp), with its tools linked under $IK_LLAMA_CPP_HOME/bin (default
# /tmp/ikllamacpp for native, /tmp/ikllamacpp-<LEVEL> otherwise) and gguf/ a link to the
# same GGUF files (its llama-quantize also writes its own types, Q4_0_R8, IQ4_KS, ...). Its
# source package lacks common/cmake/build-info-gen-cpp.cmake, which common/CMakeLists.txt
# runs to write common/build-info.cpp; a four-line one is written in its place. Its tools
# are examples (LLAMA_BUILD_EXAMPLES=ON, only the three targets are built); its flash
# attention kernels for every quantised KV cache type are left out (GGML_IQK_FA_ALL_QUANTS=OFF:
# a third of the build time, unused with the default F16 cache).
#
# CONVERT_ARGS adds options to convert_hf_to_gguf.py: `--no-mtp` for a Qwen3.5 / 3.6 checkpoint
# without MTP weights (the random models of make_model.py / hybrid_bench.py), which the
# converter otherwise refuses.
#
# PRE_TOKENIZER names the BPE pre-tokenizer the converter should record where it does not
# recognise the model's tokenizer ("BPE pre-tokenizer was not recognized"): the converter of
# llama-cpp-python 0.3.36 refuses the GPT-NeoX tokenizer of the random benchmark models, whose
# earlier files recorded `olmo` (PRE_TOKENIZER=olmo; the same byte-level regex as `gpt-2`).
# TYPES lists the files to write (default "f32 bf16 f16 q8_0 q4_0 q4_k_m"); Q4_0 and Q4_K_M are
# quantised from the F32 file, or from the BF16 one where TYPES has no f32 (a 35B-A3B model's
# four layers are 17 GB in float32).
#
# Set INSTALL_PYTHON_PACKAGE=1 to also `pip install llama-cpp-python` (builds llama.cpp once
# more, about 5+ minutes on 2 cores). Steps already done are skipped.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MODEL_DIR="${1:-/tmp/mamba-130m-random}"
LEVEL="${LEVEL:-native}"
LLAMA_CPP_BASE="${LLAMA_CPP_BASE:-/tmp/llamacpp}"
JOBS="${JOBS:-$(nproc)}"
PYTHON="${PYTHON:-python3}"

# Instruction-set options of ggml's CPU backend (ggml/CMakeLists.txt,
# ggml/src/ggml-cpu/CMakeLists.txt) for each level.
COMMON_FLAGS=(-DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF)
X86_FLAGS=(-DGGML_NATIVE=OFF -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
    -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
case "$LEVEL" in
native)
    DEFAULT_HOME="$LLAMA_CPP_BASE"
    BUILD_NAME=build
    ISA_FLAGS=(-DGGML_NATIVE=ON)
    ;;
avx2)
    DEFAULT_HOME="$LLAMA_CPP_BASE-avx2"
    BUILD_NAME=build-avx2
    ISA_FLAGS=("${X86_FLAGS[@]}" -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF
        -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF)
    ;;
avx512)
    DEFAULT_HOME="$LLAMA_CPP_BASE-avx512"
    BUILD_NAME=build-avx512
    ISA_FLAGS=("${X86_FLAGS[@]}" -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
        -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON)
    ;;
*)
    echo "LEVEL must be native, avx2 or avx512, not '$LEVEL'" >&2
    exit 2
    ;;
esac
LLAMA_CPP_HOME="${LLAMA_CPP_HOME:-$DEFAULT_HOME}"

mkdir -p "$LLAMA_CPP_BASE/gguf" "$LLAMA_CPP_HOME/bin"
if [ ! -e "$LLAMA_CPP_HOME/gguf" ]; then
    ln -s "$LLAMA_CPP_BASE/gguf" "$LLAMA_CPP_HOME/gguf"
fi

# 1. The benchmark model (random weights, mamba-130m-hf or mamba2-130m shape with the
#    GPT-NeoX tokenizer, or rwkv7-0.4B-world shape with the World vocabulary).
if [ ! -f "$MODEL_DIR/config.json" ]; then
    case "$(basename "$MODEL_DIR")" in
    *mamba2*) ARCH="${ARCH:-mamba2}" ;;
    *rwkv7*) ARCH="${ARCH:-rwkv7}" ;;
    *) ARCH="${ARCH:-mamba}" ;;
    esac
    "$PYTHON" "$REPO_ROOT/benchmarks/make_model.py" "$MODEL_DIR" --arch "$ARCH"
fi

# 2. The llama-cpp-python source package, which vendors llama.cpp. Its metadata is prepared
#    with the build backend installed here where there is one (--no-build-isolation): in an
#    isolated environment `--no-binary :all:` makes pip build scikit-build-core's own
#    dependencies from source first, which took more than ten minutes on 2 cores.
NO_ISOLATION=()
"$PYTHON" -c "import scikit_build_core" 2>/dev/null && NO_ISOLATION=(--no-build-isolation)
cd "$LLAMA_CPP_BASE"
if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "${NO_ISOLATION[@]}" llama-cpp-python -d .
fi
SDIST="$(ls llama_cpp_python-*.tar.gz | sort -V | tail -1)"
SRC_DIR="${SDIST%.tar.gz}"
[ -d "$SRC_DIR" ] || tar xzf "$SDIST"
LLAMA_DIR="$LLAMA_CPP_BASE/$SRC_DIR/vendor/llama.cpp"
BUILD_DIR="$LLAMA_DIR/$BUILD_NAME"

# 3. llama-bench, llama-batched-bench and llama-quantize at the level asked for.
TOOLS=(llama-bench llama-batched-bench llama-quantize)
NEED_BUILD=0
for TOOL in "${TOOLS[@]}"; do
    [ -x "$BUILD_DIR/bin/$TOOL" ] || NEED_BUILD=1
done
if [ "$NEED_BUILD" = 1 ]; then
    GENERATOR=()
    command -v ninja >/dev/null && GENERATOR=(-G Ninja)
    cmake -S "$LLAMA_DIR" -B "$BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
        "${ISA_FLAGS[@]}" "${COMMON_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build "$BUILD_DIR" -j "$JOBS" --target "${TOOLS[@]}"
fi
for TOOL in "${TOOLS[@]}"; do
    ln -sf "$BUILD_DIR/bin/$TOOL" "$LLAMA_CPP_HOME/bin/"
done

# 4. GGUF files: F32 for the float32 table, BF16 and F16 for the bfloat16 one, Q8_0 for the
#    int8 one, Q4_0 and Q4_K_M for the int4 one. The converter needs gguf-py (vendored beside
#    it), numpy, torch, safetensors and transformers.
STEM="$(basename "$(realpath "$MODEL_DIR")")"
GGUF_DIR="$LLAMA_CPP_BASE/gguf"
TYPES="${TYPES:-f32 bf16 f16 q8_0 q4_0 q4_k_m}"
# convert_hf_to_gguf.py, its pre-tokenizer check answered by PRE_TOKENIZER where set.
CONVERTER=("$LLAMA_DIR/convert_hf_to_gguf.py")
if [ -n "${PRE_TOKENIZER:-}" ]; then
    CONVERTER=(-c "import runpy, sys
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: '$PRE_TOKENIZER'
sys.argv[0] = '$LLAMA_DIR/convert_hf_to_gguf.py'
runpy.run_path(sys.argv[0], run_name='__main__')")
fi
for TYPE in f32 bf16 f16 q8_0; do
    OUT="$GGUF_DIR/$STEM-$TYPE.gguf"
    case " $TYPES " in *" $TYPE "*) ;; *) continue ;; esac
    [ -f "$OUT" ] || PYTHONPATH="$LLAMA_DIR:$LLAMA_DIR/gguf-py" "$PYTHON" "${CONVERTER[@]}" \
        "$MODEL_DIR" --outtype "$TYPE" --outfile "$OUT" ${CONVERT_ARGS:-}
done
SOURCE="$GGUF_DIR/$STEM-f32.gguf"
[ -f "$SOURCE" ] || SOURCE="$GGUF_DIR/$STEM-bf16.gguf"
for TYPE in q4_0 q4_k_m; do
    OUT="$GGUF_DIR/$STEM-$TYPE.gguf"
    case " $TYPES " in *" $TYPE "*) ;; *) continue ;; esac
    # Written under a temporary name so that an interrupted run leaves no partial file.
    if [ ! -f "$OUT" ]; then
        "$BUILD_DIR/bin/llama-quantize" "$SOURCE" "$OUT.tmp" \
            "$(echo "$TYPE" | tr '[:lower:]' '[:upper:]')" "$JOBS"
        mv "$OUT.tmp" "$OUT"
    fi
done

# 5. ik_llama.cpp's tools, from the ik-llama-cpp-python source package, at the same level.
if [ "${IK_LLAMA_CPP:-1}" = 1 ]; then
    IK_LLAMA_CPP_BASE="${IK_LLAMA_CPP_BASE:-/tmp/ikllamacpp}"
    IK_DEFAULT_HOME="$IK_LLAMA_CPP_BASE"
    [ "$LEVEL" = native ] || IK_DEFAULT_HOME="$IK_LLAMA_CPP_BASE-$LEVEL"
    IK_LLAMA_CPP_HOME="${IK_LLAMA_CPP_HOME:-$IK_DEFAULT_HOME}"
    mkdir -p "$IK_LLAMA_CPP_BASE" "$IK_LLAMA_CPP_HOME/bin"
    [ -e "$IK_LLAMA_CPP_HOME/gguf" ] || ln -s "$LLAMA_CPP_BASE/gguf" "$IK_LLAMA_CPP_HOME/gguf"
    cd "$IK_LLAMA_CPP_BASE"
    if ! ls ik_llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
        "$PYTHON" -m pip download --no-deps --no-binary :all: "${NO_ISOLATION[@]}" \
            ik-llama-cpp-python -d .
    fi
    IK_SDIST="$(ls ik_llama_cpp_python-*.tar.gz | sort -V | tail -1)"
    IK_SRC_DIR="${IK_SDIST%.tar.gz}"
    [ -d "$IK_SRC_DIR" ] || tar xzf "$IK_SDIST"
    IK_DIR="$IK_LLAMA_CPP_BASE/$IK_SRC_DIR/vendor/ik_llama.cpp"
    IK_BUILD_DIR="$IK_DIR/$BUILD_NAME"
    # Run by common/CMakeLists.txt as `cmake -P` from the source root; the source package
    # leaves it out. cmake/build-info.cmake sets BUILD_NUMBER, BUILD_COMMIT ("unknown"
    # outside git), BUILD_COMPILER and BUILD_TARGET, which build-info.cpp.in names.
    GEN="$IK_DIR/common/cmake/build-info-gen-cpp.cmake"
    if [ ! -f "$GEN" ]; then
        mkdir -p "$(dirname "$GEN")"
        cat >"$GEN" <<'CMAKE'
# Writes common/build-info.cpp from common/build-info.cpp.in (run by common/CMakeLists.txt).
get_filename_component(LLAMA_ROOT "${CMAKE_CURRENT_LIST_DIR}/../.." ABSOLUTE)
include("${LLAMA_ROOT}/cmake/build-info.cmake")
configure_file("${LLAMA_ROOT}/common/build-info.cpp.in" "${LLAMA_ROOT}/common/build-info.cpp" @ONLY)
CMAKE
    fi
    NEED_BUILD=0
    for TOOL in "${TOOLS[@]}"; do
        [ -x "$IK_BUILD_DIR/bin/$TOOL" ] || NEED_BUILD=1
    done
    if [ "$NEED_BUILD" = 1 ]; then
        GENERATOR=()
        command -v ninja >/dev/null && GENERATOR=(-G Ninja)
        cmake -S "$IK_DIR" -B "$IK_BUILD_DIR" "${GENERATOR[@]}" -DCMAKE_BUILD_TYPE=Release \
            "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
            -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_SERVER=OFF -DGGML_IQK_FA_ALL_QUANTS=OFF
        cmake --build "$IK_BUILD_DIR" -j "$JOBS" --target "${TOOLS[@]}"
    fi
    for TOOL in "${TOOLS[@]}"; do
        ln -sf "$IK_BUILD_DIR/bin/$TOOL" "$IK_LLAMA_CPP_HOME/bin/"
    done
    echo "ik_llama.cpp ($LEVEL) tools in $IK_LLAMA_CPP_HOME/bin"
fi

# 6. Optionally the Python package (its own copy of llama.cpp, built by pip).
if [ "${INSTALL_PYTHON_PACKAGE:-0}" = 1 ]; then
    CMAKE_ARGS="-DGGML_NATIVE=ON" "$PYTHON" -m pip install llama-cpp-python
fi

echo "llama.cpp ($LEVEL) tools in $LLAMA_CPP_HOME/bin, GGUF files in $LLAMA_CPP_HOME/gguf"
"$LLAMA_CPP_HOME/bin/llama-bench" --help | head -1 || true
