"""Patch 0071: a run's tokenizer leaves transformers unimported unless it needs it (upstream
imported it in every process that imported the tokenizers package: 2.4 s of a rank's startup).
Checked in a fresh interpreter, the only place an import can be observed; ~8 s."""

import subprocess
import sys

CHECK = """
import sys
sys.argv = ["pretrain_gpt.py", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.core.tokenizers.text.libraries import huggingface_tokenizer as h
from megatron.core.tokenizers.text.libraries import chat_template as c, sft_tokenizer as s
from megatron.training.arguments import parse_args
tokenizer = build_tokenizer(parse_args())  # what pretrain_gpt.py's global_vars do, upstream's args
assert tokenizer.vocab_size >= 128
after_null = "transformers" in sys.modules
assert h.HAVE_TRANSFORMERS and c.HAVE_TRANSFORMERS and s.HAVE_TRANSFORMERS
h.AutoTokenizer.from_pretrained  # the name upstream exposed, asked for
print(after_null, "transformers" in sys.modules)
"""


def test_a_null_tokenizer_run_does_not_import_transformers():
    """A NullTokenizer built from upstream's parsed args leaves transformers out; asking the
    module for ``AutoTokenizer`` (upstream's name) then loads it (the control: the check sees an
    import when there is one)."""
    done = subprocess.run(
        [sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False True"
