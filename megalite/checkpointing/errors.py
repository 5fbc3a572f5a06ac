"""Errors of checkpoint reading and writing: entry points catch :class:`CheckpointError` and print its
message (which names the directory or file) instead of a traceback."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, corrupt or inconsistent; the message names the file."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """``--load`` names no checkpoint (no tracker file there); also a FileNotFoundError."""
