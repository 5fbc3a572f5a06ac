#!/usr/bin/env bash
# The whole test suite (README's test command): install, lint, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
"$PY" -m ruff check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # multi-rank tests share the cores; no OpenMP spin-waiting
"$PY" -m pytest -q -p no:cacheprovider tests "$@"
