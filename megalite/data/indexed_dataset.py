"""Megatron's memory-mapped indexed dataset: a ``.bin`` of raw tokens and an ``.idx`` that says where
each sequence starts.

Layout of ``.idx`` (little-endian)::

    magic      9 bytes   b"MMIDIDX\\x00\\x00"
    version    uint64    1
    dtype      uint8     token dtype code (see DTYPE_CODES)
    S          uint64    number of sequences
    D          uint64    number of entries in the document index (documents + 1)
    lengths    int32[S]  tokens per sequence
    pointers   int64[S]  byte offset of each sequence in .bin
    documents  int64[D]  sequence index where each document starts; starts at 0, ends at S

A document is a run of sequences (one per document unless sentences were split). Files written here
are byte-identical to Megatron-LM's, so either tool can read the other's.

Writes are atomic: both files are written under temporary names and renamed at the end, the ``.idx``
last, so an interrupted run never leaves an ``.idx`` that looks complete.
"""

from __future__ import annotations

import os
import shutil
import struct
from collections.abc import Sequence

import numpy as np

from megalite.data.errors import CorruptDatasetError, MissingFileError, UnwritableError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes

DTYPE_CODES: dict[int, type[np.number]] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
    8: np.uint16,
}
_CODE_OF = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


def token_dtype(vocab_size: int) -> type[np.number]:
    """Token dtype Megatron uses for a vocabulary: uint16 below 65500 ids, else int32."""
    return np.uint16 if vocab_size < 65500 else np.int32


def idx_path(prefix: str) -> str:
    return prefix + ".idx"


def bin_path(prefix: str) -> str:
    return prefix + ".bin"


def exists(prefix: str) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{os.getpid()}"


