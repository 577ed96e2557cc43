#!/usr/bin/env bash
# CPU quick start (what `make demo` runs): a small GPT trained with Muon on 4 CPU processes,
# tensor parallel 2 x data parallel 2 with the distributed optimizer, on the built-in corpus
# (the Python standard library's own source, byte-level tokens; built offline on first use),
# then a checkpoint. Muon runs with the seed's recipe (megatron/training/muon_recipe.py): matched
# AdamW RMS 0.2, Nesterov, momentum 0.95, Keller Jordan's coefficients, exact TP (duplicated).
#
#   bash examples/cpu_quickstart.sh                 # from the repo root, after `make install`
#   DRY_RUN=1 bash examples/cpu_quickstart.sh       # print the command instead of running it
#
# Knobs (environment): TRAIN_ITERS (150), SAVE_DIR (checkpoints/cpu_quickstart), PYTHON (.venv).
#
# DISTOPT=0 runs it without --use-distributed-optimizer (for comparison).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
DISTOPT=${DISTOPT:-1}
SAVE_DIR=${SAVE_DIR:-checkpoints/cpu_quickstart}
TRAIN_ITERS=${TRAIN_ITERS:-150}

if [ -n "${DRY_RUN:-}" ]; then
  DATA=${DATA_PATH:-"<stdlib corpus prefix>"}
else
  DATA=${DATA_PATH:-$("$PYTHON" -m megatron.training.corpus)}  # built once, then cached
fi

args=(
  --tensor-model-parallel-size 2 --optimizer muon
  --muon-matched-adamw-rms 0.2 --muon-use-nesterov --muon-momentum 0.95
  --muon-coefficient-type simple --muon-tp-mode duplicated
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
  --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0
  --micro-batch-size 8 --global-batch-size 32 --train-iters "$TRAIN_ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1
  --data-path "$DATA" --split 98,2,0 --tokenizer-type ByteLevelTokenizer --num-workers 0
  --log-interval 10 --eval-interval 50 --eval-iters 4
  --save "$SAVE_DIR" --save-interval 1000
)
[ "$DISTOPT" = 1 ] && args+=(--use-distributed-optimizer)

cmd=("$PYTHON" -m torch.distributed.run --nproc-per-node 4 --standalone pretrain_gpt.py "${args[@]}")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 4 ranks share the cores
"${cmd[@]}"
echo "checkpoint: $(cd "$SAVE_DIR" && pwd)/iter_$(printf '%07d' "$(cat "$SAVE_DIR/latest_checkpointed_iteration.txt")")"
