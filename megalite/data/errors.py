"""Errors of the data pipeline. Each is a ValueError (bad input the user can fix), so callers that
validate flags can catch one type; the file errors are also OSErrors."""

from __future__ import annotations


class MissingFileError(FileNotFoundError, ValueError):
    """A flag names a file that does not exist; the message names the flag or dataset and the path."""


class CorruptDatasetError(ValueError):
    """A ``.bin/.idx`` pair is truncated or inconsistent; the message names the file and the reason."""


class UnwritableError(PermissionError, ValueError):
    """An output or cache location cannot be written; the message says which and what to do."""


class TokenRangeError(ValueError):
    """A dataset holds a token id the tokenizer's vocabulary does not cover (at or past its size, i.e.
    in the padding or beyond the embedding); the message names the file, the id and the vocab size."""
