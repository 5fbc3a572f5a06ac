#!/usr/bin/env bash
# One short, prepared GPU check (for a machine with CUDA; ~5-7 minutes on one H100/H200, section 4 about 2):
#  1. the CUDA paths: device layer, NCCL init (1 rank), fp32/bf16/fp16 training steps, fused AdamW,
#     flash attention through SDPA, the distributed optimizer and sequence parallelism code paths at TP=1;
#  2. MFU of a GPT-2-medium-sized model in bf16, read from the log line (the device's known peak);
#  3. the single-rank step benchmark against Hugging Face on the GPU;
#  4. the fused kernels on and off: --cross-entropy-loss-fusion and each --attention-backend (bf16).
# Results land in ${OUT:-gpu_results}/ ; copy the figures into bench/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())" | tee "$OUT/device.txt"
COMMON=(--mock-data --vocab-size 50257 --seq-length 1024 --max-position-embeddings 1024 --lr 3e-4
        --lr-warmup-iters 2 --log-interval 5 --eval-iters 0 --hidden-dropout 0 --attention-dropout 0)
# 1. code paths, tiny model, each precision
for prec in "" --bf16 --fp16; do
  python pretrain_gpt.py "${COMMON[@]}" --num-layers 2 --hidden-size 256 --num-attention-heads 4 \
    --micro-batch-size 4 --global-batch-size 8 --train-iters 10 $prec --use-distributed-optimizer \
    --timing-log-level 1 2>&1 | tee "$OUT/paths${prec}.log" | grep -E "iteration +10/|time across ranks"
done
# 2. MFU: GPT-2 medium (24 x 1024, 16 heads), bf16, micro-batch 8 x 1024 tokens
python pretrain_gpt.py "${COMMON[@]}" --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
  --micro-batch-size 8 --global-batch-size 32 --train-iters 30 --bf16 --log-interval 10 \
  2>&1 | tee "$OUT/mfu_bf16.log" | grep -E "iteration +(10|20|30)/"
# 3. step benchmark against Hugging Face (bf16 on the GPU)
python bench/bench_train_step.py --device cuda --dtype bf16 2>&1 | tee "$OUT/train_step.log" | tail -15
# 4. fused kernels on and off (bf16, GPT-2 vocabulary, 12 x 1024, seq 2048): step time and peak memory from
#    the log line with the output-layer/cross-entropy fusion and each attention backend; flash refused in fp32
FUSED=(--num-layers 12 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048 --max-position-embeddings 2048
       --micro-batch-size 4 --global-batch-size 8 --train-iters 10 --bf16 --log-interval 5)
for run in "unfused:--attention-backend unfused" "ce-fusion:--attention-backend unfused --cross-entropy-loss-fusion" \
           "flash:--attention-backend flash" "fused-attn:--attention-backend fused" \
           "all-fused:--attention-backend flash --cross-entropy-loss-fusion"; do
  name=${run%%:*}
  # shellcheck disable=SC2086  # the flags after the colon are meant to split
  python pretrain_gpt.py "${COMMON[@]}" "${FUSED[@]}" ${run#*:} 2>&1 | tee "$OUT/fused_$name.log" \
    | grep -E "iteration +10/" | sed "s/^/$name: /"
done
if python pretrain_gpt.py "${COMMON[@]}" --num-layers 2 --hidden-size 256 --num-attention-heads 4 \
     --train-iters 1 --attention-backend flash > "$OUT/flash_fp32.log" 2>&1; then
  echo "flash in fp32: NOT refused (unexpected)"
else
  grep -m1 "attention-backend flash" "$OUT/flash_fp32.log" || tail -3 "$OUT/flash_fp32.log"
fi
