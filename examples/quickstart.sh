#!/usr/bin/env bash
# Quick start: install, build the embedded corpus (the Python standard library's own source and
# docstrings: real text, no download), then train a small GPT on it on this machine's CPUs (or GPU).
# Extra arguments are passed to pretrain_gpt.py (e.g. --train-iters 50). Ends by printing a sample the
# trained model generates from a short prompt (tools/generate.py on the saved checkpoint).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
bash scripts/install.sh
CORPUS=${MEGALITE_CORPUS:-corpus}
"$PY" -c "from megalite.data.default_corpus import ensure_default_corpus as e; e('$CORPUS')"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
SAVE=checkpoints/quickstart
prev=""
for arg in "$@"; do  # a --save given to this script moves the checkpoint the sample is drawn from
  if [ "$prev" = "--save" ]; then SAVE=$arg; fi
  prev=$arg
done
"$PY" pretrain_gpt.py \
  --data-path "$CORPUS/stdlib_text_document" --split 98,2,0 \
  --tokenizer-type GPT2BPETokenizer --vocab-file "$CORPUS/vocab.json" --merge-file "$CORPUS/merges.txt" \
  --num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 128 \
  --micro-batch-size 8 --global-batch-size 16 --train-iters 200 \
  --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 10 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 \
  --hidden-dropout 0 --attention-dropout 0 --seed 1234 \
  --log-interval 20 --eval-interval 100 --eval-iters 4 \
  --save checkpoints/quickstart --save-interval 100 "$@"
echo
echo "A sample from the model just trained (python tools/generate.py --load $SAVE ...):"
"$PY" tools/generate.py --load "$SAVE" --prompt "def" --max-new-tokens 40 --temperature 0.8 --top-k 40 \
  --seed 1234
