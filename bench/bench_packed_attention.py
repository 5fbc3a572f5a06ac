"""Packed documents and the ring's memory (docs/parallelism.md, "Packed documents"):

1. attention work inside documents: forward + backward of ``core_attention`` (the CPU's SDPA flash kernel)
   and of the ring's blockwise path (``--cp-comm-type p2p`` on one rank: the CP kernels and merges) over a
   sequence of 8 documents of 512 tokens against one document of 4096, in alternation, median of REPS;
   the ratio against Σ len_i² / s² = 1/8 (the work formula);
2. the ring in bf16 at c = 2 and 4 (gloo ranks, tests/harness.py): bytes autograd saves for backward per
   rank (distinct storages), bytes each rank sends, and the largest single tensor an operation returns
   during forward + backward (TorchDispatchMode) — the temporaries that were fp32 copies;
3. CP load balance with packed documents: the query-key pairs of each CP rank under the zigzag split
   (``zigzag_work``, exact arithmetic) over 2,000 sequences of 8,192 tokens packed with documents whose
   lengths are drawn from an exponential distribution of mean L (seeded): the mean and the 99th percentile
   of max rank / mean rank, at c = 2, 4, 8.

    OMP_NUM_THREADS=1 python bench/bench_packed_attention.py           # about a minute on 2 cores

Part 2 calls only ``context_parallel_attention(q, k, v, pg, "p2p")``, so the same file runs with
``--ring-only`` on an older checkout for the before/after table (bench/README.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.context_parallel import context_parallel_attention, zigzag_split  # noqa: E402
from megalite.parallel.groups import Group, ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from tests.asserts import LargestResult  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

REPS = 5
B, NQ, NKV, D = 1, 8, 4, 64


def _docs(lengths: list[int]):
    from megalite.attention import Documents

    cu = torch.tensor([0] + lengths).cumsum(0)
    return Documents.from_cu_seqlens(cu, 1, sum(lengths))


def _fwd_bwd(fn, q, k, v, dout) -> float:
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    start = time.perf_counter()
    fn(*leaves).backward(dout)
    return time.perf_counter() - start


def packed_ratio(seq: int, docs: int) -> None:
    from megalite.attention import core_attention

    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, n, seq, D) for n in (NQ, NKV, NKV, NQ))
    one, packed = _docs([seq]), _docs([seq // docs] * docs)
    pg = ProcessGroups.single()
    paths = {"core_attention (SDPA flash, per document)": lambda d: (lambda a, b, c: core_attention(a, b, c, 0.0,
                                                                                                  "auto", d)),
             "ring blocks (p2p, one rank)": lambda d: (lambda a, b, c: context_parallel_attention(
                 a, b, c, pg, "p2p", documents=d))}
    print(f"b {B}, heads {NQ}, query groups {NKV}, head size {D}, sequence {seq}, fp32; {docs} documents of "
          f"{seq // docs} vs one of {seq}; work formula {packed.work() / one.work():.4f}")
    print("| path | one document (s) | packed (s) | packed / one |")
    print("|---|---|---|---|")
    for name, make in paths.items():
        times = {"one": [], "packed": []}
        for _ in range(REPS):
            for key, d in (("one", one), ("packed", packed)):
                times[key].append(_fwd_bwd(make(d), q, k, v, dout))
        a, b = statistics.median(times["one"]), statistics.median(times["packed"])
        print(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} |", flush=True)


def _ring_rank(rank: int, world: int, seq: int) -> tuple[int, int, int]:
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(B, n, seq, D, dtype=torch.bfloat16) for n in (NQ, NKV, NKV, NQ))
    pg = ProcessGroups.build(RankLayout(world, cp=world), rank)
    local = [zigzag_split(t, 2, world, rank).requires_grad_() for t in (q, k, v)]
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    pg.comm_bytes.clear()
    with LargestResult() as big:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = context_parallel_attention(*local, pg, "p2p")
        out.backward(zigzag_split(dout, 2, world, rank))
    sent = sum(n for (kind, _), n in pg.comm_bytes.items() if kind == Group.CP)
    return sum(seen.values()), sent, big.nbytes


def ring_bytes(seq: int) -> None:
    print(f"\nring (p2p) in bf16, b {B}, heads {NQ}, query groups {NKV}, head size {D}, sequence {seq}")
    print("| c | saved for backward per rank | sent per rank | largest tensor |")
    print("|---|---|---|---|")
    for c in (2, 4):
        ranks = run_ranks(_ring_rank, c, seq, timeout=600)
        saved, sent, big = (max(r[i] for r in ranks) for i in range(3))
        print(f"| {c} | {saved / 2**20:.2f} MiB | {sent / 2**20:.2f} MiB | {big / 2**20:.2f} MiB |", flush=True)


def load_balance(seq: int = 8192, samples: int = 2000) -> None:
    import numpy as np

    from megalite.attention import Documents
    from megalite.context_parallel.zigzag import zigzag_work

    print(f"\nCP load balance, zigzag split, {samples} sequences of {seq} tokens of packed documents "
          "(exponential lengths of mean L): max rank / mean rank of the attention pairs")
    print("| L | c = 2 mean | c = 2 p99 | c = 4 mean | c = 4 p99 | c = 8 mean | c = 8 p99 |")
    print("|---|---|---|---|---|---|---|")
    for mean_len in (256, 1024, 4096):
        rng = np.random.default_rng(mean_len)
        rows = []
        for _ in range(samples):
            cuts = np.cumsum(np.maximum(1, rng.exponential(mean_len, size=4 * seq // mean_len + 8).astype(int)))
            bounds = [0] + [int(x) for x in cuts if x < seq] + [seq]
            rows.append(Documents(seq, (tuple(bounds),)))
        cells = []
        for c in (2, 4, 8):
            ratios = [max(w) / (sum(w) / c) for w in (zigzag_work(d, c) for d in rows)]
            cells += [f"{np.mean(ratios):.3f}", f"{np.percentile(ratios, 99):.3f}"]
        print(f"| {mean_len} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--docs", type=int, default=8)
    parser.add_argument("--ring-seq", type=int, default=2048)
    parser.add_argument("--ring-only", action="store_true", help="part 2 alone (it also runs on older checkouts)")
    args = parser.parse_args()
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f}")
    if not args.ring_only:
        packed_ratio(args.seq, args.docs)
        load_balance()
    ring_bytes(args.ring_seq)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
