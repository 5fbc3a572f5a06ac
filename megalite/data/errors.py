"""Errors of the data pipeline. Each is a :class:`DataError`, a ValueError (bad input the user can fix),
so entry points catch one type and print its message; the file errors are also OSErrors."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data, tokenizer or data flag; the message names the flag or file and the rule."""


class MissingFileError(FileNotFoundError, DataError):
    """A flag names a file that does not exist; the message names the flag or dataset and the path."""


class CorruptDatasetError(DataError):
    """A ``.bin/.idx`` pair is truncated or inconsistent; the message names the file and the reason."""


class CorruptCacheError(DataError):
    """A dataset index cache file (.npy) is truncated or its header is garbled; the message names the file
    and says to delete it (the builder rank rebuilds it)."""


class UnwritableError(PermissionError, DataError):
    """An output or cache location cannot be written; the message says which and what to do."""


class TokenRangeError(DataError):
    """A dataset holds a token id the tokenizer's vocabulary does not cover (at or past its size, i.e.
    in the padding or beyond the embedding); the message names the file, the id and the vocab size."""


class TokenizerError(DataError):
    """A tokenizer file is not what its flag expects (a merges file given as --vocab-file, a file that
    is not a SentencePiece model, ...); the message names the flag, the file and what it looks like."""
