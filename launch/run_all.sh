#!/usr/bin/env bash
# The whole stack: API -> patched vLLM -> Shop-R1 env -> GRPO trainer, then SFT-vs-RL eval.
# Usage: launch/run_all.sh [--preset cpu-tiny|cpu-smol|gpu-0.5b|gpu-3b] [--weight-bridge-mode M] ...
#        (launch/run_all.sh --help lists every option)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=python
exec "$PY" -m launch.run_all "$@"
