"""GPT samples over an indexed dataset: fixed-length token windows in a seeded, cached order.

Megatron-core's ``GPTDataset`` with its defaults (one extra token per sample, no position-id or
attention-mask resets, the last partial sample dropped in every split): for the same files, split,
sequence length, sample count and seed, sample ``i`` here equals Megatron's sample ``i`` token for
token, so a Megatron run's data order can be reproduced. See :mod:`megalite.data.gpt_indices`.
"""

from __future__ import annotations

import logging
import os
import time

import numpy as np

from megalite.data import gpt_indices
from megalite.data.index_cache import IndexCache, array_digest
from megalite.data.indexed_dataset import IndexedDataset

log = logging.getLogger(__name__)

INDEX_FORMAT = "megalite-gpt-indices-1"
_NAMES = ("document_index", "sample_index", "shuffle_index")


def lengths_digest(indexed: IndexedDataset) -> str:
    """Hash of the sequence lengths, memoised on the dataset (the indices depend on nothing else in
    the files, so two datasets with equal lengths may share cached indices)."""
    cached = getattr(indexed, "_megalite_lengths_digest", None)
    if cached is None:
        cached = array_digest(indexed.sequence_lengths)
        indexed._megalite_lengths_digest = cached
    return cached


class GPTDataset:
    """Samples of ``seq_length + 1`` tokens drawn from the sequences ``documents`` of ``indexed``.

    ``num_samples`` is the number of samples wanted (the dataset holds at least that many: whole
    epochs); None means one epoch. With ``build`` False the indices must already be in the cache.
    """

    def __init__(self, indexed: IndexedDataset, documents: np.ndarray, num_samples: int | None,
                 seq_length: int, seed: int, split: str, cache_dir: str, *, build: bool,
                 add_extra_token: bool = True) -> None:
        self.indexed = indexed
        self.seq_length = seq_length
        self.add_extra_token = add_extra_token
        self.num_samples = num_samples
        self.split = split
        documents = np.asarray(documents, dtype=np.int32)
        key = {
            "format": INDEX_FORMAT,
            "lengths": lengths_digest(indexed),
            "num_sequences": len(indexed),
            "documents": [int(documents[0]), int(documents[-1]) + 1] if len(documents) else [0, 0],
            "contiguous": bool(len(documents) == 0 or documents[-1] - documents[0] + 1 == len(documents)),
            "num_samples": num_samples,
            "seq_length": seq_length,
            "seed": seed,
            "add_extra_token": add_extra_token,
            "drop_last_partial": True,
        }
        if not key["contiguous"]:
            key["documents_digest"] = array_digest(documents)
        self.cache = IndexCache(cache_dir, "GPTDataset", split, key, _NAMES)

        def compute() -> dict[str, np.ndarray]:
            t0 = time.perf_counter()
            arrays = dict(zip(_NAMES, gpt_indices.build_gpt_indices(
                indexed.sequence_lengths, documents, num_samples, seq_length, seed, add_extra_token)))
            log.info("built %s GPT indices for %s: %d samples in %.2f s", split, indexed.path_prefix,
                     len(arrays["sample_index"]) - 1, time.perf_counter() - t0)
            return arrays

        arrays, _ = self.cache.get_or_build(build, compute, {"dataset": indexed.path_prefix})
        self._set_arrays(arrays)

    def _set_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for name in _NAMES:  # re-mapped from the cache rather than pickled
            state.pop(name)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._set_arrays(self.cache.load())

    def __len__(self) -> int:
        return len(self.sample_index) - 1

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        return {"text": self.tokens(idx)}

    def tokens(self, idx: int) -> np.ndarray:
        """The ``seq_length + 1`` tokens (int64) of sample ``idx``."""
        n = len(self)
        if not 0 <= idx < n:
            raise IndexError(f"sample {idx} out of range [0, {n}) "
                             f"({self.split} split of {self.indexed.path_prefix})")
        j = int(self.shuffle_index[idx])
        first, first_off = (int(x) for x in self.sample_index[j])
        last, last_off = (int(x) for x in self.sample_index[j + 1])
        extra = int(self.add_extra_token)
        get = self.indexed.get
        if first == last:
            parts = [get(int(self.document_index[first]), first_off, last_off - first_off + extra)]
        else:
            parts = [get(int(self.document_index[first]), first_off)]
            parts += [get(int(d)) for d in self.document_index[first + 1:last]]
            parts.append(get(int(self.document_index[last]), 0, last_off + extra))
        return np.concatenate(parts).astype(np.int64)

    def document_starts(self, idx: int) -> np.ndarray:
        """The input positions (1..seq_length-1) of sample ``idx`` where a sequence of the document index
        begins (--dataloader-inter-document-masking): read from the sample and document indices and the
        sequence lengths, not from the tokens."""
        j = int(self.shuffle_index[idx])
        first, first_off = (int(x) for x in self.sample_index[j])
        last = int(self.sample_index[j + 1][0])
        if first == last:
            return np.empty(0, dtype=np.int64)
        parts = self.indexed.sequence_lengths[self.document_index[first:last]].astype(np.int64)
        parts[0] -= first_off
        starts = np.cumsum(parts)  # where documents first + 1 .. last begin in the sample
        return np.unique(starts[(starts > 0) & (starts < self.seq_length)])


