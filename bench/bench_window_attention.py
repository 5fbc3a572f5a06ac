"""Sliding-window attention's cost against full causal attention (attention/window.py; docs/design.md,
"Sliding windows"):

1. forward + backward of ``core_attention`` at s = 8192 (b 1, 8 query heads, 4 K/V groups, head dim 64, fp32,
   the CPU's SDPA flash kernel): full causal attention against a window of 1024 (--window-size 1023 0), in
   alternation in one process, CPU time (``time.process_time``, so other load on the machine counts less),
   median of REPS; the ratio, and the ratio of query-key pairs (the pieces' exact count against s(s+1)/2);
2. the CP ring's bytes (``--cp-comm-type p2p``), counted by running ``ring_positions``' formula on the same
   compaction the ring runs: per rank at c = 2, 4, 8 for s = 8192, W = 1024, against the ring without a window.

    OMP_NUM_THREADS=1 python bench/bench_window_attention.py          # about two minutes on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.attention import Documents, core_attention  # noqa: E402
from megalite.context_parallel.ring import Compaction  # noqa: E402
from megalite.context_parallel.zigzag import zigzag_chunks  # noqa: E402

REPS = 5
B, NQ, NKV, D = 1, 8, 4, 64


def step_s(q, k, v, window: int) -> float:
    for t in (q, k, v):
        t.grad = None
    start = time.process_time()
    core_attention(q, k, v, 0.0, "auto", window=window).sum().backward()
    return time.process_time() - start


def attention(seq: int, window: int, reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, seq, D, generator=g).requires_grad_() for n in (NQ, NKV, NKV))
    step_s(q, k, v, window)  # warm-up
    full, windowed = [], []
    for _ in range(reps):
        full.append(step_s(q, k, v, 0))
        windowed.append(step_s(q, k, v, window))
    f, w = statistics.median(full), statistics.median(windowed)
    pairs = Documents.whole(1, seq, window=window).work() / (seq * (seq + 1) // 2)
    print(f"s = {seq}, window {window}: full causal {f:.3f} s, windowed {w:.3f} s (CPU, fwd + bwd, median of "
          f"{reps}): ratio {w / f:.3f}; query-key pairs ratio {pairs:.3f}")


class _Counter:
    """A ring's view for the compaction (no process group: the sizes only)."""

    def __init__(self, n: int, r: int, s_local: int) -> None:
        self.n, self.r = n, r
        self.chunks_of = lambda j: zigzag_chunks(j, n, s_local)


def ring_bytes(seq: int, window: int) -> None:
    for c in (2, 4, 8):
        s_local = seq // c
        plan = Compaction(_Counter(c, 0, s_local), Documents.whole(1, seq, window=window), s_local)  # type: ignore[arg-type]
        rows = []
        for r in range(c):
            kv = sum(len(plan.keep(t + 1, (r - t) % c)) for t in range(c - 1))
            dkv = sum(len(plan.keep(1, (r - t) % c)) for t in range(1, c))
            rows.append((2 * kv + dkv) / (3 * (c - 1) * s_local))
        print(f"c = {c}: K/V + dK/dV positions each rank sends (fwd + bwd) / the ring's without a window: "
              f"max {max(rows):.4f}, min {min(rows):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=REPS)
    a = ap.parse_args()
    torch.manual_seed(0)
    attention(a.seq, a.window, a.reps)
    ring_bytes(a.seq, a.window)


if __name__ == "__main__":
    main()
