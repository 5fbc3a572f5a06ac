#!/usr/bin/env bash
# A scaled-down DeepSeek-V3 (multi-latent attention, YaRN, the first layer dense, routed experts in groups
# with a shared expert, sigmoid router with expert bias, one multi-token prediction depth) in Megatron-LM's
# flags, on one node of NPROC GPUs: TP 2 with SP x EP 4 over DP 4.
#
#   bash examples/pretrain_deepseek_v3_small.sh                    # 8 GPUs, mock data
#   DRY_RUN=1 bash examples/pretrain_deepseek_v3_small.sh          # print the command only
#
# Arguments after the script name go to pretrain_gpt.py after the defaults below (the last value of a
# repeated flag wins). The full model's shape is tests/planning_rows/published.py's DeepSeek-V3 row
# (tools/plan.py with those flags: 671.03 B parameters, 37.55 B active per token).
set -euo pipefail
cd "$(dirname "$0")/.."
source examples/nccl_env.sh

NPROC=${NPROC:-8}
TORCHRUN=${TORCHRUN:-torchrun}
PRECISION=${PRECISION---bf16}

MODEL=(--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --ffn-hidden-size 2816
       --seq-length 4096 --max-position-embeddings 4096
       --swiglu --normalization RMSNorm --norm-epsilon 1e-6 --disable-bias-linear
       --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.006)
MLA=(--multi-latent-attention --qk-layernorm --q-lora-rank 384 --kv-lora-rank 128 --qk-head-dim 64
     --qk-pos-emb-head-dim 32 --v-head-dim 64
     --position-embedding-type yarn --rotary-scaling-factor 4 --yarn-original-max-position-embeddings 1024
     --mscale 1.0 --mscale-all-dim 1.0)
MOE=(--num-experts 16 --moe-layer-freq "([0]*1+[1]*7)" --moe-ffn-hidden-size 512
     --moe-shared-expert-intermediate-size 512 --moe-router-topk 4 --moe-router-num-groups 4
     --moe-router-group-topk 2 --moe-router-score-function sigmoid --moe-router-enable-expert-bias
     --moe-router-bias-update-rate 1e-3 --moe-router-topk-scaling-factor 2.5
     --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
     --moe-token-dispatcher-type alltoall --moe-grouped-gemm)
MTP=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
PARALLEL=(--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 4
          --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather)
TRAINING=(--micro-batch-size 1 --global-batch-size 64 --train-iters 20000 --lr 3e-4 --min-lr 3e-5
          --lr-warmup-iters 500 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0
          --adam-beta1 0.9 --adam-beta2 0.95 --seed 1234)
DATA=(--mock-data --tokenizer-type NullTokenizer --vocab-size 32000)
CKPT=${CKPT:-checkpoints/deepseek_v3_small}
OUTPUT=(--log-interval 10 --eval-interval 1000 --eval-iters 10 --save "$CKPT" --load "$CKPT"
        --save-interval 1000 --print-layout)

${DRY_RUN:+echo} $TORCHRUN --standalone --nproc-per-node "$NPROC" pretrain_gpt.py \
  "${MODEL[@]}" "${MLA[@]}" "${MOE[@]}" "${MTP[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${OUTPUT[@]}" \
  $PRECISION "$@"
