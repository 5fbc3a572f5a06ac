"""Where sliding-window attention's time goes (bench_window_attention.py's run shape), by the profiler.

One forward + backward of ``core_attention`` at s = 8192 with full causal attention and with a window of 1024,
under ``torch.profiler``: the CPU time of SDPA's flash kernel calls (forward and backward) grouped by the
shape they run on, and for each group the query-key pairs it had to compute (a causal square counts its
triangle, a rectangle every pair) and so its rate against the one full causal call's. The windowed path's
other work (slicing, the log-sum-exp merges, the gradient sums) is the rest of its time.

    OMP_NUM_THREADS=1 python bench/profile_window_attention.py      # about a minute
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.attention import core_attention  # noqa: E402

B, NQ, NKV, D = 1, 8, 4, 64
KERNELS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
           "aten::_scaled_dot_product_flash_attention_for_cpu_backward")


def pairs(q_len: int, k_len: int, causal: bool) -> int:
    """Query-key pairs a call must compute: a causal call (top-left aligned) its lower triangle."""
    if not causal:
        return q_len * k_len
    return sum(min(i + 1, k_len) for i in range(q_len))


def run(q, k, v, window: int) -> dict:
    """{(kernel, q_len, k_len): [calls, cpu us]} for one forward + backward; and the step's total CPU us."""
    for t in (q, k, v):
        t.grad = None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        core_attention(q, k, v, 0.0, "auto", window=window).sum().backward()
    groups: dict = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.name in KERNELS and ev.input_shapes and len(ev.input_shapes[0]) == 4:
            q_len = ev.input_shapes[0][2] if "backward" not in ev.name else ev.input_shapes[1][2]
            k_len = ev.input_shapes[1][2] if "backward" not in ev.name else ev.input_shapes[2][2]
            g = groups[(ev.name.rsplit("_", 1)[-1] if "backward" in ev.name else "forward", q_len, k_len)]
            g[0] += 1
            g[1] += ev.self_cpu_time_total if "backward" not in ev.name else ev.cpu_time_total
    total = sum(e.self_cpu_time_total for e in prof.events())
    return {"groups": dict(groups), "total_us": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--tile", type=int, default=None, help="query rows per windowed tile (attention/window.py's "
                    "TILE) for this run")
    a = ap.parse_args()
    if a.tile:
        from megalite.attention import window

        window.TILE = a.tile
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, n, a.seq, D, generator=g).requires_grad_() for n in (NQ, NKV, NKV))
    run(q, k, v, a.window)  # warm-up
    full, win = run(q, k, v, 0), run(q, k, v, a.window)
    ref = {}
    for (kind, ql, kl), (n, us) in full["groups"].items():
        ref[kind] = us / (n * pairs(ql, kl, True))
    print(f"s = {a.seq}, window {a.window}, tile {a.tile or 'default'}; CPU time of one forward + backward "
          f"under the profiler: full causal "
          f"{full['total_us'] / 1e6:.3f} s, windowed {win['total_us'] / 1e6:.3f} s "
          f"(ratio {win['total_us'] / full['total_us']:.3f})")
    print("| path | kernel | q x k | calls | pairs (M) | CPU s | ns per pair | vs full causal |")
    print("|---|---|---|---|---|---|---|---|")
    kernel_s = 0.0
    for name, res in (("full", full), ("windowed", win)):
        for (kind, ql, kl), (n, us) in sorted(res["groups"].items()):
            causal = name == "full" or ql == kl
            p = n * pairs(ql, kl, causal)
            rate = us / p
            kernel_s += us / 1e6 if name == "windowed" else 0.0
            print(f"| {name} | {kind} | {ql} x {kl}{' causal' if causal else ''} | {n} | {p / 1e6:.2f} | "
                  f"{us / 1e6:.3f} | {rate * 1e3:.2f} | {rate / ref[kind]:.2f} |")
    print(f"windowed: flash kernels {kernel_s:.3f} s of {win['total_us'] / 1e6:.3f} s; the rest (slices, "
          f"merges, gradient sums) {win['total_us'] / 1e6 - kernel_s:.3f} s")


if __name__ == "__main__":
    main()
