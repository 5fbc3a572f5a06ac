"""From data flags to train/valid/test datasets, with Megatron's blending and split rules.

* ``--data-path a`` with ``--split 969,30,1``: the documents of ``a`` are cut into three contiguous
  ranges in those proportions.
* ``--data-path 0.7 a 0.3 b``: each prefix is split the same way, each split is a blend; every
  dataset is asked for ``ceil(ceil(n * w) * (1 + surplus))`` samples and the blend holds
  ``sum(ceil(n * w))``.
* ``--data-path a b`` (no weights): each dataset is one epoch and they are blended by their sizes.
* ``--train-data-path/--valid-data-path/--test-data-path``: each split from its own prefixes.

Only the builder process computes index arrays; after ``barrier()`` the others load them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from megalite.config.data_values import blend_weights, split_proportions
from megalite.data.errors import DataError, MissingFileError
from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, default_cache_dir
from megalite.data.indexed_dataset import IndexedDataset, bin_path, idx_path
from megalite.data.token_range import cache_max_id, check_max_id

SPLITS = ("train", "valid", "test")


def parse_blend(values: list[str] | None, flag: str) -> tuple[list[str], list[float] | None] | None:
    """``['a']`` / ``['a', 'b']`` -> prefixes without weights; ``['0.7', 'a', '0.3', 'b']`` -> weighted
    (the rules: megalite.config.data_values)."""
    try:
        return blend_weights(values, flag)
    except ValueError as e:
        raise DataError(str(e)) from None


def parse_split(split: str) -> list[float]:
    """'969,30,1' -> normalised proportions (missing trailing entries are 0)."""
    try:
        return split_proportions(split)
    except ValueError as e:
        raise DataError(str(e)) from None


def split_bounds(split: list[float]) -> list[tuple[float, float] | None]:
    """Cumulative [start, end) fractions per split; None for an empty one."""
    edges = [0]
    for w in split:
        edges.append(edges[-1] + w)
    return [(a, b) if b > a else None for a, b in zip(edges[:-1], edges[1:])]


def split_documents(bounds: tuple[float, float], num_sequences: int) -> np.ndarray:
    begin = int(round(bounds[0] * float(num_sequences)))
    end = int(round(bounds[1] * float(num_sequences)))
    return np.arange(begin, end, dtype=np.int32)


@dataclass
class _Part:
    """One split of one prefix: its fraction range and how many samples to draw (None: one epoch)."""
    prefix: str
    bounds: tuple[float, float]
    num_samples: int | None


@dataclass
class _Blend:
    parts: list[_Part]
    weights: list[float] | None  # None: blend by the parts' sizes
    size: int | None


def plan(data_path: list[str] | None, split: str, per_split: list[list[str] | None],
         num_samples: tuple[int | None, int | None, int | None],
         surplus: float) -> list[_Part | _Blend | None]:
    """What each split is made of, without touching any file."""
    if data_path:
        blend = parse_blend(data_path, "--data-path")
        bounds = split_bounds(parse_split(split))
        return [_plan_split(blend, bounds[i], num_samples[i], surplus) for i in range(3)]
    flags = ("--train-data-path", "--valid-data-path", "--test-data-path")
    specs: list[_Part | _Blend | None] = []
    for i in range(3):
        blend = parse_blend(per_split[i], flags[i]) if per_split[i] else None
        if blend is not None and len(blend[0]) == 1:
            blend = (blend[0], None)  # a lone per-split prefix is used as is, weight or not
        specs.append(_plan_split(blend, (0.0, 1.0), num_samples[i], surplus) if blend else None)
    return specs


def _plan_split(blend, bounds, size, surplus):
    if bounds is None or size == 0:
        return None
    prefixes, weights = blend
    if len(prefixes) == 1 and weights is None:
        return _Part(prefixes[0], bounds, size)
    if weights is None:
        return _Blend([_Part(p, bounds, None) for p in prefixes], None, size)
    if size is None:
        raise ValueError("a weighted blend needs a sample count for every split it feeds")
    w = np.asarray(weights, dtype=np.float64)
    w = (w / w.sum()).tolist()
    target = [math.ceil(size * wi) for wi in w]
    parts = [_Part(p, bounds, math.ceil(t * (1 + surplus))) for p, t in zip(prefixes, target)]
    return _Blend(parts, w, sum(target))


def prefixes(specs: list[_Part | _Blend | None]) -> list[str]:
    """Every dataset prefix the plan reads, once each, in order."""
    out: dict[str, None] = {}
    for spec in specs:
        parts = [] if spec is None else spec.parts if isinstance(spec, _Blend) else [spec]
        out.update((part.prefix, None) for part in parts)
    return list(out)


def check_files(specs: list[_Part | _Blend | None]) -> None:
    """Every rank checks the inputs exist before anyone waits at a barrier."""
    for prefix in prefixes(specs):
        for path in (idx_path(prefix), bin_path(prefix)):
            if not os.path.isfile(path):
                raise MissingFileError(f"{path} not found (dataset prefix {prefix!r}); "
                                        f"prefixes name files without .bin/.idx")


class _Materializer:
    """Turns a plan into datasets, opening each indexed dataset once."""

    def __init__(self, seq_length: int, seed: int, cache_path: str | None, build: bool) -> None:
        self.seq_length, self.seed, self.cache_path, self.build = seq_length, seed, cache_path, build
        self._indexed: dict[str, IndexedDataset] = {}

    def indexed(self, prefix: str) -> IndexedDataset:
        if prefix not in self._indexed:
            self._indexed[prefix] = IndexedDataset(prefix)
        return self._indexed[prefix]

    def cache_dir(self, prefix: str, kind: str) -> str:
        return self.cache_path if self.cache_path else default_cache_dir(prefix, kind)

    def part(self, part: _Part, split: str) -> GPTDataset | None:
        indexed = self.indexed(part.prefix)
        docs = split_documents(part.bounds, len(indexed))
        if len(docs) == 0 or int(indexed.sequence_lengths[docs].sum(dtype=np.int64)) < 2:
            return None
        return GPTDataset(indexed, docs, part.num_samples, self.seq_length, self.seed, split,
                          self.cache_dir(part.prefix, "GPTDataset"), build=self.build)

    def blend(self, blend: _Blend, split: str) -> BlendedDataset | None:
        datasets = [self.part(p, split) for p in blend.parts]
        names = [p.prefix for p in blend.parts]
        for ds, name in zip(datasets, names):
            if ds is None:
                raise DataError(f"{name} has no documents in the {split} split; it cannot be blended")
        weights, size = blend.weights, blend.size
        if weights is None:
            weights = [len(d) for d in datasets]
            size = sum(weights) if size is None else min(size, sum(weights))
        return BlendedDataset(datasets, weights, size, split, self.cache_dir(names[0], "BlendedDataset"),
                              build=self.build, names=names)

    def __call__(self, specs):
        if self.build:  # the largest token id of each file, for check_max_id after the barrier
            for prefix in prefixes(specs):
                cache_max_id(self.indexed(prefix), self.cache_dir(prefix, "TokenRange"))
        out = []
        for split, spec in zip(SPLITS, specs):
            if spec is None:
                out.append(None)
            elif isinstance(spec, _Blend):
                out.append(self.blend(spec, split))
            else:
                out.append(self.part(spec, split))
        return tuple(out)


def build_gpt_datasets(data_path: list[str] | None, split: str, per_split: list[list[str] | None], *,
                       seq_length: int, seed: int, num_samples: tuple[int | None, int | None, int | None],
                       cache_path: str | None, surplus: float, is_builder: bool,
                       barrier: Callable[[], None] | None, vocab_size: int | None = None) -> tuple:
    """Build (builder) or load (others) the three splits; see the module docstring. With ``vocab_size``,
    every rank then checks each file's largest token id is below it (TokenRangeError otherwise)."""
    if seq_length < 1:
        raise ValueError(f"--seq-length must be positive, got {seq_length}")
    specs = plan(data_path, split, per_split, num_samples, surplus)
    check_files(specs)
    datasets = _Materializer(seq_length, seed, cache_path, build=True)(specs) if is_builder else None
    if barrier is not None:
        barrier()
    if vocab_size is not None:
        for prefix in prefixes(specs):
            check_max_id(prefix, cache_path or default_cache_dir(prefix, "TokenRange"), vocab_size)
    if datasets is None:
        datasets = _Materializer(seq_length, seed, cache_path, build=False)(specs)
    return datasets
