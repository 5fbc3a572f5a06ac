"""Byte-stable safetensors files: the library writes a file's ``__metadata__`` entries in the order of a
hash map seeded afresh for each file, so two writes of the same tensors and metadata can differ in their
header (the optimizer files have two entries). Sorting them makes a checkpoint's bytes, and so its
checksums, depend only on what it holds: a synchronous and an asynchronous save, or two runs, agree."""

from __future__ import annotations

import json
import struct


def sort_metadata(path: str) -> None:
    """Rewrite the header of the safetensors file ``path`` in place with its metadata entries sorted by
    key. The same entries in another order are the same number of bytes, so nothing else moves."""
    with open(path, "r+b") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        raw = f.read(size)
        text = raw.rstrip(b" ")
        header = json.loads(text)
        meta = header.get("__metadata__")
        if not meta or list(meta) == sorted(meta):
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        new = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        if len(new) != len(text):  # not the library's spelling of JSON: leave the file as it is
            return
        f.seek(8)
        f.write(new)
