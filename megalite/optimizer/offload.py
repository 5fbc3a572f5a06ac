"""--optimizer-cpu-offload: the host memory pool the offloaded part of the optimizer lives in.

One contiguous host allocation (pinned where the build supports it: megalite/device.py) holds, for each
offloaded element, its fp32 main param, a staging copy of its gradient (device-to-host) and its two Adam
moments: 16 bytes per element, none of them on the device. The optimizer copies the gradients in, runs
AdamW on the host and copies the parameters back; on a CPU-only run the pool is still separate from the
model's tensors, so the copies and the host update are exercised there too.
"""

from __future__ import annotations

import torch

from megalite import device

ROWS = ("main", "grad", "exp_avg", "exp_avg_sq")


class HostPool:
    """``numel`` fp32 elements for each of ROWS in one host allocation, handed out in order by ``take``."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.data = device.host_empty(len(ROWS) * numel, torch.float32)
        self.rows = dict(zip(ROWS, self.data.view(len(ROWS), numel)))
        self.used = 0

    def take(self, n: int) -> dict[str, torch.Tensor]:
        """The next ``n`` elements of every row (views into the pool)."""
        if self.used + n > self.numel:
            raise ValueError(f"host pool of {self.numel} elements cannot hold {n} more after {self.used}")
        views = {name: row[self.used:self.used + n] for name, row in self.rows.items()}
        self.used += n
        return views

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @property
    def pinned(self) -> bool:
        return self.data.is_pinned() if self.numel else False


def offloaded_count(sizes: list[int], fraction: float) -> int:
    """How many of the leading slices (element counts, in order) go to the host: those that start before
    ``fraction`` of all elements (Megatron's --optimizer-offload-fraction splits by parameter too)."""
    limit, start = fraction * sum(sizes), 0
    for k, n in enumerate(sizes):
        if start >= limit:
            return k
        start += n
    return len(sizes)