class IndexedDataset:
    """Read-only, memory-mapped view of ``{prefix}.bin/.idx``.

    Opening checks the header and that the index and data agree (sizes, pointers, document
    boundaries), so a truncated or mismatched pair fails here with the file and the reason rather than
    as garbage tokens mid-training.
    """

    def __init__(self, prefix: str) -> None:
        self.path_prefix = prefix
        self._open()

    def _open(self) -> None:
        ipath, bpath = idx_path(self.path_prefix), bin_path(self.path_prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise MissingFileError(f"{p}: no such file (dataset prefix {self.path_prefix!r})")
        size = os.path.getsize(ipath)
        if size == 0:
            raise CorruptDatasetError(f"{ipath}: empty file")
        with open(ipath, "rb") as f:
            header = f.read(HEADER_SIZE)
        if len(header) < len(MAGIC) or header[: len(MAGIC)] != MAGIC:
            raise CorruptDatasetError(f"{ipath}: not an indexed dataset index (bad magic {header[:9]!r})")
        if len(header) < HEADER_SIZE:
            raise CorruptDatasetError(f"{ipath}: truncated header ({size} of {HEADER_SIZE} bytes)")
        version, code, nseq, ndoc = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise CorruptDatasetError(f"{ipath}: unsupported index version {version} (expected {VERSION})")
        if code not in DTYPE_CODES:
            raise CorruptDatasetError(f"{ipath}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER_SIZE + 4 * nseq + 8 * nseq + 8 * ndoc
        # A multimodal index carries one extra int8 mode per sequence; tolerate it, ignore the modes.
        if size not in (expected, expected + nseq):
            what = "truncated" if size < expected else "has trailing bytes"
            raise CorruptDatasetError(
                f"{ipath}: index {what}: {size} bytes, header promises {expected} "
                f"({nseq} sequences, {ndoc} document entries)")
        raw = np.memmap(ipath, mode="r", dtype=np.uint8)
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(raw, dtype=np.int32, count=nseq, offset=off)
        off += 4 * nseq
        self.sequence_pointers = np.frombuffer(raw, dtype=np.int64, count=nseq, offset=off)
        off += 8 * nseq
        self.document_indices = np.frombuffer(raw, dtype=np.int64, count=ndoc, offset=off)
        self._check_index(ipath, nseq)
        itemsize = self.dtype.itemsize
        nbytes = int(self.sequence_pointers[-1]) + int(self.sequence_lengths[-1]) * itemsize if nseq else 0
        bsize = os.path.getsize(bpath)
        if bsize != nbytes:
            raise CorruptDatasetError(self._size_mismatch(bpath, ipath, bsize, nbytes))
        self.num_tokens = nbytes // itemsize
        self._bin_path, self._bin_bytes = bpath, nbytes
        self._tokens = (np.memmap(bpath, mode="r", dtype=self.dtype) if nbytes
                        else np.empty(0, dtype=self.dtype))

    def _size_mismatch(self, bpath: str, ipath: str, bsize: int, nbytes: int) -> str:
        """Why the .bin is not the size its index promises: written with another token dtype (its size is
        exactly the tokens at another width), or truncated / grown."""
        tokens = nbytes // self.dtype.itemsize
        other = [np.dtype(t) for t in DTYPE_CODES.values() if np.dtype(t).itemsize != self.dtype.itemsize]
        fits = sorted({d.name for d in other if tokens and bsize == tokens * d.itemsize})
        if fits:
            return (f"{bpath}: the index {ipath} says {self.dtype.name} tokens ({tokens} tokens, {nbytes} bytes) but "
                    f"the data file holds {bsize} bytes, {tokens} tokens of {' or '.join(fits)}: the .idx and .bin "
                    "were written with different token dtypes (rebuild both with tools/preprocess_data.py)")
        what = "truncated" if bsize < nbytes else "longer than its index says"
        return f"{bpath}: data file {what}: {bsize} bytes, {ipath} promises {nbytes}"

    def _check_index(self, ipath: str, nseq: int) -> None:
        docs, lengths = self.document_indices, self.sequence_lengths
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != nseq:
            raise CorruptDatasetError(
                f"{ipath}: document index must start at 0 and end at the sequence count {nseq}")
        if np.any(np.diff(docs) < 0):
            raise CorruptDatasetError(f"{ipath}: document index is not non-decreasing")
        # Pointers must be the running byte sum of the lengths; checked in blocks to bound memory.
        start_ptr, block = 0, 1 << 22
        for lo in range(0, nseq, block):
            lens = lengths[lo:lo + block].astype(np.int64)
            if lens.min() < 0:
                raise CorruptDatasetError(f"{ipath}: negative sequence length")
            ends = np.cumsum(lens * self.dtype.itemsize) + start_ptr
            expected = np.concatenate(([start_ptr], ends[:-1]))
            got = self.sequence_pointers[lo:lo + block]
            if not np.array_equal(expected, got):
                bad = int(np.flatnonzero(expected != got)[0])
                raise CorruptDatasetError(f"{ipath}: sequence pointer {lo + bad} is {int(got[bad])}, "
                                          f"lengths say {int(expected[bad])}")
            start_ptr = int(ends[-1])

    # Pickling re-opens the files instead of copying the memory maps (DataLoader workers, spawn).
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.path_prefix = state["path_prefix"]
        self._open()

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def max_token_id(self, chunk: int = 1 << 26) -> int:
        """Largest token id in the data file (-1 when empty): one pass, ``chunk`` tokens at a time so
        that memory stays bounded on files larger than RAM."""
        top = -1
        for lo in range(0, len(self._tokens), chunk):
            top = max(top, int(self._tokens[lo:lo + chunk].max()))
        return top

    def has_token(self, token: int, max_sequences: int = 1024, head_tokens: int = 1 << 16) -> bool:
        """Whether ``token`` (an EOD id) is found by a bounded look, not a scan of the file: the last token of
        up to ``max_sequences`` sequences spread over the file (where --append-eod puts it) and the first
        ``head_tokens`` tokens."""
        if len(self._tokens) == 0:
            return False
        lengths = self.sequence_lengths
        picked = np.unique(np.linspace(0, len(lengths) - 1, min(len(lengths), max_sequences)).astype(np.int64))
        picked = picked[lengths[picked] > 0]
        last = self.sequence_pointers[picked] // self.dtype.itemsize + lengths[picked] - 1
        self._check_size()
        return bool(np.any(self._tokens[last] == token) or np.any(self._tokens[:head_tokens] == token))

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``idx`` (a view into the mapped file)."""
        n = len(self.sequence_lengths)
        if not -n <= idx < n:
            raise IndexError(f"sequence {idx} out of range [0, {n})")
        start = int(self.sequence_pointers[idx]) // self.dtype.itemsize + offset
        if length is None:
            length = int(self.sequence_lengths[idx]) - offset
        self._check_size()
        return self._tokens[start:start + length]

    def _check_size(self) -> None:
        """A data file truncated while mapped ends the process with a bus error naming nothing when a lost
        page is read; one stat per read names the file instead (a truncation between this check and the
        read itself still ends in the bus error)."""
        try:
            size = os.stat(self._bin_path).st_size
        except OSError:  # removed: the mapping keeps the old file's pages
            return
        if size < self._bin_bytes:
            raise CorruptDatasetError(f"{self._bin_path}: data file truncated while in use: {size} bytes, "
                                      f"{idx_path(self.path_prefix)} promises {self._bin_bytes}")


class IndexedDatasetWriter:
    """Writes ``{prefix}.bin/.idx`` atomically (temporary names, renamed on :meth:`finalize`).

    Opening creates the temporary ``.bin`` at once, so an unwritable destination fails before any
    work is done. Use as a context manager: an exception discards the partial files.
    """

    def __init__(self, prefix: str, dtype: type[np.number] | np.dtype) -> None:
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        out_dir = os.path.dirname(os.path.abspath(prefix))
        if not os.path.isdir(out_dir):
            raise MissingFileError(f"output directory {out_dir} does not exist")
        self._bin_tmp = _tmp_name(bin_path(prefix))
        self._idx_tmp = _tmp_name(idx_path(prefix))
        try:
            self._bin = open(self._bin_tmp, "wb")
        except OSError as e:
            raise UnwritableError(f"cannot write {bin_path(prefix)}: {e.strerror}") from e
        self._lengths: list[np.ndarray] = []
        self._doc_seq_counts: list[np.ndarray] = []
        self._done = False

    def add_document(self, tokens: Sequence[int] | np.ndarray, lengths: Sequence[int] | None = None) -> None:
        """One document made of sequences of ``lengths`` tokens (default: one sequence)."""
        arr = np.asarray(tokens, dtype=self.dtype)
        lens = [len(arr)] if lengths is None else list(lengths)
        if sum(lens) != len(arr):
            raise ValueError(f"sequence lengths {lens} do not add up to {len(arr)} tokens")
        self.add_documents(arr, np.asarray(lens, dtype=np.int32), np.asarray([len(lens)]))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: np.ndarray) -> None:
        """Many documents at once: flat tokens, each sequence's length, each document's sequence count."""
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        self._bin.write(memoryview(np.ascontiguousarray(tokens)).cast("B"))
        self._lengths.append(np.asarray(sequence_lengths, dtype=np.int32))
        self._doc_seq_counts.append(np.asarray(sequences_per_document, dtype=np.int64))

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (same dtype), as Megatron's merge tool does."""
        src = IndexedDataset(prefix)
        if src.dtype != self.dtype:
            raise ValueError(f"{idx_path(prefix)} holds {src.dtype} tokens, the output is {self.dtype}")
        self._lengths.append(np.array(src.sequence_lengths))
        self._doc_seq_counts.append(np.diff(src.document_indices))
        with open(bin_path(prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin, 16 << 20)

    def finalize(self) -> None:
        """Write the index, then move both files into place (``.idx`` last)."""
        self.write_index()
        self.publish()

    def write_index(self) -> None:
        """Close the data and write the index, both under their temporary names: the part of finishing that
        can fail on a full disk, so a writer of several outputs writes every index before it publishes any."""
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        counts = np.concatenate(self._doc_seq_counts) if self._doc_seq_counts else np.zeros(0, np.int64)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        docs = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=docs[1:])
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, _CODE_OF[self.dtype], len(lengths), len(docs)))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(docs.astype("<i8").tobytes())

    def publish(self) -> None:
        """Move the written files into place (``.idx`` last, so a reader never pairs an old index)."""
        final_idx = idx_path(self.prefix)
        if os.path.exists(final_idx):
            os.unlink(final_idx)  # never pair an old .idx with the new .bin
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, final_idx)
        self._done = True

    def abort(self) -> None:
        """Discard the partial output (closing may fail again, flushing into a full disk: the files go anyway)."""
        if not self._bin.closed:
            try:
                self._bin.close()
            except OSError:
                pass
        for p in (self._bin_tmp, self._idx_tmp):
            if os.path.exists(p):
                os.unlink(p)
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._done:
            self.abort()
