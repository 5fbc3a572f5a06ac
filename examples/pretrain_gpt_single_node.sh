#!/usr/bin/env bash
# One node, NPROC GPUs: `torchrun --standalone` starts one rank per GPU with a local rendezvous.
#
#   bash examples/pretrain_gpt_single_node.sh                      # 8 GPUs: TP=2 x DP=4, GPT ~350M, mock data
#   DATA_PATH=corpus/stdlib_text_document VOCAB_FILE=corpus/vocab.json MERGE_FILE=corpus/merges.txt \
#     bash examples/pretrain_gpt_single_node.sh --train-iters 2000  # real data; extra flags win
#   DRY_RUN=1 bash examples/pretrain_gpt_single_node.sh             # print the command only
#
# Arguments after the script name go to pretrain_gpt.py after the defaults below; argparse keeps the
# last value of a repeated flag, so they override (e.g. --tensor-model-parallel-size 4).
# CPU-only machines: NPROC=2 PRECISION= bash examples/pretrain_gpt_single_node.sh --num-layers 2 ... (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/nccl_env.sh

NPROC=${NPROC:-8}
TORCHRUN=${TORCHRUN:-torchrun}
PRECISION=${PRECISION---bf16}          # empty for fp32 (CPU), --fp16 for V100-class GPUs

MODEL=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 2048
       --max-position-embeddings 2048 --init-method-std 0.02 --hidden-dropout 0 --attention-dropout 0)
PARALLEL=(--tensor-model-parallel-size 2 --sequence-parallel
          --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING=(--micro-batch-size 4 --global-batch-size 256 --train-iters 20000 --lr 3e-4 --min-lr 3e-5
          --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
          --adam-beta2 0.95 --seed 1234)
if [[ -n "${DATA_PATH:-}" ]]; then
  DATA=(--data-path "$DATA_PATH" --split 98,2,0 --tokenizer-type GPT2BPETokenizer
        --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
  DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
CKPT=${CKPT:-checkpoints/gpt_single_node}
OUTPUT=(--log-interval 10 --eval-interval 1000 --eval-iters 10 --save "$CKPT" --load "$CKPT"
        --save-interval 1000 --print-layout)

${DRY_RUN:+echo} $TORCHRUN --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  "${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${OUTPUT[@]}" $PRECISION "$@"
