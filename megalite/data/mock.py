"""Synthetic, learnable data for --mock-data: no files, same samples for a seed in every layout."""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """Arithmetic token progressions: sample i starts at a random token and steps by a random
    stride from a small set, so a model can learn the rule and the loss visibly falls.

    The progressions run over every id, the EOD id included, so that id shows up at arbitrary places. With
    ``eod`` given (any packed-document flag on) a sample is instead EOD-terminated documents, each a
    progression over the other ids, so --eod-mask-loss and the resets have documents to act on (the
    stream without ``eod`` is unchanged). Each sample depends only on (seed, index), never on the rank
    or layout.
    """

    STRIDES = (1, 2, 3, 5, 7)

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int, eod: int | None = None
                 ) -> None:
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed
        self.eod = eod

    def __len__(self) -> int:
        return self.num_samples

    def _rng(self, idx: int) -> np.random.Generator:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range [0, {self.num_samples})")
        return np.random.default_rng([self.seed, idx])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        rng = self._rng(idx)
        if self.eod is not None:
            return {"text": self._documents(rng)[0]}
        start = int(rng.integers(0, self.vocab_size))
        stride = self.STRIDES[int(rng.integers(0, len(self.STRIDES)))]
        tokens = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return {"text": tokens}

    def document_starts(self, idx: int) -> np.ndarray:
        """The input positions where sample ``idx``'s documents begin (right after each of its EODs)."""
        if self.eod is None:
            return np.empty(0, dtype=np.int64)
        return self._documents(self._rng(idx))[1]

    def _documents(self, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """``seq_length + 1`` tokens of documents of 2 to seq/2 tokens (a progression, then EOD; the last
        one cut off), and the starts of the documents after the first."""
        n, eod, others = self.seq_length + 1, int(self.eod), self.vocab_size - 1
        text = np.empty(n, dtype=np.int64)
        starts, pos = [], 0
        while pos < n:
            length = int(rng.integers(2, max(2, n // 2) + 1))
            start = int(rng.integers(0, others))
            stride = self.STRIDES[int(rng.integers(0, len(self.STRIDES)))]
            body = (start + stride * np.arange(length - 1, dtype=np.int64)) % others
            doc = np.append(body + (body >= eod), eod)  # the ids other than eod, then eod
            take = min(length, n - pos)
            text[pos:pos + take] = doc[:take]
            pos += take
            if pos < self.seq_length:
                starts.append(pos)
        return text, np.asarray(starts, dtype=np.int64)
