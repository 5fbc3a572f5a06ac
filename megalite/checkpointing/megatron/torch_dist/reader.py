"""Megatron-LM's ``torch_dist`` checkpoint folder read as full tensors, without torch's DCP reader.

An ``iter_XXXXXXX/`` of that format holds ``metadata.json`` (which backend wrote it), ``common.pt`` (the
non-tensor state: ``args``, ``iteration``, ...), ``.metadata`` (a pickled
torch.distributed.checkpoint ``Metadata``: for every key its full size and chunks, and where each chunk
lies) and the ``__R_N.distcp`` files. torch's FileSystemWriter writes each tensor chunk as one
``torch.save`` blob at (file, byte offset, length) and each byte item (``_extra_state``, RNG, optimizer
objects) as raw bytes; a byte item is read only when asked for (``object``: the distributed optimizer's
bucket sizes and step, a rank's RNG states). Every pickle goes through safe_pickle.py, and every
chunk is checked against its index entry (inside its tensor, its size, the tensor covered exactly once).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.megatron.safe_pickle import load_plain_pickle, load_torch_file
from megalite.config.strict_load import load_json

BACKEND = "torch_dist"


def _name(obj: Any) -> str:
    return type(obj).__name__


class DistCheckpoint:
    """One torch_dist iteration folder: ``keys()`` of its tensors, ``tensor(key)`` full, ``common`` its
    common state (``common['args']`` the run's arguments)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._data_bytes: int | None = None  # the .distcp files' bytes, once a tensor's claim is checked
        self._check_backend()
        self.common: dict[str, Any] = self._common()
        meta_path = os.path.join(folder, ".metadata")
        if not os.path.isfile(meta_path):
            raise CheckpointError(f"{meta_path} is missing: a torch_dist checkpoint needs its index")
        meta = load_plain_pickle(meta_path)
        if _name(meta) != "Metadata" or not isinstance(getattr(meta, "state_dict_metadata", None), dict):
            raise CheckpointError(f"{meta_path}: not a torch.distributed.checkpoint Metadata ({_name(meta)})")
        self._tensors = {k: v for k, v in meta.state_dict_metadata.items()
                         if _name(v) == "TensorStorageMetadata"}
        self._where: dict[tuple[str, tuple[int, ...]], Any] = {}
        self._bytes: dict[str, Any] = {}
        for index, info in (getattr(meta, "storage_data", None) or {}).items():
            offset = getattr(index, "offset", None)
            if offset is not None:
                self._where[str(index.fqn), tuple(offset)] = info
            else:
                self._bytes[str(index.fqn)] = info

    def _check_backend(self) -> None:
        path = os.path.join(self.folder, "metadata.json")
        try:
            with open(path) as f:  # the one strict reader: a key written twice or deep nesting is named
                backend = load_json(f.read(), path).get("sharded_backend")
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing: not a Megatron torch_dist checkpoint") from None
        except (ValueError, AttributeError) as e:
            raise CheckpointError(f"{path}: not readable JSON ({e})") from None
        if backend != BACKEND:
            raise CheckpointError(f"{path}: sharded_backend {backend!r} is not read (only {BACKEND!r}; "
                                  "convert zarr checkpoints with Megatron-LM first)")

    def _common(self) -> dict[str, Any]:
        path = os.path.join(self.folder, "common.pt")
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: a torch_dist checkpoint keeps its args there")
        common = load_torch_file(path)
        if not isinstance(common, dict):
            raise CheckpointError(f"{path}: holds a {type(common).__name__}, not the dict Megatron saves")
        return common

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].size)

    def object_names(self, key: str) -> list[str]:
        """The byte items of ``key``: itself, or a ShardedObject's ``key/shard_<offset>_<shape>`` items."""
        return sorted(n for n in self._bytes if n == key or n.startswith(key + "/"))

    def object(self, key: str) -> Any:
        """The byte item ``key`` (a ShardedObject: stored as ``key/shard_..``) unpickled safely, or None."""
        names = self.object_names(key)
        if not names:
            return None
        info = self._bytes[names[0]]
        path = os.path.join(self.folder, os.path.basename(str(info.relative_path)))
        blob = self._read(path, int(info.offset), int(info.length), key)
        return load_torch_file(blob, f"{path} ({key} at byte {info.offset})")

    def tensor(self, key: str) -> torch.Tensor:
        """The full tensor of ``key``, assembled from its chunks."""
        md = self._tensors[key]
        size = tuple(int(s) for s in md.size)
        props = getattr(md.properties, "state", None)
        dtype = props[0] if isinstance(props, tuple) and isinstance(props[0], torch.dtype) else None
        out: torch.Tensor | None = None
        self._check_claim(key, size, md.chunks)  # before anything of that size is allocated
        covered = torch.zeros(size, dtype=torch.bool)
        for chunk in md.chunks:
            offsets, sizes = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
            piece = self._chunk(key, offsets, sizes, size)
            if out is None:
                out = torch.empty(size, dtype=dtype or piece.dtype)
            where = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            if covered[where].any():
                raise CheckpointError(f"{self.folder}/.metadata: {key}: chunks overlap at offsets {offsets}")
            covered[where] = True
            out[where] = piece
        if out is None or not covered.all():
            raise CheckpointError(f"{self.folder}/.metadata: {key}: its chunks do not cover its size {size}")
        return out

    def _check_claim(self, key: str, size: tuple[int, ...], chunks: Any) -> None:
        """A size in .metadata is only believed when the chunks add up to it and the data files can hold
        it (at least a byte per element): a damaged index claiming a huge tensor is named, not allocated."""
        where = f"{self.folder}/.metadata: {key}"
        if any(n < 0 for n in size):
            raise CheckpointError(f"{where}: negative size {size}")
        numel = math.prod(size)
        parts = sum(math.prod(max(int(s), 0) for s in c.sizes) for c in chunks)
        if parts != numel:
            raise CheckpointError(f"{where}: its chunks hold {parts} elements, its size {size} has {numel}")
        if self._data_bytes is None:
            self._data_bytes = sum(os.path.getsize(os.path.join(self.folder, f)) for f in os.listdir(self.folder)
                                   if f.endswith(".distcp"))
        if numel > self._data_bytes:
            raise CheckpointError(f"{where}: its size {size} ({numel} elements) is more than the checkpoint's "
                                  f"data files ({self._data_bytes} bytes) hold: the index is damaged")

    def _chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...]
               ) -> torch.Tensor:
        if len(offsets) != len(size) or any(o < 0 or o + s > n for o, s, n in zip(offsets, sizes, size)):
            raise CheckpointError(f"{self.folder}/.metadata: {key}: chunk at {offsets} of size {sizes} lies "
                                  f"outside its tensor {size}")
        info = self._where.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{self.folder}/.metadata: {key}: no storage entry for its chunk at {offsets}")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{self.folder}/.metadata: {key}: stored with transforms "
                                  f"{list(info.transform_descriptors)} (compression); not read")
        path = os.path.join(self.folder, os.path.basename(str(info.relative_path)))
        blob = self._read(path, int(info.offset), int(info.length), key)
        piece = load_torch_file(blob, f"{path} ({key} at byte {info.offset})")
        if not isinstance(piece, torch.Tensor) or tuple(piece.shape) != sizes:
            got = tuple(piece.shape) if isinstance(piece, torch.Tensor) else type(piece).__name__
            raise CheckpointError(f"{path}: {key} at byte {info.offset} holds {got}, its index says {sizes}")
        return piece

    @staticmethod
    def _read(path: str, offset: int, length: int, key: str) -> bytes:
        try:
            with open(path, "rb") as f:
                f.seek(offset)
                blob = f.read(length)
        except FileNotFoundError:
            raise CheckpointError(f"{path} is missing (it holds {key})") from None
        if len(blob) != length:
            raise CheckpointError(f"{path} is truncated: {key} needs bytes {offset}..{offset + length}, "
                                  f"the file has {os.path.getsize(path)}")
        return blob
