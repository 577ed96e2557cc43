"""SentencePiece tokenizers with Megatron-LM's semantics (its legacy
``megatron/training/tokenizer/tokenizer.py``), reading a ``.model`` file (``--tokenizer-model``)
through the ``sentencepiece`` package, imported lazily so that other tokenizers need not have it.

- ``GPTSentencePieceTokenizer``: sentencepiece's own ids (``vocab_size`` = the model's piece
  count); eod is the model's ``</s>`` (``eos_id``), what ``--append-eod`` writes;
- ``Llama2Tokenizer``: the same, and ``tokenize`` puts ``<s>`` (``bos_id``) first, as
  Megatron-LM's does by default (text completion), so every preprocessed document starts with it;
- ``SentencePieceTokenizer``: special tokens added after the pieces (see its docstring); eod is
  the added ``<EOD>``.
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


class _PieceVocab(MegatronLegacyTokenizer):
    """The vocabulary tables both sentencepiece tokenizers keep: the model's pieces by id (and
    the special tokens SentencePieceTokenizer appends)."""

    def _read_pieces(self, model_file: str) -> int:
        """Load the model; returns its piece count."""
        self.tokenizer = load_processor(model_file)
        size = self.tokenizer.get_piece_size()
        self._inv_vocab = {i: self.tokenizer.id_to_piece(i) for i in range(size)}
        self._vocab = {piece: i for i, piece in self._inv_vocab.items()}
        return size

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    @property
    def vocab(self) -> dict:
        return self._vocab

    @property
    def inv_vocab(self) -> dict:
        return self._inv_vocab


class GPTSentencePieceTokenizer(_PieceVocab):
    """Megatron-LM's GPTSentencePieceTokenizer: plain sentencepiece ids, eod = ``</s>``."""

    def __init__(self, model_file: str):
        super().__init__(model_file, vocab_extra_ids=0)
        self._read_pieces(model_file)

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer.encode_as_ids(text)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode_ids([int(i) for i in ids])

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


class SentencePieceTokenizer(_PieceVocab):
    """Megatron-LM's SentencePieceTokenizer: the model's pieces, then the special tokens
    ``<CLS> <SEP> <EOD> <MASK>``, the model's pad, bos and eos pieces (``<PAD>``, ``<BOS>``,
    ``<EOS>`` where the model has none) and ``<extra_id_0..n-1>`` (--vocab-extra-ids), each
    appended with the next id unless the model has that piece. Their text in the input is cut
    out and mapped to its id (NeMo's rule, as upstream); eod is ``<EOD>``."""

    def __init__(self, model_file: str, vocab_extra_ids: int = 0):
        super().__init__(model_file, vocab_extra_ids=vocab_extra_ids)
        size = self._read_pieces(model_file)
        self._special: dict = {}
        for token in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            self._add_special(token)
        model_ids = (self.tokenizer.pad_id(), self.tokenizer.bos_id(), self.tokenizer.eos_id())
        self._pad, self._bos, self._eos = (
            self._add_special(self._inv_vocab[i] if 0 <= i < size else fallback)
            for i, fallback in zip(model_ids, ("<PAD>", "<BOS>", "<EOS>"))
        )
        for i in range(vocab_extra_ids):
            self._add_special(f"<extra_id_{i}>")
        self._inv_special = {i: t for t, i in self._special.items()}

    def _add_special(self, token: str) -> int:
        if token not in self._vocab:
            self._vocab[token] = len(self._vocab)
            self._inv_vocab[self._vocab[token]] = token
        self._special[token] = self._vocab[token]
        return self._vocab[token]

    def tokenize(self, text: str) -> list[int]:
        ids, start = [], 0
        while True:
            found = [(text.find(t, start), t) for t in self._special if text.find(t, start) >= 0]
            if not found:
                break
            at, token = min(found)  # the earliest; at one position the first added wins
            ids += self.tokenizer.encode_as_ids(text[start:at]) + [self._special[token]]
            start = at + len(token)
        return ids + self.tokenizer.encode_as_ids(text[start:])

    def detokenize(self, ids) -> str:
        text, last = "", 0
        ids = [int(i) for i in ids]
        for i, token_id in enumerate(ids):
            if token_id in self._inv_special:  # upstream puts spaces around special tokens
                text += self.tokenizer.decode_ids(ids[last:i]) + " "
                text += self._inv_special[token_id] + " "
                last = i + 1
        return text + self.tokenizer.decode_ids(ids[last:])

    @property
    def cls(self) -> int:
        return self._special["<CLS>"]

    @property
    def sep(self) -> int:
        return self._special["<SEP>"]

    @property
    def mask(self) -> int:
        return self._special["<MASK>"]

    @property
    def eod(self) -> int:
        return self._special["<EOD>"]

    @property
    def pad(self) -> int:
        return self._pad

    @property
    def bos(self) -> int:
        return self._bos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def additional_special_tokens_ids(self) -> list:
        return [v for t, v in self._special.items() if t.startswith("<extra_id_")]
