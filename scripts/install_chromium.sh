#!/usr/bin/env bash
# Chromium for the web UI test (tests/entrypoints/test_web_ui.py), which pip cannot install:
# nothing to do when `$CHROMIUM` or a Chromium / Chrome binary on PATH is there; else Debian's
# `chromium` through apt-get (as root, or with sudo). Where it cannot install it (no apt-get,
# no root), it says how and exits 1, so `make test` stops here rather than fail in the test.
set -euo pipefail

names=(chromium chromium-browser google-chrome google-chrome-stable)
if [ -n "${CHROMIUM:-}" ]; then
    [ -x "$CHROMIUM" ] || { echo "==> CHROMIUM=$CHROMIUM is not an executable file" >&2; exit 1; }
    echo "==> Chromium for the web UI test: $CHROMIUM"
    exit 0
fi
found() {
    for name in "${names[@]}"; do
        command -v "$name" && return 0
    done
    return 1
}

if path=$(found); then
    echo "==> Chromium for the web UI test: $path"
    exit 0
fi

fail() {
    cat >&2 <<MSG
==> Chromium is missing: tests/entrypoints/test_web_ui.py drives a headless Chromium, and
    $1
    Install it yourself, then run make test again:
        sudo apt-get install -y --no-install-recommends chromium     # Debian, Ubuntu
        sudo dnf install -y chromium                                 # Fedora
    or point CHROMIUM at a Chromium or Chrome binary: make test CHROMIUM=/path/to/chrome
MSG
    exit 1
}

command -v apt-get >/dev/null || fail "this system has no apt-get to install it with."
if [ "$(id -u)" -eq 0 ]; then
    sudo=()
elif command -v sudo >/dev/null && { sudo -n true 2>/dev/null || [ -t 0 ]; }; then
    sudo=(sudo)
    echo "==> installing Chromium with sudo apt-get (sudo may ask for your password)"
else
    fail "installing it needs root (apt-get), and this user is not root and has no sudo."
fi
echo "==> Chromium for the web UI test: apt-get install chromium"
"${sudo[@]}" apt-get update -qq || fail "apt-get update failed (output above)."
"${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
    apt-get install -y -qq --no-install-recommends chromium \
    || fail "apt-get install chromium failed (output above)."
path=$(found) || fail "apt-get installed chromium, but no chromium binary is on PATH."
echo "==> Chromium for the web UI test: $path"
