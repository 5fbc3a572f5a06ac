#!/usr/bin/env bash
# The whole test suite (README's test command): install, lint, then every test.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
"$PY" -m ruff check .
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # multi-rank tests share the cores; no OpenMP spin-waiting
# Two pytest workers, each taking whole files (a file's shared launches and single-process references stay
# in one process): most tests and every single-process reference use one core, so two keep both busy.
WORKERS=${MEGALITE_TEST_WORKERS:-2}
"$PY" -m pytest -q -p no:cacheprovider -n "$WORKERS" --dist loadfile tests "$@"
