#!/usr/bin/env bash
# CPU quick start (what `make demo` runs): a small GPT trained with our Muon on 4 CPU processes,
# tensor parallel 2 x data parallel 2 with the distributed optimizer, on the built-in corpus
# (the Python standard library's own source, byte-level tokens; built offline on first use),
# through Megatron-LM's own training loop (pretrain_gpt.py on upstream's pretrain()), then a
# checkpoint. Muon is ours (--muon-impl megatron_muon) with the seed's recipe
# (megatron/training/muon_recipe.py): matched AdamW RMS 0.2, Nesterov, momentum 0.95, Keller
# Jordan's coefficients, exact TP (duplicated).
#
#   bash examples/cpu_quickstart.sh                 # from the repo root, after `make install`
#   DRY_RUN=1 bash examples/cpu_quickstart.sh       # print the command instead of running it
#
# Knobs (environment): TRAIN_ITERS (150), SAVE_DIR (checkpoints/cpu_quickstart), PYTHON (.venv).
# DISTOPT=0 runs it without --use-distributed-optimizer (for comparison).
#
# Tokens: the corpus is UTF-8 bytes 0..255, then 256 after each document. Upstream's
# NullTokenizer takes ids as they are; its eod is --vocab-size - 1, so --vocab-size 257 makes
# eod 256 and a vocabulary of 0..256 (256 would make byte 255 the eod and leave 256 out).
# CPU: gloo ranks, torch layers (no TE/Apex) and the fusions that have no torch fallback off
# (persistent layer norm, gradient-accumulation fusion, RoPE fusion).
# Everything else is upstream's default (2 data-loader workers, torch_dist checkpoints).
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
  --tensor-model-parallel-size 2
  --optimizer muon --muon-impl megatron_muon
  --muon-matched-adamw-rms 0.2 --muon-nesterov --muon-momentum 0.95
  --muon-coefficient-type simple --muon-tp-mode duplicated
  --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
  --max-position-embeddings 128 --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0
  --micro-batch-size 8 --global-batch-size 32 --train-iters "$TRAIN_ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.1
  --data-path "$DATA" --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size 257
  --log-interval 10 --eval-interval 50 --eval-iters 4
  --save "$SAVE_DIR" --save-interval 1000
  --distributed-backend gloo --transformer-impl local
  --no-persist-layer-norm --no-gradient-accumulation-fusion --no-rope-fusion
)
[ "$DISTOPT" = 1 ] && args+=(--use-distributed-optimizer)

cmd=("$PYTHON" -m torch.distributed.run --nproc-per-node 4 --standalone pretrain_gpt.py
  "${args[@]}")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # 4 ranks share the cores
export CUDA_DEVICE_MAX_CONNECTIONS=1          # upstream requires it with TP (a CPU counts too)
export MEGATRON_CPU_MODE=1                    # gloo CPU ranks even where a GPU is visible
log=$(mktemp)
trap 'rm -f "$log"' EXIT
"${cmd[@]}" 2>&1 | tee "$log"
# upstream's console: "iteration  10/ 150 | ... | lm loss: 4.123456E+00 | ..."
awk '/ iteration +[0-9]+\/ *[0-9]+ \|.*\| lm loss: / {
    split($0, a, "iteration *"); split(a[2], b, "/"); split($0, c, "lm loss: "); split(c[2], d, " ")
    if (!n++) { first = sprintf("%.4f at iteration %d", d[1], b[1]) }
    last = sprintf("%.4f at iteration %d", d[1], b[1]) }
  END { if (n) print "lm loss: first " first ", last " last }' "$log"
echo "checkpoint: $(cd "$SAVE_DIR" && pwd)/iter_$(printf '%07d' "$(cat "$SAVE_DIR/latest_checkpointed_iteration.txt")")"
