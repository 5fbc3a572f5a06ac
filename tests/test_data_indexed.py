"""Promises: megalite's .bin/.idx are byte-identical to megatron-core's for the same content, each tool
reads the other's files, and a corrupt or truncated pair is reported with the file and the reason."""

from __future__ import annotations

import os
import struct
import subprocess
import sys

import numpy as np
import pytest

from megalite.data.indexed_dataset import (
    HEADER_SIZE,
    MAGIC,
    CorruptDatasetError,
    IndexedDataset,
    IndexedDatasetWriter,
    token_dtype,
)
from tests.data_fixtures import import_mcore, random_indexed, scratch_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _docs(seed=0):
    rng = np.random.default_rng(seed)
    # Documents of 1-3 sequences, plus an empty document (no sequences), as Megatron writes them.
    docs = []
    for i in range(40):
        lengths = [] if i == 7 else [int(x) for x in rng.integers(1, 30, int(rng.integers(1, 4)))]
        docs.append((rng.integers(0, 60000, sum(lengths)), lengths))
    return docs


def _write_ours(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for tokens, lengths in docs:
            w.add_document(tokens, lengths)
        w.finalize()


def _write_mcore(prefix, docs, dtype):
    _, _, _, mi, _ = import_mcore()
    b = mi.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for tokens, lengths in docs:
        b.add_document(tokens.astype(np.int64), lengths)
    b.finalize(prefix + ".idx")


def _read_bytes(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_files_are_byte_identical_to_megatron_and_read_both_ways(dtype):
    d = scratch_dir("idx")
    docs = _docs()
    _write_ours(os.path.join(d, "ours"), docs, dtype)
    _write_mcore(os.path.join(d, "ref"), docs, dtype)
    assert _read_bytes(os.path.join(d, "ours")) == _read_bytes(os.path.join(d, "ref"))

    _, _, _, mi, _ = import_mcore()
    ref_reader = mi.IndexedDataset(os.path.join(d, "ours"))
    our_reader = IndexedDataset(os.path.join(d, "ref"))
    flat = [t for tokens, lengths in docs for t in np.split(tokens, np.cumsum(lengths)[:-1]) if len(lengths)]
    assert len(ref_reader) == len(our_reader) == len(flat)
    for i, seq in enumerate(flat):
        assert np.array_equal(ref_reader[i], seq) and np.array_equal(our_reader[i], seq)
    assert np.array_equal(our_reader.document_indices, ref_reader.document_indices)
    assert our_reader.num_documents == len(docs)
    assert np.array_equal(our_reader.get(3, 1, 2), flat[3][1:3])


def test_header_layout_and_dtype_rule():
    d = scratch_dir("hdr")
    prefix = os.path.join(d, "x")
    random_indexed(prefix, 5, seed=1)
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == MAGIC
    version, code, nseq, ndoc = struct.unpack("<QBQQ", raw[9:HEADER_SIZE])
    assert (version, code, nseq, ndoc) == (1, 8, 5, 6)
    assert token_dtype(65499) is np.uint16 and token_dtype(65500) is np.int32


def test_merge_tool_matches_megatron_merge():
    _, _, _, mi, _ = import_mcore()
    d = scratch_dir("merge")
    parts = []
    for k in range(3):
        parts.append(os.path.join(d, f"part{k}"))
        _write_ours(parts[-1], _docs(seed=k), np.uint16)
    b = mi.IndexedDatasetBuilder(os.path.join(d, "ref.bin"), dtype=np.uint16)
    for p in parts:
        b.add_index(p)
    b.finalize(os.path.join(d, "ref.idx"))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "merge_datasets.py"), "--input", *parts,
                          "--output-prefix", os.path.join(d, "merged")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert _read_bytes(os.path.join(d, "merged")) == _read_bytes(os.path.join(d, "ref"))


def _corrupt(tmp, name, mutate_idx=None, mutate_bin=None):
    prefix = os.path.join(tmp, name)
    random_indexed(prefix, 6, seed=2)
    for ext, fn in ((".idx", mutate_idx), (".bin", mutate_bin)):
        if fn:
            data = open(prefix + ext, "rb").read()
            open(prefix + ext, "wb").write(fn(data))
    return prefix


@pytest.mark.parametrize("name,mutate_idx,mutate_bin,message", [
    ("magic", lambda b: b"XXXXXXXXX" + b[9:], None, r"bad\.idx: not an indexed dataset index \(bad magic"),
    ("empty", lambda b: b"", None, r"empty\.idx: empty file"),
    ("header", lambda b: b[:20], None, r"header\.idx: truncated header"),
    ("version", lambda b: b[:9] + struct.pack("<Q", 2) + b[17:], None,
     r"version\.idx: unsupported index version 2"),
    ("dtype", lambda b: b[:17] + bytes([9]) + b[18:], None, r"dtype\.idx: unknown token dtype code 9"),
    ("short_idx", lambda b: b[:-8], None, r"short_idx\.idx: index truncated"),
    ("long_idx", lambda b: b + b"\0" * 3, None, r"long_idx\.idx: index has trailing bytes"),
    ("short_bin", None, lambda b: b[:-2], r"short_bin\.bin: data file truncated: \d+ bytes, .* promises \d+"),
    ("long_bin", None, lambda b: b + b"\0\0", r"long_bin\.bin: data file longer than its index says"),
    # 6 sequences: the pointers start after the header and 6 int32 lengths; break the second one.
    ("pointer", lambda b: b[:HEADER_SIZE + 32] + struct.pack("<q", 5) + b[HEADER_SIZE + 40:], None,
     r"pointer\.idx: sequence pointer 1 is 5"),
    ("docs", lambda b: b[:-8] + struct.pack("<q", 4), None,
     r"docs\.idx: document index must start at 0 and end"),
])
def test_corrupt_files_are_named_with_the_reason(name, mutate_idx, mutate_bin, message):
    tmp = scratch_dir("corrupt")
    prefix = _corrupt(tmp, "bad" if name == "magic" else name, mutate_idx, mutate_bin)
    with pytest.raises(CorruptDatasetError, match=message):
        IndexedDataset(prefix)


def test_missing_file_and_interrupted_writer():
    tmp = scratch_dir("missing")
    prefix = os.path.join(tmp, "half")
    random_indexed(prefix, 3, seed=0)
    os.unlink(prefix + ".bin")
    with pytest.raises(FileNotFoundError, match=r"half\.bin: no such file"):
        IndexedDataset(prefix)
    # A writer that fails mid-way leaves neither final file nor temporaries.
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(os.path.join(tmp, "crash"), np.uint16) as w:
            w.add_document([1, 2, 3])
            raise RuntimeError("interrupted")
    assert [f for f in os.listdir(tmp) if f.startswith("crash")] == []
    with pytest.raises(FileNotFoundError, match="output directory .* does not exist"):
        IndexedDatasetWriter(os.path.join(tmp, "no", "such", "dir"), np.uint16)
