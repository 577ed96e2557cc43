#!/usr/bin/env bash
# One node, all its GPUs: a ~125M-parameter GPT with our Muon (--muon-impl megatron_muon, the
# seed's recipe: megatron/training/muon_recipe.py), TP=2, distributed optimizer, bf16, on
# Megatron-LM's own training loop (pretrain_gpt.py on upstream's pretrain()).
#
#   DATA_PATH=/data/my_corpus_text_document bash examples/train_single_node.sh
#   DRY_RUN=1 bash examples/train_single_node.sh    # print the command instead of running it
#
# Knobs (environment): GPUS (8), DATA_PATH (default: the built-in stdlib corpus), SAVE_DIR,
# TRANSFORMER_IMPL (local; transformer_engine where TE is installed), TRAIN_ITERS, TOKENIZER_ARGS
# (default: upstream's NullTokenizer with --vocab-size 257, which fits the built-in corpus's
# byte ids 0..255 and eod 256; for your data e.g. "--tokenizer-type HuggingFaceTokenizer
# --tokenizer-model NAME"). A bare `torch` is used from PYTHON (default .venv/bin/python).
# With TRANSFORMER_IMPL=local the fusions that need TE or Apex are off.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
GPUS=${GPUS:-8}
SAVE_DIR=${SAVE_DIR:-checkpoints/gpt_125m}
TRAIN_ITERS=${TRAIN_ITERS:-20000}
TRANSFORMER_IMPL=${TRANSFORMER_IMPL:-local}
TOKENIZER_ARGS=${TOKENIZER_ARGS:-"--tokenizer-type NullTokenizer --vocab-size 257"}
if [ -n "${DRY_RUN:-}" ]; then
  DATA=${DATA_PATH:-"<stdlib corpus prefix>"}
else
  DATA=${DATA_PATH:-$("$PYTHON" -m megatron.training.corpus)}
fi

args=(
  --tensor-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce
  --optimizer muon --muon-impl megatron_muon
  --muon-matched-adamw-rms 0.2 --muon-nesterov --muon-momentum 0.95
  --muon-coefficient-type simple --muon-tp-mode duplicated
  --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
  --max-position-embeddings 1024 --position-embedding-type rope --normalization RMSNorm --swiglu
  --disable-bias-linear --untie-embeddings-and-output-weights
  --transformer-impl "$TRANSFORMER_IMPL"
  --micro-batch-size 8 --global-batch-size 256 --train-iters "$TRAIN_ITERS"
  --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 500 --weight-decay 0.1
  --clip-grad 1.0 --bf16
  --data-path "$DATA" --split 98,2,0 $TOKENIZER_ARGS
  --log-interval 10 --eval-interval 1000 --eval-iters 20 --log-throughput
  --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval 1000 --ckpt-format torch_dist
)
[ "$TRANSFORMER_IMPL" = local ] && args+=(
  --no-persist-layer-norm --no-gradient-accumulation-fusion --no-rope-fusion)
cmd=("$PYTHON" -m torch.distributed.run --nproc-per-node "$GPUS" --standalone pretrain_gpt.py "${args[@]}")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
export CUDA_DEVICE_MAX_CONNECTIONS=1  # Megatron's TP comm/compute ordering relies on it
"${cmd[@]}"
