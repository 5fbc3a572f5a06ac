#!/usr/bin/env bash
# The pipeline timeline pictures in docs/ (bench/README.md, "Pipeline parallelism"):
#   docs/pipeline_timeline.png        a real 4-stage interleaved 1F1B step (p=4, v=2, m=8) recorded by
#                                     pretrain_gpt.py --record-pipeline-timeline on 4 gloo ranks
#   docs/pipeline_timeline_ideal.png  the same schedule table on an ideal machine (backward = 2 x forward)
# Usage: bash bench/run_pipeline_timeline.sh [RECORD_DIR]   (about 30 s on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
RECORD=${1:-$(mktemp -d)/timeline}
OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc-per-node 4 pretrain_gpt.py \
    --pipeline-model-parallel-size 4 --num-layers 8 --num-layers-per-virtual-pipeline-stage 1 \
    --hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --hidden-dropout 0 --attention-dropout 0 --micro-batch-size 2 --global-batch-size 16 \
    --train-iters 3 --log-interval 1 --eval-iters 0 --lr 1e-4 --mock-data --vocab-size 511 \
    --record-pipeline-timeline "$RECORD"
"$PY" tools/plot_pipeline_timeline.py --record "$RECORD" --output docs/pipeline_timeline.png
"$PY" tools/plot_pipeline_timeline.py --pp 4 --vp 2 --microbatches 8 --output docs/pipeline_timeline_ideal.png
ls -l docs/pipeline_timeline.png docs/pipeline_timeline_ideal.png
