"""Patch 0071: a run's tokenizer leaves transformers unimported unless it needs it (upstream
imported it in every process that imported the tokenizers package: 2.4 s of a rank's startup).
Each check runs in a fresh interpreter, the only place an import can be observed; ~6 s."""

import subprocess
import sys

BUILD_NULL = """
import sys
sys.argv = ["pretrain_gpt.py", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer
from megatron.training.arguments import parse_args
tokenizer = build_tokenizer(parse_args())  # what pretrain_gpt.py's global_vars do, upstream's args
assert tokenizer.vocab_size >= 128
print("transformers" in sys.modules)
"""


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_null_tokenizer_run_does_not_import_transformers():
    assert _python(BUILD_NULL) == "False"


def test_the_hugging_face_tokenizer_still_finds_transformers():
    """Negative control: the names upstream exposed still load transformers when asked for."""
    code = (
        "import sys\n"
        "from megatron.core.tokenizers.text.libraries import huggingface_tokenizer as h, "
        "chat_template as c, sft_tokenizer as s\n"
        "assert h.HAVE_TRANSFORMERS and c.HAVE_TRANSFORMERS and s.HAVE_TRANSFORMERS\n"
        "before = 'transformers' in sys.modules\n"
        "h.AutoTokenizer.from_pretrained\n"
        "print(before, 'transformers' in sys.modules)"
    )
    assert _python(code) == "False True"
