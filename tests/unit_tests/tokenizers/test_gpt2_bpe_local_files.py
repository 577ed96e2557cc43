# Copyright (c) 2025, NVIDIA CORPORATION. All rights reserved.

"""--tokenizer-type GPT2BPETokenizer with --vocab-file/--merge-file: MegatronHFTokenizer called
AutoTokenizer.from_pretrained("gpt2", vocab_file=..., merges_file=...), which asks the hub for
the class and config, so offline (HF_HUB_OFFLINE=1, an empty cache) it failed, and online the
hub's tokenizer.json won over the files given. The tokenizer is now built from the files and the
hub's known config. Run in a fresh interpreter: the hub's offline mode is read at import."""

import json
import os
import subprocess
import sys

from tokenizers import Tokenizer, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
TEXTS = ["hello world, the lazy dog.", "a<|endoftext|>b"]

BUILD = """
import json, sys
from megatron.core.tokenizers.text.libraries.megatron_hf_tokenizer import MegatronHFTokenizer
tok = MegatronHFTokenizer("GPT2BPETokenizer", vocab_file=sys.argv[1], merges_file=sys.argv[2])
print(json.dumps([tok.text_to_ids(text) for text in json.loads(sys.argv[3])]))
"""


def _gpt2_files(folder):
    """A byte-level BPE in GPT-2's layout (vocab.json, merges.txt), end-of-text token last."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS * 20, trainer)
    vocab_file, merges_file = tok.model.save(str(folder))
    vocab = {t: i for i, t in enumerate(t for t in sorted(tok.get_vocab()) if t != EOT)}
    vocab[EOT] = len(vocab)
    with open(vocab_file, "w") as f:
        json.dump(vocab, f)
    return vocab_file, merges_file, vocab


def test_gpt2_bpe_from_local_files_offline(tmp_path):
    vocab_file, merges_file, vocab = _gpt2_files(tmp_path)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "empty_hf_home"))
    done = subprocess.run(
        [sys.executable, "-c", BUILD, vocab_file, merges_file, json.dumps(TEXTS)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # before the fix: OSError from the hub (offline mode, "gpt2" not in the cache)
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    assert ids[1] == [vocab["a"], vocab[EOT], vocab["b"]]  # the files' ids, EOT whole
    assert all(0 <= i < len(vocab) for row in ids for i in row)
