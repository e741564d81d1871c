#!/usr/bin/env bash
# Installs Debian's Chromium for the report's screenshot test (tests/integration/test_report.py)
# when no Chromium is on PATH. Run by `make setup` and by the test itself; needs root (or sudo).
set -euo pipefail
for exe in chromium chromium-browser; do
  if command -v "$exe" >/dev/null 2>&1; then exit 0; fi
done
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install_chromium: no chromium on PATH and no apt-get; install Chromium by hand" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    SUDO="sudo -n"
  else
    echo "install_chromium: not root and no password-less sudo: run 'apt-get install chromium' as root" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
