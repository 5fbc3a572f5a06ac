"""Synthetic, learnable data for --mock-data: no files, same samples for a seed in every layout."""

from __future__ import annotations

import numpy as np


class MockGPTDataset:
    """Arithmetic token progressions: sample i starts at a random token and steps by a random
    stride from a small set, so a model can learn the rule and the loss visibly falls.

    Each sample depends only on (seed, index), never on the rank or layout.
    """

    STRIDES = (1, 2, 3, 5, 7)

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seq_length = seq_length
        self.vocab_size = vocab_size
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"mock sample {idx} out of range [0, {self.num_samples})")
        rng = np.random.default_rng([self.seed, idx])
        start = int(rng.integers(0, self.vocab_size))
        stride = self.STRIDES[int(rng.integers(0, len(self.STRIDES)))]
        tokens = (start + stride * np.arange(self.seq_length + 1, dtype=np.int64)) % self.vocab_size
        return {"text": tokens}