class BlendedDataset:
    """Samples drawn from several datasets in proportion to ``weights``; each position takes the dataset
    furthest behind its share. The two index arrays are cached like the GPT indices."""

    def __init__(self, datasets: list, weights: list[float], size: int, split: str, cache_dir: str, *,
                 build: bool, names: list[str] | None = None) -> None:
        if any(w <= 0 for w in weights):
            raise ValueError(f"blend weights must be positive, got {weights}")
        self.datasets = datasets
        self.weights = _normalize(weights)
        self.size = size
        self.split = split
        key = {
            "format": INDEX_FORMAT,
            "datasets": [d.cache.hash for d in datasets],
            "weights": self.weights,
            "size": size,
        }
        self.cache = IndexCache(cache_dir, "BlendedDataset", split, key,
                                ("dataset_index", "dataset_sample_index"))
        names = names or [getattr(getattr(d, "indexed", None), "path_prefix", str(i))
                          for i, d in enumerate(datasets)]

        def compute() -> dict[str, np.ndarray]:
            which, nth = gpt_indices.blending_indices(self.weights, size)
            counts = np.bincount(which, minlength=len(datasets)) if size else np.zeros(len(datasets), int)
            for d, (count, ds) in enumerate(zip(counts, datasets)):
                if count > len(ds):
                    raise ValueError(
                        f"the {split} blend takes {count} samples from {names[d]}, which has {len(ds)}; "
                        f"raise --mid-level-dataset-surplus")
            return {"dataset_index": which, "dataset_sample_index": nth}

        arrays, _ = self.cache.get_or_build(build, compute, {"datasets": names})
        self._set_arrays(arrays)

    def _set_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.pop("dataset_index")
        state.pop("dataset_sample_index")
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._set_arrays(self.cache.load())

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"blended sample {idx} out of range [0, {len(self)})")
        return self.datasets[int(self.dataset_index[idx])][int(self.dataset_sample_index[idx])]

    def document_starts(self, idx: int) -> np.ndarray:
        """The document starts of blended sample ``idx``: those of the sample it is (GPTDataset.document_starts)."""
        return self.datasets[int(self.dataset_index[idx])].document_starts(int(self.dataset_sample_index[idx]))


def _normalize(weights: list[float]) -> list[float]:
    w = np.asarray(weights, dtype=np.float64)
    return (w / w.sum()).tolist()


def default_cache_dir(prefix: str, kind: str = "GPTDataset") -> str:
    """Where a dataset's indices go without --data-cache-path: a ``cache`` folder beside the data."""
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", f"{kind}_indices")
