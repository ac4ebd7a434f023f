#!/usr/bin/env bash
# Tests the torch-free kernel headers (csrc/vec.h, csrc/math.h, csrc/gemv.h) at every ISA
# level the extension is built for, and checks that the extension's sources compile for Arm:
#
#   1. neon: cross-compiles csrc/tests/kernel_test.cpp with
#      `aarch64-linux-gnu-g++ -O2 -march=armv8-a -std=c++17` and runs it under
#      `qemu-aarch64 -L /usr/aarch64-linux-gnu` (natively on an aarch64 host). Installs
#      g++-aarch64-linux-gnu and qemu-user from apt first if they are missing (root or sudo).
#   2. x86-64 hosts: compiles the driver natively for generic (the default -march=x86-64),
#      avx2 (-march=x86-64-v3) and avx512 (-march=x86-64-v4), and runs each level the CPU has
#      (/proc/cpuinfo: avx2+fma+f16c; avx512f+avx512bw+avx512vl+avx512dq+avx512cd).
#   3. Syntax-checks every csrc/*.cpp for aarch64 (`aarch64-linux-gnu-g++ -fsyntax-only
#      -std=c++17 -fopenmp -march=armv8-a`, warnings off) against the installed torch's
#      headers and Python's include directory, as setup.py would compile the neon level.
#
# Prints a summary; exits nonzero if anything failed. Idempotent: reinstalls nothing that is
# there, rebuilds into ${KT_BUILD_DIR:-build/kernel_test}. Takes ~1 min for steps 1-2 (a few
# seconds of that under qemu) plus 10-20 s per source file for step 3 on a busy 2-core
# machine (~3-4 min in all); the first run adds the apt install (~1-2 min).
#
# Environment: PYTHON (default .venv/bin/python, else python3) for torch's include paths;
# KT_SKIP_SYNTAX=1 skips step 3.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD="${KT_BUILD_DIR:-build/kernel_test}"
mkdir -p "$BUILD"
DRIVER=csrc/tests/kernel_test.cpp
HOST="$(uname -m)"
NICE=(nice -n 10)

declare -a SUMMARY=()
FAILED=0
record() {  # record <status> <what>
  SUMMARY+=("$(printf '%-6s %s' "$1" "$2")")
  if [[ "$1" == FAIL ]]; then FAILED=1; fi
}

# --- tools ------------------------------------------------------------------------------------
apt_install() {
  local runner=()
  if [[ "$(id -u)" != 0 ]]; then
    if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
      runner=(sudo -n)
    else
      echo "need root or passwordless sudo to apt-get install $*" >&2
      return 1
    fi
  fi
  "${runner[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${runner[@]}" apt-get install -y -qq "$@"
}

QEMU=""
find_qemu() {
  QEMU="$(command -v qemu-aarch64 || command -v qemu-aarch64-static || true)"
}
CROSS=aarch64-linux-gnu-g++
if [[ "$HOST" != aarch64 ]]; then
  find_qemu
  missing=()
  command -v "$CROSS" >/dev/null || missing+=(g++-aarch64-linux-gnu)
  [[ -n "$QEMU" ]] || missing+=(qemu-user)
  if ((${#missing[@]})); then
    echo "== installing ${missing[*]}"
    apt_install "${missing[@]}"
    find_qemu
  fi
else
  CROSS=g++  # native Arm host
fi

# --- 1 and 2: the driver at each level ----------------------------------------------------------
run_level() {  # run_level <name> <compiler> <runner or ""> <flags...>
  local name="$1" cxx="$2" runner="$3"
  shift 3
  local exe="$BUILD/kernel_test_$name" t0 t1
  echo "== $name: $cxx -O2 -std=c++17 $*"
  t0=$(date +%s)
  if ! "${NICE[@]}" "$cxx" -O2 -std=c++17 "$@" "$DRIVER" -o "$exe"; then
    record FAIL "$name: compile"
    return 0
  fi
  t1=$(date +%s)
  local out rc=0
  if [[ -n "$runner" ]]; then
    out="$($runner -L /usr/aarch64-linux-gnu "$exe" 2>&1)" || rc=$?
  else
    out="$("$exe" 2>&1)" || rc=$?
  fi
  echo "$out"
  local last
  last="$(tail -n 1 <<<"$out")"
  if ((rc == 0)); then
    record PASS "$name: $last (compile $((t1 - t0)) s, run $(($(date +%s) - t1)) s)"
  else
    record FAIL "$name: exit $rc: $last"
  fi
}

if [[ "$HOST" == aarch64 ]]; then
  run_level neon g++ "" -march=armv8-a
else
  run_level neon "$CROSS" "$QEMU" -march=armv8-a
fi

if [[ "$HOST" == x86_64 ]]; then
  flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
  has() { for f in "$@"; do [[ "$flags" == *" $f "* ]] || return 1; done; }
  run_level generic g++ ""
  if has avx2 fma f16c; then
    run_level avx2 g++ "" -march=x86-64-v3
  else
    record SKIP "avx2: CPU lacks avx2/fma/f16c"
  fi
  if has avx512f avx512bw avx512vl avx512dq avx512cd; then
    run_level avx512 g++ "" -march=x86-64-v4
  else
    record SKIP "avx512: CPU lacks avx512f/bw/vl/dq/cd"
  fi
fi

# --- 3: the extension's sources, syntax-checked for aarch64 ------------------------------------
if [[ "${KT_SKIP_SYNTAX:-0}" != 1 ]]; then
  PY="${PYTHON:-}"
  if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
  fi
  if ! mapfile -t TORCH_ARGS < <("$PY" - <<'EOF'
import sysconfig

import torch
from torch.utils.cpp_extension import include_paths

for p in [*include_paths(), sysconfig.get_paths()["include"]]:
    print(f"-I{p}")
print(f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}")
EOF
  ) || ((${#TORCH_ARGS[@]} == 0)); then
    record FAIL "aarch64 syntax check: no torch include paths from $PY"
  else
    for src in csrc/*.cpp; do
      log="$BUILD/syntax_$(basename "$src" .cpp).log"
      t0=$(date +%s)
      if "${NICE[@]}" "$CROSS" -fsyntax-only -std=c++17 -fopenmp -march=armv8-a -w \
        -DTORCH_EXTENSION_NAME=_C_neon -DTORCH_API_INCLUDE_EXTENSION_H "${TORCH_ARGS[@]}" \
        "$src" >"$log" 2>&1; then
        record PASS "aarch64 -fsyntax-only $src ($(($(date +%s) - t0)) s)"
      else
        echo "== aarch64 -fsyntax-only $src failed; first errors ($log):"
        grep -m 8 -E 'error' "$log" || head -n 8 "$log"
        record FAIL "aarch64 -fsyntax-only $src: $(grep -c -E '(error|Error)' "$log") error lines, see $log"
      fi
    done
  fi
fi

echo
echo "== summary"
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
