#!/usr/bin/env bash
# The GPU check, for one machine with one CUDA GPU (sized for one H200: at most ~5 minutes, BUDGET_S).
#  smoke (~1-2 min): tests/test_gpu_paths*.py, every CUDA-only branch of megalite compared with the CPU
#        (bench/README.md, "GPU paths"), then one tiny bf16 pretrain_gpt.py run;
#  then: the fused kernels on and off in bf16 (--cross-entropy-loss-fusion, each --attention-backend): their
#        losses compared with the unfused run's, their step time and memory from the log line, flash refused
#        in fp32; MFU of a GPT-2-medium-sized model in bf16; the single-rank step against Hugging Face
#        (skipped, saying so, where transformers is not importable).
# Each part's output lands in ${OUT:-gpu_results}/ (7 files: device.txt, summary.txt and one log per part);
# a table of pass/fail per part ends the output, and the script exits non-zero when a part failed. A part
# that would start past the time budget is skipped, and the table says so.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu_results}
BUDGET_S=${BUDGET_S:-290}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
unset MEGALITE_FORCE_CPU  # megalite picks the GPU
START=$SECONDS
ROWS=()
FAILED=0

if ! "$PY" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'
print('torch', torch.__version__, '| CUDA', torch.version.cuda, '|', torch.cuda.get_device_name())" \
    > "$OUT/device.txt" 2>&1; then
  cat "$OUT/device.txt"
  exit 1
fi
cat "$OUT/device.txt"

py() {  # py LOG LIMIT ARGS...: python ARGS appended to $OUT/LOG, killed after LIMIT s or at the budget's end
  local log=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - (SECONDS - START)))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    echo "skipped: the time budget (${BUDGET_S}s) is spent" >> "$OUT/$log"
    return 125
  fi
  echo "\$ python $*" >> "$OUT/$log"
  timeout -k 10 "$limit" "$PY" "$@" >> "$OUT/$log" 2>&1
}

part() {  # part NAME FUNCTION: run FUNCTION, record its result (0 pass, 125/126 skipped, else failed) and time
  local name=$1 t0=$SECONDS rc=0 status
  echo "== $name"
  "$2" || rc=$?
  case $rc in
    0) status=PASS ;;
    124 | 137) status="FAIL (time limit)" ;;
    125) status="SKIP (time budget)" ;;
    126) status="SKIP (transformers not importable)" ;;
    *) status="FAIL (exit $rc)" ;;
  esac
  [[ $status == FAIL* ]] && FAILED=1
  ROWS+=("$(printf '%-14s %-36s %4ds' "$name" "$status" $((SECONDS - t0)))")
}

COMMON=(--mock-data --vocab-size 50257 --lr 3e-4 --lr-warmup-iters 2 --eval-iters 0 --hidden-dropout 0
        --attention-dropout 0)

gpu_paths() {  # every CUDA-only branch against the CPU (the tests say what each compares)
  py gpu_paths.log 200 -m pytest tests/test_gpu_paths.py tests/test_gpu_paths_dist.py -x -q -rsfE -p no:cacheprovider
  local rc=$?
  grep -E "^(SKIPPED|FAILED|ERROR|E  )|passed|failed" "$OUT/gpu_paths.log" | tail -n 25
  return $rc
}

bf16_smoke() {  # one tiny bf16 run of the command line, distributed optimizer, phase timers
  py bf16_smoke.log 60 pretrain_gpt.py "${COMMON[@]}" --num-layers 2 --hidden-size 256 --num-attention-heads 4 \
    --seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 8 --train-iters 10 \
    --log-interval 5 --bf16 --use-distributed-optimizer --timing-log-level 1 || return $?
  grep -E "iteration +10/" "$OUT/bf16_smoke.log" | grep "number of nan iterations:   0" || return 1
}

FUSED=(--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
       --micro-batch-size 4 --global-batch-size 8 --train-iters 10 --log-interval 5 --bf16)
FUSED_RUNS=("unfused:--attention-backend unfused" "ce-fusion:--attention-backend unfused --cross-entropy-loss-fusion"
            "flash:--attention-backend flash" "fused-attn:--attention-backend fused"
            "all-fused:--attention-backend flash --cross-entropy-loss-fusion")

