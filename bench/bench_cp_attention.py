"""Context-parallel attention alone (docs/parallelism.md, "Context parallelism: the attention"): bytes per
rank against the formula, the bytes autograd saves per rank against serial attention, and the time of
one forward + backward for the ring (p2p), a2a and allgather, at c = 1 (serial), 2 and 4.

Each CP size runs on its own gloo ranks (tests/harness.py). Per rank and comm type: the bytes
``ProcessGroups.comm_bytes`` counted (checked exactly against the formula), the bytes of the distinct
storages autograd saved for backward (saved-tensor hooks), and the median over REPS of forward +
backward time (the slowest rank). The serial baseline is PyTorch's SDPA over the full sequence in the
same processes (rank 0). Times on this shared 2-core machine move with its load; c = 4 puts 4 ranks on
2 cores, so only the ratios between comm types at the same c mean something there.

    OMP_NUM_THREADS=1 python bench/bench_cp_attention.py            # about a minute on 2 cores
    OMP_NUM_THREADS=1 python bench/bench_cp_attention.py --seq 2048
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.context_parallel import context_parallel_attention, zigzag_split  # noqa: E402
from megalite.parallel.groups import Group, ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

B, NQ, NKV, D = 1, 8, 4, 64
REPS = 5
COMM_TYPES = ("p2p", "a2a", "allgather")


def formula(comm: str, c: int, s: int) -> int:
    """docs/parallelism.md's table: forward + backward bytes per rank, fp32 (e = 4)."""
    sl, e = s // c, 4
    kv = 2 * B * NKV * sl * D * e
    if c == 1:
        return 0
    return {"p2p": 3 * (c - 1) * kv, "a2a": 2 * (NQ + 2 * NKV + NQ) * B * sl * D * e, "allgather": 2 * c * kv}[comm]


def saved_bytes(fn) -> tuple[torch.Tensor, int]:
    """Run ``fn`` and count the distinct storages autograd saves for its backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def timed(fn, dout: torch.Tensor, pg: ProcessGroups) -> float:
    times = []
    for _ in range(REPS):
        pg.barrier()
        start = time.perf_counter()
        fn().backward(dout)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _rank(rank: int, world: int, s: int) -> dict:
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, n, s, D) for n in (NQ, NKV, NKV, NQ))
    pg = ProcessGroups.build(RankLayout(world, cp=world), rank) if world > 1 else ProcessGroups.single()
    out = {}
    if rank == 0:
        full = [t.clone().requires_grad_() for t in (q, k, v)]
        serial = lambda: F.scaled_dot_product_attention(*full, is_causal=True, enable_gqa=True)  # noqa: E731
        out["serial"] = (saved_bytes(serial)[1], timed(serial, dout, ProcessGroups.single()), 0)
    local = [zigzag_split(t, 2, world, rank).requires_grad_() for t in (q, k, v)]
    dl = zigzag_split(dout, 2, world, rank)
    for comm in COMM_TYPES:
        run = functools.partial(context_parallel_attention, *local, pg, comm)
        pg.comm_bytes.clear()
        res, saved = saved_bytes(run)
        res.backward(dl)
        sent = sum(n for (kind, _), n in pg.comm_bytes.items() if kind == Group.CP)
        out[comm] = (saved, timed(run, dl, pg), sent)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=1024)
    args = parser.parse_args()
    s = args.seq
    print(f"b {B}, heads {NQ}, query groups {NKV}, head size {D}, sequence {s}, fp32; {os.cpu_count()} CPU "
          f"cores, load average {os.getloadavg()[0]:.1f}")
    print("| c | comm type | bytes per rank (formula) | saved for backward / serial | time / serial | time / ring |")
    print("|---|---|---|---|---|---|")
    for c in (1, 2, 4):
        ranks = run_ranks(_rank, c, s, timeout=600)
        serial_saved, serial_time, _ = ranks[0]["serial"]
        ring_time = max(r["p2p"][1] for r in ranks)
        for comm in COMM_TYPES:
            sent = {r[comm][2] for r in ranks}
            assert sent == {formula(comm, c, s)}, (comm, c, sent, formula(comm, c, s))
            saved = max(r[comm][0] for r in ranks)
            t = max(r[comm][1] for r in ranks)
            print(f"| {c} | {comm} | {sent.pop() / 2**20:.2f} MiB (exact) | {saved / serial_saved:.2f} | "
                  f"{t / serial_time:.2f} | {t / ring_time:.2f} |", flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
