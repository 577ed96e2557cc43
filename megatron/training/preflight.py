"""What a command line needs from the machine, checked before any rank or worker starts: one line
per problem, naming the flag and the way out (``pretrain_gpt.py`` and ``preprocess_data`` print
them and exit 2; nothing hangs, nothing downloads).

    problems = preflight.problems(args)   # args: upstream's parser's namespace

An air-gapped cluster needs nothing beyond the install for tokenizers given as local files
(``--vocab-file``/``--merge-file``, ``--tokenizer-model PATH``): patch 0070 builds GPT-2 BPE and
BERT WordPiece from the files alone. A Hugging Face hub name (``HuggingFaceTokenizer``) needs
the hub, or its snapshot in the local cache with ``HF_HUB_OFFLINE=1``.
"""

import importlib.util
import os

# The tokenizer types whose vocabulary upstream downloads (with the package wget) when no file is
# given: (flags they need, the files).
MEGATRON_TYPES = {
    "GPT2BPETokenizer": (("vocab_file", "merge_file"), "GPT-2's vocab.json and merges.txt"),
    "BertWordPieceLowerCase": (("vocab_file",), "the WordPiece vocab.txt"),
    "BertWordPieceCase": (("vocab_file",), "the WordPiece vocab.txt"),
}
MODEL_FILE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# Package each tokenizer type imports (none: built in)
TOKENIZER_PACKAGES = {
    **{name: "transformers" for name in MEGATRON_TYPES},
    "HuggingFaceTokenizer": "transformers",
    "SFTTokenizer": "transformers",
    "MultimodalTokenizer": "transformers",
    **{name: "sentencepiece" for name in MODEL_FILE_TYPES},
    "TikTokenizer": "tiktoken",
}
# The default pretrain_gpt.py gives --tokenizer-type (upstream's pretrain_gpt.py's args_defaults)
DEFAULT_TOKENIZER = "GPT2BPETokenizer"


def problems(args, default_tokenizer: str = DEFAULT_TOKENIZER) -> list:
    """One line per thing ``args`` needs that this machine lacks (none where ``args`` is None: a
    command line that does not parse, which upstream's parser then answers)."""
    if args is None:
        return []
    return package_problems(args) + tokenizer_problems(args, default_tokenizer)


def package_problems(args) -> list:
    """Packages that flags other than the tokenizer's import."""
    needs = []
    if getattr(args, "use_megatron_fsdp", False):
        needs.append(("einops", "--use-megatron-fsdp"))
    if (getattr(args, "num_distributed_optimizer_instances", 1) or 1) > 1:
        needs.append(("einops", "--num-distributed-optimizer-instances > 1"))
    return [
        f"{flag} needs the package {package}, which is not installed (pip install {package})"
        for package, flag in needs
        if not _has(package)
    ]


def tokenizer_problems(args, default_tokenizer: str = DEFAULT_TOKENIZER) -> list:
    """The tokenizer's package, its files, and (for a hub name) the hub or its cache."""
    kind = getattr(args, "tokenizer_type", None) or default_tokenizer
    package = TOKENIZER_PACKAGES.get(kind)
    if package and not _has(package):
        return [
            f"--tokenizer-type {kind} needs the package {package}, which is not installed "
            f"(pip install {package})"
        ]
    found = _missing_files(args)
    if found:
        return found
    if kind in MEGATRON_TYPES:
        return _megatron_files(args, kind)
    if kind in MODEL_FILE_TYPES + ("TikTokenizer",):
        return _model_file(args, kind)
    if kind in ("HuggingFaceTokenizer", "SFTTokenizer"):
        return _hub_model(args, kind)
    return []


def _missing_files(args) -> list:
    return [
        f"{flag} {path}: no such file"
        for flag, path in (
            ("--vocab-file", getattr(args, "vocab_file", None)),
            ("--merge-file", getattr(args, "merge_file", None)),
            ("--tokenizer-metadata", getattr(args, "metadata_path", None)),
        )
        if path and not os.path.exists(path)
    ]


def _megatron_files(args, kind) -> list:
    """GPT-2 BPE and BERT WordPiece: local files, or upstream's download (wget, network)."""
    names, files = MEGATRON_TYPES[kind]
    absent = [name for name in names if not getattr(args, name, None)]
    if not absent or _has("wget") or _cached(kind, absent):
        return []
    flags = " and ".join("--" + name.replace("_", "-") for name in absent)
    return [
        f"--tokenizer-type {kind} needs {flags} ({files}, local files): without them upstream "
        "downloads them, which needs the package wget and network access"
    ]


def _cached(kind, names) -> bool:
    """Whether upstream's download cache (torch hub's megatron/) already holds the files."""
    from megatron.core.tokenizers.text.libraries import megatron_hf_tokenizer as hf

    suffix = {"vocab_file": "_vocab", "merge_file": "_merges"}
    return all(os.path.exists(os.path.join(hf.MEGATRON_CACHE, kind + suffix[n])) for n in names)


def _model_file(args, kind) -> list:
    path = getattr(args, "tokenizer_model", None)
    if path and os.path.isfile(path):
        return []
    what = "no such file" if path else "not given"
    return [f"--tokenizer-type {kind} needs --tokenizer-model FILE (its model file): {what}"]


def _hub_model(args, kind) -> list:
    """A local directory or file is read offline; a hub name needs the hub or, with
    HF_HUB_OFFLINE=1, its snapshot in the Hugging Face cache."""
    name = getattr(args, "tokenizer_model", None)
    if not name:
        return [f"--tokenizer-type {kind} needs --tokenizer-model (a local directory or a name)"]
    if os.path.exists(name) or not _hub_offline() or _in_hub_cache(name):
        return []
    return [
        f"--tokenizer-model {name} is not a local path and HF_HUB_OFFLINE is set, but the "
        "Hugging Face cache has no snapshot of it: pass a local directory (save_pretrained, or "
        "a copy of the hub's files)"
    ]


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")


def _in_hub_cache(name: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(name, "tokenizer_config.json")
    return isinstance(found, str)


def _has(package: str) -> bool:
    return importlib.util.find_spec(package) is not None
