"""On-disk cache of dataset index arrays (.npy), keyed by a hash of everything that determines them.

One process (the builder, global rank 0) computes and saves; after a barrier every other process maps
the same files read-only. Each array is written under a temporary name and renamed, and the
description (.json) is written last, so a half-written entry is never taken for a complete one.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np

from megalite.data.errors import CorruptCacheError, MissingFileError, UnwritableError


def digest(key: dict) -> str:
    """Stable hash of a JSON-able key."""
    return hashlib.md5(json.dumps(key, sort_keys=True).encode(), usedforsecurity=False).hexdigest()


def array_digest(array: np.ndarray) -> str:
    """Hash of an array's contents (e.g. the sequence lengths the indices are computed from)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(str(array.dtype).encode())
    h.update(memoryview(np.ascontiguousarray(array)).cast("B"))
    return h.hexdigest()


class IndexCache:
    """The cache entry ``{directory}/{hash}-{kind}-{split}-*`` for one key."""

    def __init__(self, directory: str, kind: str, split: str, key: dict, names: Sequence[str]) -> None:
        self.directory = directory
        self.key = key
        self.hash = digest(key)
        self.names = tuple(names)
        self._base = os.path.join(directory, f"{self.hash}-{kind}-{split}")

    def path(self, name: str) -> str:
        return f"{self._base}-{name}.npy"

    @property
    def description_path(self) -> str:
        return f"{self._base}-description.json"

    def complete(self) -> bool:
        return os.path.isfile(self.description_path) and all(os.path.isfile(self.path(n)) for n in self.names)

    def save(self, arrays: dict[str, np.ndarray], info: dict | None = None) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp_suffix = f".tmp-{os.getpid()}"
            for name in self.names:
                tmp = self.path(name) + tmp_suffix
                with open(tmp, "wb") as f:
                    np.save(f, arrays[name], allow_pickle=False)
                os.replace(tmp, self.path(name))
            tmp = self.description_path + tmp_suffix
            with open(tmp, "w") as f:
                json.dump({"key": self.key, **(info or {})}, f, indent=2, sort_keys=True)
            os.replace(tmp, self.description_path)
        except OSError as e:
            raise UnwritableError(
                f"cannot write the dataset index cache in {self.directory} ({e.strerror or e}); "
                f"point --data-cache-path at a writable directory") from e

    def load(self) -> dict[str, np.ndarray]:
        if not self.complete():
            raise MissingFileError(
                f"dataset index cache {self._base}-* is missing: the builder rank (global rank 0) writes "
                f"it before the barrier; with several nodes, --data-cache-path must be a directory "
                f"every node sees")
        return {n: _map_checked(self.path(n)) for n in self.names}

    def damaged(self) -> str | None:
        """Why a complete entry cannot be mapped (a truncated or garbled .npy), or None."""
        for name in self.names:
            try:
                _map_checked(self.path(name))
            except CorruptCacheError as e:
                return str(e)
        return None

    def get_or_build(self, build: bool, compute: Callable[[], dict[str, np.ndarray]],
                     info: dict | None = None) -> tuple[dict[str, np.ndarray], bool]:
        """Load the entry; if missing (or damaged) and ``build``, compute and save it first. Returns the
        arrays and whether they were computed now."""
        built = False
        why = self.damaged() if build and self.complete() else None
        if why is not None:  # the builder replaces it (the files are derived data); others only load
            print(f"warning: {why}; rebuilding it", file=sys.stderr, flush=True)
        if build and (why is not None or not self.complete()):
            self.save(compute(), info)
            built = True
        return self.load(), built


def _map_checked(path: str) -> np.ndarray:
    """The .npy at ``path`` mapped read-only, after its header is checked against the file's size (a
    truncated file, or a header claiming a huge shape, is named before numpy maps or allocates it)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            fmt = np.lib.format
            version = fmt.read_magic(f)
            read_header = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
            shape, fortran, dtype = read_header(f)
            offset = f.tell()
    except (OSError, ValueError) as e:
        raise CorruptCacheError(f"dataset index cache file {path} is unreadable ({e}): delete it (it is "
                                f"rebuilt by the next run)") from None
    if dtype.hasobject or fortran or any(int(d) < 0 for d in shape):
        raise CorruptCacheError(f"dataset index cache file {path} does not hold a plain array: delete it")
    need = offset + math.prod(int(d) for d in shape) * dtype.itemsize
    if need != size:
        raise CorruptCacheError(f"dataset index cache file {path} is {size} bytes, its header says {need} "
                                f"(truncated or damaged): delete it (it is rebuilt by the next run)")
    return np.load(path, mmap_mode="r", allow_pickle=False)