fused() {  # bf16, GPT-2 vocabulary, 12 x 1024, seq 2048: each kernel choice's losses against the unfused run's
  local run rc
  for run in "${FUSED_RUNS[@]}"; do
    echo "== run ${run%%:*}" >> "$OUT/fused.log"
    # shellcheck disable=SC2086  # the flags after the colon are meant to split
    py fused.log 50 pretrain_gpt.py "${COMMON[@]}" "${FUSED[@]}" ${run#*:} || return $?
  done
  echo "== run flash-fp32 (must be refused)" >> "$OUT/fused.log"
  py fused.log 40 pretrain_gpt.py "${COMMON[@]}" --num-layers 2 --hidden-size 256 --num-attention-heads 4 \
    --seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 2 --train-iters 1 \
    --attention-backend flash
  rc=$?
  ((rc == 0)) && { echo "flash in fp32 was NOT refused"; return 1; }
  ((rc == 124 || rc == 125)) && return $rc
  grep -m1 "attention-backend flash needs" "$OUT/fused.log" || return 1
  compare_fused "$OUT/fused.log"
}

compare_fused() {  # compare_fused LOG: each run's lm loss against the unfused run's (bf16: 2e-2); time, memory
  "$PY" - "$1" << 'EOF'
import re
import sys

runs, name = {}, None
for line in open(sys.argv[1]):
    if line.startswith("== run "):
        name = line.split()[2]
        runs[name] = {}
    m = re.search(r"iteration\s+(\d+)/.*?elapsed time per iteration \(ms\): ([0-9.]+).*?lm loss: ([0-9.E+-]+)", line)
    if m and name:
        mem = re.search(r"max_allocated ([0-9]+)", line)
        runs[name][int(m[1])] = (float(m[3]), float(m[2]), mem[1] if mem else "?")
ref, bad = runs.get("unfused", {}), 0
print(f"{'run':<11} {'lm loss at ' + str(sorted(ref)):<30} {'max rel diff':>12} {'ms/iter':>8} {'peak MB':>8}")
for name, got in runs.items():
    if name == "flash-fp32":
        continue
    its = sorted(ref)
    diff = max((abs(got[i][0] - ref[i][0]) / ref[i][0] for i in its if i in got), default=float("inf"))
    ok = bool(its) and all(i in got for i in its) and diff <= 2e-2
    bad += not ok
    last = got[max(got)] if got else (float("nan"), float("nan"), "?")
    losses = ", ".join(f"{got[i][0]:.4f}" for i in its if i in got)
    print(f"{name:<11} {losses:<30} {diff:12.2e} {last[1]:8.1f} {last[2]:>8} {'' if ok else 'FAIL'}")
sys.exit(1 if bad else 0)
EOF
}

mfu() {  # GPT-2 medium (24 x 1024, 16 heads), bf16, micro-batch 8 x 1024 tokens: MFU from the log line
  py mfu.log 90 pretrain_gpt.py "${COMMON[@]}" --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 --train-iters 20 \
    --log-interval 10 --bf16 || return $?
  grep -E "iteration +20/" "$OUT/mfu.log" | grep -oE "(elapsed time per iteration \(ms\)|MFU): [0-9.]+%?" \
    || return 1
}

hf_step() {  # megalite's single-rank step against transformers' GPT2LMHeadModel, both pure bf16
  if ! "$PY" -c "import transformers" > /dev/null 2>&1; then
    echo "transformers is not importable with $PY: the Hugging Face step comparison is skipped" | tee "$OUT/hf_step.log"
    return 126
  fi
  py hf_step.log 90 bench/bench_train_step.py --device cuda --dtype bf16 --warmup 2 --rounds 3 --max-rounds 6 \
    || return $?
  tail -n 4 "$OUT/hf_step.log"
}

part gpu_paths gpu_paths
part bf16_smoke bf16_smoke
part fused fused
part mfu mfu
part hf_step hf_step

{
  echo "part           result                               time   (logs in $OUT/; total $((SECONDS - START))s)"
  printf '%s\n' "${ROWS[@]}"
} | tee "$OUT/summary.txt"
exit $FAILED
