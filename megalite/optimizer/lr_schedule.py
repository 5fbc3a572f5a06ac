"""Learning rate: linear warm-up from 0 to --lr, then constant, linear or cosine decay to --min-lr."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LRSchedule:
    lr: float
    min_lr: float
    warmup_iters: int
    decay_iters: int
    style: str = "cosine"

    def __call__(self, iteration: int) -> float:
        """Learning rate for optimizer step number ``iteration`` (0-based)."""
        if self.warmup_iters > 0 and iteration < self.warmup_iters:
            return self.lr * (iteration + 1) / self.warmup_iters
        if self.style == "constant":
            return self.lr
        span = max(self.decay_iters - self.warmup_iters, 1)
        frac = min(max(iteration - self.warmup_iters, 0) / span, 1.0)
        if self.style == "linear":
            coeff = 1.0 - frac
        elif self.style == "cosine":
            coeff = 0.5 * (math.cos(math.pi * frac) + 1.0)
        else:
            raise ValueError(f"--lr-decay-style must be constant, linear or cosine, got {self.style}")
        return self.min_lr + coeff * (self.lr - self.min_lr)
