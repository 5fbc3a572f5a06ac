#!/usr/bin/env bash
# Run megalite's tests on another torch release: scripts/test_torch.sh VERSION [--subset] [pytest arguments]
#
# Builds (or reuses) a venv with torch==VERSION from the package registry, installs megalite and its test
# extra into it under a constraints file that pins that torch (nothing may upgrade it), then runs the
# whole suite, or the pytest arguments given, or with --subset the portability set below. The registry's
# builds are CUDA builds; they
# run on the CPU once their nvidia-* dependencies are installed (~3.5 GB, a few minutes per release).
# The venvs live under $MEGALITE_TORCH_VENVS (default ~/.cache/megalite-torch). Results: docs/compatibility.md.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: scripts/test_torch.sh VERSION [--subset] [pytest arguments]   (e.g. 2.6.0)" >&2
  exit 2
fi
version=$1
shift
if ! [[ $version =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
  echo "scripts/test_torch.sh: VERSION must be a release such as 2.6.0, not '$version'" >&2
  exit 2
fi
root=${MEGALITE_TORCH_VENVS:-$HOME/.cache/megalite-torch}
venv=$root/torch-$version
py=$venv/bin/python
mkdir -p "$root"
[ -x "$py" ] || python3 -m venv "$venv"
constraints=$venv/megalite-constraints.txt
echo "torch==$version" > "$constraints"
export PIP_CONSTRAINT=$constraints  # replaces any machine-wide cap: this venv gets exactly this torch
have=$("$py" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)
if [ "$have" != "$version" ]; then
  "$py" -m pip install --quiet "torch==$version"
fi
if ! "$py" -c "import megalite, pytest, megatron.core, transformers, matplotlib" >/dev/null 2>&1 \
   || [ "${MEGALITE_REINSTALL:-0}" = 1 ]; then
  "$py" -m pip install --quiet -e ".[test]"
fi
got=$("$py" -c "import torch; print(torch.__version__)")
case $got in
  "$version"|"$version"+*) ;;
  *) echo "scripts/test_torch.sh: the venv has torch $got, not $version" >&2; exit 1 ;;
esac
echo "torch $got in $venv"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# The portability set: every parallel dimension through torchrun against the single-process run (TP/SP, PP
# also under NCCL semantics, DP with the distributed optimizer and ZeRO-3, CP in each comm type, EP with
# each dispatcher), the hidden-API fallbacks, the API scan, the GPU paths' CPU twins, precision,
# checkpoints and their resharding, HF conversion through tools/convert_checkpoint.py.
SUBSET=(tests/test_torch_compat.py tests/test_torch_api_scan.py tests/test_cli_layouts.py tests/test_gpu_paths.py tests/test_gpu_paths_dist.py
        tests/test_mixed_precision.py tests/test_checkpoint.py tests/test_hf_conversion.py
        tests/test_context_parallel_training.py tests/test_cli_context_parallel.py)
if [ $# -eq 0 ]; then
  set -- tests
elif [ "$1" = --subset ]; then
  shift
  set -- "${SUBSET[@]}" "$@"
  export MEGALITE_TESTS_TORCHRUN=1  # the entry-point layout comparisons through torchrun itself
fi
"$py" -m pytest -q -p no:cacheprovider "$@"
