"""SentencePiece tokenizers with Megatron-LM's semantics (its legacy
``megatron/training/tokenizer/tokenizer.py``): ``GPTSentencePieceTokenizer`` and
``Llama2Tokenizer``, both reading a ``.model`` file (``--tokenizer-model``) through the
``sentencepiece`` package, imported lazily so that other tokenizers need not have it.

- ids are sentencepiece's own (``vocab_size`` = the model's piece count, nothing added);
- eod is the model's ``</s>`` (``eos_id``): what ``--append-eod`` writes between documents;
- ``Llama2Tokenizer.tokenize`` puts ``<s>`` (``bos_id``) first, as Megatron-LM's does by default
  (text completion), so every preprocessed document starts with it; GPTSentencePiece adds nothing.
"""

from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer


def _import_sentencepiece():
    try:
        import sentencepiece
    except ImportError as err:
        raise ImportError(
            "GPTSentencePieceTokenizer and Llama2Tokenizer need the `sentencepiece` package: "
            "pip install -r requirements/base.txt"
        ) from err
    return sentencepiece


def load_processor(model_file: str):
    """A SentencePieceProcessor; a file sentencepiece cannot parse is a ValueError naming it."""
    sentencepiece = _import_sentencepiece()
    try:
        return sentencepiece.SentencePieceProcessor(model_file=model_file)
    except (OSError, RuntimeError) as err:
        raise ValueError(
            f"--tokenizer-model {model_file!r} is not a sentencepiece model: {err}"
        ) from None


class GPTSentencePieceTokenizer(MegatronLegacyTokenizer):
    """Megatron-LM's GPTSentencePieceTokenizer: plain sentencepiece ids, eod = ``</s>``."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)
        self.tokenizer = load_processor(model_file)
        size = self.tokenizer.get_piece_size()
        self._inv_vocab = {i: self.tokenizer.id_to_piece(i) for i in range(size)}
        self._vocab = {piece: i for i, piece in self._inv_vocab.items()}

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab

    @property
    def bos(self) -> int:
        return self.tokenizer.bos_id()

    @property
    def pad(self) -> int:
        return self.tokenizer.pad_id()

    @property
    def eos(self) -> int:
        return self.eod

    @property
    def eod(self) -> int:
        eos = self.tokenizer.eos_id()
        if eos < 0:  # trained with --eos_id=-1: sentencepiece then has no end-of-sentence piece
            raise NotImplementedError(
                f"{type(self).__name__}: the sentencepiece model has no </s> (eos_id is -1), "
                "which Megatron-LM uses as end-of-document"
            )
        return eos


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron-LM's Llama2Tokenizer: as GPTSentencePiece, but ``tokenize`` starts with ``<s>``
    (``bos=True, eos=False`` by default, Megatron-LM's text-completion choice)."""

    def tokenize(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        ids = self.tokenizer.encode_as_ids(text)
        if bos:
            ids = [self._bos_id()] + ids
        if eos:
            ids = ids + [self.eod]
        return ids

    def _bos_id(self) -> int:
        bos = self.tokenizer.bos_id()
        if bos < 0:
            raise NotImplementedError(
                "Llama2Tokenizer: the sentencepiece model has no <s> (bos_id is -1), which "
                "Llama2Tokenizer puts before every document"
            )
        return bos
