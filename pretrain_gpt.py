"""Pretrain a GPT on Megatron-LM's own training loop (megatron-core 0.19.2's ``pretrain()``), with
this fork's Muon beside upstream's optimizers.

Launch (4 CPU ranks, TP=2 x DP=2, our Muon with the seed's recipe, DistributedOptimizer, the
built-in stdlib corpus; on upstream's loop, base megatron-core 0.19.2; examples/cpu_quickstart.sh
is the same, larger):
    CUDA_DEVICE_MAX_CONNECTIONS=1 .venv/bin/torchrun --nproc-per-node 4 --standalone \
        pretrain_gpt.py --tensor-model-parallel-size 2 --use-distributed-optimizer \
        --optimizer muon --muon-impl megatron_muon --muon-matched-adamw-rms 0.2 \
        --muon-nesterov --muon-momentum 0.95 --muon-coefficient-type simple \
        --muon-tp-mode duplicated --num-layers 2 --hidden-size 64 --num-attention-heads 4 \
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 4 \
        --global-batch-size 16 --train-iters 50 --lr 3e-3 \
        --data-path $(.venv/bin/python -m megatron.training.corpus) --split 98,2,0 \
        --tokenizer-type NullTokenizer --vocab-size 257 --log-interval 5 --eval-interval 25 \
        --eval-iters 4 \
        --save /tmp/ckpt --save-interval 50 --distributed-backend gloo --transformer-impl local \
        --no-persist-layer-norm --no-gradient-accumulation-fusion --no-rope-fusion

Flags are upstream's (``--help``); the model, datasets and forward step are
``megatron/training/gpt_entry.py`` (installed with the fork, so that a script of one's own can
import them). Where CUDA is absent the ranks run on the CPU with gloo (``cpu_loop``).
"""

import sys

if __name__ == "__main__":
    # imported here, not at the top: a process started with multiprocessing's "spawn" (the
    # torch_dist writer's results-queue manager, among others) runs this file again as
    # __mp_main__, and importing Megatron-LM's loop costs it seconds
    from megatron.training import cpu_loop, gpt_entry

    sys.exit(cpu_loop.exit_status(gpt_entry.main))
