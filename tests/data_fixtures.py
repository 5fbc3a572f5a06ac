"""Shared, once-per-process data for the data tests: a small real corpus, a tokenizer trained on it,
indexed datasets, and helpers to build megatron-core's datasets for comparison."""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import tempfile
import warnings

import numpy as np

from megalite.data.default_corpus import iter_documents
from megalite.data.indexed_dataset import IndexedDatasetWriter
from megalite.data.tokenizer_training import train_bpe

EXTRA_TEXTS = ["", "ünïcödé 日本語 🙂 text", "hello <|endoftext|> world", "  leading and trailing  \n\n"]


def scratch_dir(name: str) -> str:
    """A temporary folder removed when the test process exits."""
    path = tempfile.mkdtemp(prefix=f"megalite-{name}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def corpus_texts() -> tuple[str, ...]:
    """~150 KB of real text (standard library source and docstrings) plus edge cases."""
    return tuple(d["text"] for d in iter_documents(max_bytes=150_000)) + tuple(EXTRA_TEXTS)


@functools.cache
def tiny_bpe() -> dict[str, str]:
    """A 600-token byte-level BPE trained on corpus_texts (vocab_file, merge_file, tokenizer_json)."""
    out = train_bpe(corpus_texts(), 600, scratch_dir("bpe"))
    out["dir"] = os.path.dirname(out["vocab_file"])
    return out


def bpe_fields() -> dict:
    t = tiny_bpe()
    return {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": t["vocab_file"],
            "merge_file": t["merge_file"]}


def write_jsonl(path: str, rows: list, raw_lines: dict[int, str] | None = None) -> str:
    """Rows as jsonl; ``raw_lines`` replaces given 0-based lines verbatim (for malformed input)."""
    with open(path, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            line = raw_lines[i] if raw_lines and i in raw_lines else json.dumps(row)
            f.write(line + "\n")
    return path


def random_indexed(prefix: str, num_docs: int, seed: int, max_len: int = 60, vocab: int = 1000,
                   dtype=np.uint16) -> list[np.ndarray]:
    """An indexed dataset of random documents (one sequence each); returns the documents."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, vocab, int(rng.integers(1, max_len))) for _ in range(num_docs)]
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)
        w.finalize()
    return docs


@functools.cache
def random_datasets() -> tuple[str, ...]:
    """Three small random datasets of different sizes, shared by the GPT dataset tests."""
    d = scratch_dir("gpt")
    prefixes = []
    for k, n in enumerate((90, 140, 60)):
        prefixes.append(os.path.join(d, f"ds{k}"))
        random_indexed(prefixes[-1], n, seed=k)
    return tuple(prefixes)


def import_mcore():
    """megatron-core's dataset modules (a test reference only), imported quietly."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logging.getLogger("megatron").setLevel(logging.ERROR)
        from megatron.core.datasets import blended_megatron_dataset_builder as builder
        from megatron.core.datasets import gpt_dataset, helpers, indexed_dataset, utils
    return builder, gpt_dataset, helpers, indexed_dataset, utils


class RefTokenizer:
    """The few tokenizer attributes megatron-core's GPT dataset reads (``eod`` default: the last id)."""

    def __init__(self, vocab_size: int = 1001, eod: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1 if eod is None else eod
        self.unique_identifiers = {"class": "RefTokenizer", "vocab_size": vocab_size}


@functools.cache
def eod_corpus() -> str:
    """corpus_texts cut into paragraphs (thousands of short documents, one with "<|endoftext|>" inside, one
    empty), preprocessed with tiny_bpe and --append-eod (every document ends in EOD): the prefix."""
    from megalite.data.preprocess import PreprocessOptions, preprocess

    d = scratch_dir("eod-corpus")
    paragraphs = [p for t in corpus_texts() for p in t.split("\n\n") if p.strip()] + [""]
    jsonl = write_jsonl(os.path.join(d, "corpus.jsonl"), [{"text": t} for t in paragraphs])
    out = preprocess(PreprocessOptions(inputs=[jsonl], output_prefix=os.path.join(d, "corpus"), tokenizer=bpe_fields(),
                                       append_eod=True), log=lambda _m: None)
    return out.outputs["text"]


def mcore_datasets(data_path=None, per_split=None, split=None, sizes=(100, 20, 10), seq_length=16, seed=1234,
                   tokenizer=None, reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                   create_attention_mask=True):
    """megatron-core's train/valid/test datasets for the same inputs (index cache under the data)."""
    builder, gpt_dataset, _, _, utils = import_mcore()
    blend = utils.get_blend_from_list(data_path) if data_path else None
    blend_per_split = [utils.get_blend_from_list(p) for p in per_split] if per_split else None
    cfg = gpt_dataset.GPTDatasetConfig(
        random_seed=seed, sequence_length=seq_length, blend=blend, blend_per_split=blend_per_split,
        split=split, tokenizer=tokenizer or RefTokenizer(), reset_position_ids=reset_position_ids,
        reset_attention_mask=reset_attention_mask, eod_mask_loss=eod_mask_loss,
        create_attention_mask=create_attention_mask, path_to_cache=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return builder.BlendedMegatronDatasetBuilder(gpt_dataset.GPTDataset, list(sizes), lambda: True,
                                                     cfg).build()
