#!/usr/bin/env bash
# Install Debian's chromium for the attention-viewer browser test (tests/viz/test_viewer_browser.py).
# Idempotent and quiet: does nothing when /usr/bin/chromium already exists.
# Needs root (or sudo) and the Debian package mirrors; downloads no browser from anywhere else
# (`playwright install` is never run: the test drives this chromium via executable_path).
set -euo pipefail

BROWSER=/usr/bin/chromium
if [ -x "$BROWSER" ]; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        SUDO="sudo"
    else
        echo "install-browser.sh: need root (or sudo) to apt-get install chromium" >&2
        exit 1
    fi
fi

export DEBIAN_FRONTEND=noninteractive
LOG=$(mktemp)
trap 'rm -f "$LOG"' EXIT
# Quiet on success; on failure show what apt said.
if ! { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium; } >"$LOG" 2>&1; then
    cat "$LOG" >&2
    echo "install-browser.sh: apt-get could not install chromium" >&2
    exit 1
fi

if [ ! -x "$BROWSER" ]; then
    echo "install-browser.sh: apt-get finished but $BROWSER is missing" >&2
    exit 1
fi
