#!/usr/bin/env bash
# The README's test command runs this (via `make test`): the whole suite on two pytest-xdist
# workers (PYTEST_WORKERS=0: one process), a module per worker at a time (tests/conftest.py),
# the modules that start vLLM servers first; most of a vLLM start is single-threaded imports,
# so two workers keep both cores busy. pytest exits 5 when a marker selects no tests (e.g.
# `-m gpu` without CUDA); that is not a failure.
set -uo pipefail
cd "$(dirname "$0")/.."
# Python writes its bytecode caches (__pycache__, git-ignored) during the suite even where the
# environment says not to (PYTHONDONTWRITEBYTECODE=1, as some CI sandboxes set): otherwise
# every process that imports the test venvs' packages (verifiers, atroposlib, verifiers'
# episode programs) or this repository compiles them from source again, each time
# (docs/TESTING.md, "Bytecode").
unset PYTHONDONTWRITEBYTECODE
PY=${PY:-.venv/bin/python}
WORKERS=${PYTEST_WORKERS:-2}
XDIST=()
if [ "$WORKERS" != "0" ]; then
  XDIST=(-n "$WORKERS" --dist loadfile --no-loadscope-reorder)
fi
"$PY" -m pytest "${XDIST[@]}" --durations=25 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "pytest selected no tests (exit 5): treated as success"
  exit 0
fi
exit "$rc"
