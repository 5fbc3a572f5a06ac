#!/usr/bin/env bash
# Install megalite and what its tests need. Keeps an installed torch (e.g. a CUDA build on a GPU box);
# installs the CPU wheel torch==2.13.0 only where no torch is importable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
extras=${MEGALITE_EXTRAS:-test}
if ! "$PY" -c "import megalite, pytest, xdist, megatron.core, transformers, tokenizers, sentencepiece, tensorboard, wandb, matplotlib" >/dev/null 2>&1 \
   || [ "${MEGALITE_REINSTALL:-0}" = 1 ]; then
  "$PY" -m pip install --quiet -e ".[${extras}]"
fi
