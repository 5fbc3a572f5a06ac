"""The largest token id of each ``.bin`` file, checked against the tokenizer's vocabulary size when the
data is opened: an id at or past the vocab size would index the embedding's padding (a silently
untrained row) or past it (an IndexError or inf loss mid-run). One pass over the tokens, cached beside
the sample indices so that later runs on the same file read one number."""

from __future__ import annotations

import os

import numpy as np

from megalite.data.errors import TokenRangeError
from megalite.data.index_cache import IndexCache
from megalite.data.indexed_dataset import IndexedDataset, bin_path


def _cache(prefix: str, directory: str) -> IndexCache:
    path = bin_path(prefix)
    st = os.stat(path)
    key = {"bin": os.path.abspath(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    return IndexCache(directory, "TokenRange", "all", key, ("max_id",))


def cache_max_id(indexed: IndexedDataset, directory: str) -> None:
    """Builder side: compute and store the file's largest id, unless the cache already holds it."""
    _cache(indexed.path_prefix, directory).get_or_build(
        True, lambda: {"max_id": np.array([indexed.max_token_id()], dtype=np.int64)})


def check_max_id(prefix: str, directory: str, vocab_size: int) -> None:
    """Every rank, after the builder's barrier: raise if the cached largest id is outside the vocab."""
    top = int(_cache(prefix, directory).load()["max_id"][0])
    if top >= vocab_size:
        raise TokenRangeError(
            f"{bin_path(prefix)} holds token id {top}, but the tokenizer's vocab size is {vocab_size} "
            f"(ids must be below it; larger ones fall in the embedding's padding or past it): the data was "
            "tokenized with another tokenizer; retokenize it, or pass the --tokenizer-type/--vocab-file/"
            "--vocab-size it was made with")
