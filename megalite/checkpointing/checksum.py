"""Checksums of checkpoint files: recorded in metadata.json at save time, checked when a file is opened
for loading, so a damaged or partly copied file is named instead of silently loaded."""

from __future__ import annotations

import zlib


def file_checksum(path: str, chunk: int = 1 << 24) -> str:
    """CRC-32 of a file's bytes: fast enough to compute at every save and check at every load (a
    bit flip or truncated copy is then named instead of loaded; bench/bench_checkpoint.py measures it)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return f"crc32:{crc:08x}"
