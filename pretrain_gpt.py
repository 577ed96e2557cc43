"""Pretrain a GPT on Megatron-LM's own training loop (megatron-core 0.19.2's ``pretrain()``), with
this fork's Muon beside upstream's optimizers.

Launch (4 CPU ranks, TP=2 x DP=2, our Muon in the DistributedOptimizer, the built-in corpus):
    .venv/bin/torchrun --nproc-per-node 4 --standalone pretrain_gpt.py \\
        --tensor-model-parallel-size 2 --use-distributed-optimizer \\
        --optimizer muon --muon-impl megatron_muon --transformer-impl local \\
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \\
        --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 16 \\
        --train-iters 50 --lr 3e-3 --data-path $(.venv/bin/python -m megatron.training.corpus) \\
        --split 98,2,0 --tokenizer-type NullTokenizer --vocab-size 256 \\
        --save /tmp/ckpt --log-interval 5

Flags are upstream's (``--help``); the model, datasets and forward step are
``megatron/training/gpt_entry.py`` (installed with the fork, so that a script of one's own can
import them). Where CUDA is absent the ranks run on the CPU with gloo (``cpu_loop``).
"""

import sys

from megatron.training import cpu_loop, gpt_entry

if __name__ == "__main__":
    sys.exit(cpu_loop.exit_status(gpt_entry.main))
