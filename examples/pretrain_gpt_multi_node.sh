#!/usr/bin/env bash
# Several nodes with torchrun: run this same command on every node; torchrun's c10d rendezvous (on
# MASTER_ADDR:MASTER_PORT, any node that all others can reach) assigns the ranks, NPROC per node.
#
#   node 0:  NNODES=2 NODE_RANK=0 MASTER_ADDR=node0 bash examples/pretrain_gpt_multi_node.sh
#   node 1:  NNODES=2 NODE_RANK=1 MASTER_ADDR=node0 bash examples/pretrain_gpt_multi_node.sh
#   DRY_RUN=1 ... prints the command only. Extra arguments go to pretrain_gpt.py and win over the defaults.
#
# Layout (GPT ~1.3B on 2 x 8 GPUs): TP=4 inside a node (NVLink), PP=2, DP over the rest. Ranks fill nodes
# in order (rank // NPROC is the node), so TP groups never leave a node as long as TP divides NPROC;
# --print-layout shows the groups per node at start-up, and rank 0 warns if TP would cross nodes
# (check a layout beforehand: python tools/show_layout.py --nnodes 2 --nproc-per-node 8 --tensor-model-parallel-size 4 ...).
#
# Restarts: with MAX_RESTARTS > 0, torchrun restarts every rank when one dies and the run resumes from
# the latest checkpoint in $CKPT (--load = --save). Every node must see $CKPT (a shared file system).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/nccl_env.sh

NNODES=${NNODES:?set NNODES (number of nodes)}
NODE_RANK=${NODE_RANK:?set NODE_RANK (0..NNODES-1)}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR (host of the rendezvous, reachable from every node)}
MASTER_PORT=${MASTER_PORT:-29500}
NPROC=${NPROC:-8}
RUN_ID=${RUN_ID:-megalite-gpt}
MAX_RESTARTS=${MAX_RESTARTS:-2}
TORCHRUN=${TORCHRUN:-torchrun}
PRECISION=${PRECISION---bf16}

MODEL=(--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 4
       --seq-length 2048 --max-position-embeddings 2048 --position-embedding-type rope --normalization RMSNorm
       --swiglu --untie-embeddings-and-output-weights --disable-bias-linear
       --hidden-dropout 0 --attention-dropout 0)
PARALLEL=(--tensor-model-parallel-size 4 --sequence-parallel --pipeline-model-parallel-size 2
          --num-layers-per-virtual-pipeline-stage 6
          --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
          --distributed-timeout-minutes 10)
# With DP ranks on several nodes, --hierarchical-dp-reduce sends only 1/k of the gradients over the
# network (k DP ranks per node); --use-tp-pp-dp-mapping puts pipeline stages inside a node instead.
TRAINING=(--micro-batch-size 2 --global-batch-size 512 --train-iters 50000 --lr 2e-4 --min-lr 2e-5
          --lr-warmup-iters 1000 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
          --adam-beta2 0.95 --seed 1234 --exit-signal-handler)
if [[ -n "${DATA_PATH:-}" ]]; then
  DATA=(--data-path "$DATA_PATH" --split 99,1,0 --tokenizer-type GPT2BPETokenizer
        --vocab-file "${VOCAB_FILE:?set VOCAB_FILE}" --merge-file "${MERGE_FILE:?set MERGE_FILE}")
else
  DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 50257)
fi
CKPT=${CKPT:-checkpoints/gpt_multi_node}
OUTPUT=(--log-interval 10 --eval-interval 2000 --eval-iters 10 --save "$CKPT" --load "$CKPT"
        --save-interval 500 --print-layout)

${DRY_RUN:+echo} $TORCHRUN --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "$RUN_ID" \
  --max-restarts "$MAX_RESTARTS" pretrain_gpt.py \
  "${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${OUTPUT[@]}" $PRECISION "$@"
