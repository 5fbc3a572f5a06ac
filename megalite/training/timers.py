"""Per-phase timers: where an iteration's time goes, and how much of it is communication.

Phases: batch-generator (data), forward-compute, backward-compute, pipeline-wait (p2p receives),
grads-reduce (DP/TP/embedding gradient sync not hidden behind backward), optimizer (step and param
all-gather). With --timing-log-level >= 1 the device is synchronized at phase boundaries so GPU
timings are real; the min/max over ranks are logged every --log-interval.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from megalite import device
from megalite.parallel.groups import Group, ProcessGroups

PHASES = ["batch-generator", "forward-compute", "backward-compute", "pipeline-wait", "grads-reduce", "optimizer"]
COMM_PHASES = {"pipeline-wait", "grads-reduce"}


class Timers:
    def __init__(self, level: int) -> None:
        self.level = level
        self.elapsed: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self.level <= 0:
            yield
            return
        device.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            device.synchronize()
            self.elapsed[name] += time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        if self.level > 0:
            self.elapsed[name] += seconds

    def reset(self) -> None:
        self.elapsed.clear()

    def report(self, pg: ProcessGroups, iterations: int, step_seconds: float) -> tuple[str, dict[str, float]]:
        """The timers line (min/max ms per iteration over all ranks) and the max-over-ranks values."""
        vals = torch.tensor([self.elapsed.get(p, 0.0) / max(iterations, 1) for p in PHASES], dtype=torch.float64)
        lo, hi = vals.clone(), vals.clone()
        pg.all_reduce(lo, Group.WORLD, op=dist.ReduceOp.MIN)
        pg.all_reduce(hi, Group.WORLD, op=dist.ReduceOp.MAX)
        parts = [f"{p}: ({1e3 * a:.1f}, {1e3 * b:.1f})" for p, a, b in zip(PHASES, lo.tolist(), hi.tolist())]
        comm = sum(b for p, b in zip(PHASES, hi.tolist()) if p in COMM_PHASES)
        share = comm / step_seconds if step_seconds > 0 else 0.0
        compute_lo = lo[1] + lo[2]
        imbalance = float((hi[1] + hi[2]) / compute_lo) if compute_lo > 0 else 1.0
        line = (" (min, max) time across ranks (ms): " + " | ".join(parts)
                + f" | communication share: {share:.1%} | compute imbalance (max/min): {imbalance:.2f}")
        return line, {**dict(zip(PHASES, hi.tolist())), "communication_share": share, "imbalance": imbalance}
