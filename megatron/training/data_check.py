"""Data and output paths checked up front: before the model is built, one line each.

megatron-core reads ``.idx``/``.bin`` files lazily and with asserts (``bad header, cannot
read``), numpy errors on a short file and ``__del__`` noise from half-built readers, minutes into
a run. ``check_indexed_prefix`` reads only the 34-byte header and compares the file sizes with
what the header promises (Megatron's format: ``MMIDIDX\\0\\0``, version 1, dtype code, sequence
and document counts, then int32 lengths, int64 pointers, int64 document indices); the ``.bin``
must hold every sequence the index points at. ``check_writable`` finds an unusable ``--save``
(read-only, or under a regular file) before training time is spent.
"""

import os
import struct
import tempfile

from .datasets import parse_data_path

INDEX_HEADER = b"MMIDIDX\x00\x00"
HEADER_BYTES = 34  # 9 magic + 8 version + 1 dtype code + 8 sequences + 8 documents
DTYPE_SIZES = {1: 1, 2: 1, 3: 2, 4: 4, 5: 8, 6: 8, 7: 4, 8: 2}  # megatron-core's DType codes


class DataError(ValueError):
    """Unusable data or output path; the message names the file and what is wrong."""


def check_indexed_prefix(prefix: str, flag: str = "--data-path") -> int:
    """The number of documents of ``prefix.idx/.bin``; DataError if missing, corrupt or empty."""
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    for path in (idx, bin_):
        if not os.path.isfile(path):
            raise DataError(
                f"{flag} prefix {prefix!r}: {path} does not exist "
                "(write .bin/.idx with tools/preprocess_data.py)"
            )
    size = os.path.getsize(idx)
    with open(idx, "rb") as f:
        head = f.read(HEADER_BYTES)
    if len(head) < HEADER_BYTES or head[:9] != INDEX_HEADER:
        raise DataError(f"{idx}: not a Megatron index file (bad header; truncated or corrupt?)")
    version, code, sequences, documents = struct.unpack("<QBQQ", head[9:])
    if version != 1 or code not in DTYPE_SIZES:
        raise DataError(f"{idx}: unsupported index version {version} or dtype code {code}")
    expected = HEADER_BYTES + 4 * sequences + 8 * sequences + 8 * documents
    if size < expected:
        raise DataError(
            f"{idx}: truncated ({size} bytes, its header promises {sequences} sequences and "
            f"{documents - 1} documents in {expected} bytes)"
        )
    if sequences == 0 or documents <= 1:
        raise DataError(f"{prefix}: the dataset is empty (no documents in {idx})")
    _check_bin(idx, bin_, sequences, DTYPE_SIZES[code])
    return documents - 1


def _check_bin(idx: str, bin_: str, sequences: int, itemsize: int) -> None:
    """The last sequence must end inside the .bin (pointers are byte offsets)."""
    import numpy

    lengths = numpy.memmap(
        idx, dtype=numpy.int32, mode="r", offset=HEADER_BYTES, shape=(sequences,)
    )
    pointers = numpy.memmap(
        idx, dtype=numpy.int64, mode="r", offset=HEADER_BYTES + 4 * sequences, shape=(sequences,)
    )
    needed = int(pointers[-1]) + int(lengths[-1]) * itemsize
    size = os.path.getsize(bin_)
    if size < needed:
        raise DataError(
            f"{bin_}: truncated ({size} bytes; {idx} points at {needed} bytes of tokens)"
        )


def check_data(args) -> None:
    """Every --data-path (and per-split) prefix readable and non-empty; --save writable; the
    counts of --per-dataset-sequences-path equal to the index headers."""
    if args.save:
        check_writable(args.save, "--save")
    if getattr(args, "mock_data", False):
        return
    prefixes = []
    for flag in ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"):
        value = getattr(args, flag[2:].replace("-", "_"), None)
        try:
            blend = parse_data_path(value, flag)
        except ValueError as err:
            raise DataError(str(err)) from None
        for prefix in blend[0] if blend else []:
            check_indexed_prefix(prefix, flag)
            prefixes.append((flag, prefix))
    if getattr(args, "per_dataset_sequences_path", None):
        check_sequences_per_dataset(args.per_dataset_sequences_path, prefixes)


def index_counts(prefix: str) -> list:
    """[sequence count, document count] as the .idx header holds them (documents + 1)."""
    with open(prefix + ".idx", "rb") as f:
        head = f.read(HEADER_BYTES)
    _, _, sequences, documents = struct.unpack("<QBQQ", head[9:])
    return [sequences, documents]


def check_sequences_per_dataset(path: str, prefixes) -> None:
    """megatron-core trusts these counts instead of reading the headers: a missing or wrong entry
    would fail deep in the build or read the index at wrong offsets."""
    from .data_args_files import read_sequences_per_dataset

    try:
        table = read_sequences_per_dataset(path)
    except ValueError as err:
        raise DataError(str(err)) from None
    for flag, prefix in prefixes:
        if prefix not in table:
            raise DataError(
                f"--per-dataset-sequences-path {path!r} has no entry for {flag} prefix {prefix!r}"
            )
        if table[prefix] != index_counts(prefix):
            raise DataError(
                f"--per-dataset-sequences-path {path!r}: {prefix!r} is {table[prefix]}, but its "
                f"index holds {index_counts(prefix)} ([sequences, documents + 1])"
            )


def check_writable(folder: str, flag: str) -> None:
    """DataError unless ``folder`` is, or can be created as, a writable directory: tried with
    a probe file in the nearest existing ancestor (``os.access`` misses read-only mounts)."""
    path = os.path.abspath(folder)
    probe = path
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise DataError(f"{flag} {folder}: {probe} is a file, not a directory")
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as err:
        what = "is not writable" if probe == path else f"cannot be created in {probe}"
        raise DataError(f"{flag} {folder} {what} ({err.strerror})") from None
