"""Promises: the embedded default corpus is built from the Python standard library with no network,
deterministically, only when missing, and atomically; its data trains through build_datasets."""

from __future__ import annotations

import os

import numpy as np
import pytest

import megalite.data.default_corpus as dc
from megalite.data import DataConfig, build_datasets, build_tokenizer
from tests.data_fixtures import scratch_dir

SMALL = dict(max_bytes=200_000, vocab_size=600, workers=1, log=lambda _m: None)


def _contents(directory):
    return {f: open(os.path.join(directory, f), "rb").read() for f in sorted(os.listdir(directory))}


@pytest.fixture(scope="module")
def built():
    d = os.path.join(scratch_dir("corpus"), "corpus")
    return d, dc.ensure_default_corpus(d, **SMALL)


def test_build_is_deterministic_and_complete(built):
    d, paths = built
    assert paths == {"data_path": os.path.join(d, "stdlib_text_document"),
                     "vocab_file": os.path.join(d, "vocab.json"), "merge_file": os.path.join(d, "merges.txt")}
    other = os.path.join(scratch_dir("corpus2"), "c")
    dc.build_default_corpus(other, **dict(SMALL, workers=2))
    assert _contents(other) == _contents(d)  # same bytes, whatever the number of workers
    assert not [f for f in os.listdir(d) if f.startswith(".build-") or ".tmp" in f]


def test_ensure_reuses_a_built_corpus_and_rebuilds_a_partial_one(built, monkeypatch):
    d, paths = built
    monkeypatch.setattr(dc, "build_default_corpus", lambda *a, **k: pytest.fail("rebuilt a complete corpus"))
    assert dc.ensure_default_corpus(d) == paths
    monkeypatch.undo()
    partial = os.path.join(scratch_dir("corpus3"), "c")
    dc.build_default_corpus(partial, **SMALL)
    os.unlink(os.path.join(partial, "stdlib_text_document.idx"))  # as if interrupted before the .idx
    assert not dc.is_built(partial)
    dc.ensure_default_corpus(partial, **SMALL)
    assert _contents(partial) == _contents(d)


def test_corpus_is_real_stdlib_text_and_trains(built):
    d, paths = built
    files = dc.stdlib_files()
    assert "json/decoder.py" in files and files == sorted(files)
    assert not any(f.startswith(("test/", "encodings/")) for f in files)
    cfg = DataConfig(data_path=[paths["data_path"]], tokenizer_type="GPT2BPETokenizer",
                     vocab_file=paths["vocab_file"], merge_file=paths["merge_file"], split="90,10,0")
    tok = build_tokenizer(cfg)
    train, valid, test = build_datasets(cfg, seq_length=64, seed=1, num_samples=(32, 8, 0), tokenizer=tok,
                                        is_builder=True, barrier=None)
    assert test is None and len(train) >= 32 and len(valid) >= 8
    text = tok.detokenize(train[0]["text"].tolist())
    assert len(text) > 64 and np.all(train[0]["text"] < tok.vocab_size)
    first_doc = next(dc.iter_documents(max_bytes=1))["text"]
    assert tok.detokenize(tok.tokenize(first_doc)) == first_doc
