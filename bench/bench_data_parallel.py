"""Data parallelism and the optimizer against docs/design.md §3.6-3.7: bytes per parameter, DP bytes per step,
and the step time with and without --overlap-grad-reduce.

All from real runs of ``pretrain()`` on gloo ranks spawned by tests/harness.py (mock data):

1. memory: after two steps, the storage each rank actually holds, by kind, divided by the rank's
   parameter count: model params (distinct storages, so the flat buffer of the distributed optimizer
   counts once, padding included), the gradient buffer (``GradBuffer.grad_data``, plus any ``.grad``
   outside it), fp32 main params (``optimizer.entries[i].main`` when it is not the weight itself), Adam
   moments (``exp_avg``, ``exp_avg_sq`` in ``optimizer.adam.state``). bf16, fp16 and fp32; d in {1, 2, 4};
   with and without --use-distributed-optimizer; against Megatron's table (bf16: 18, 6 + 12/d).
2. DP bytes per step: ``ProcessGroups.comm_bytes`` entries of the "dp" axis per step against the
   formula: one all-reduce of the gradient buffer per step, whatever the number of micro-batches
   (4 here); with the distributed optimizer a reduce-scatter of the same buffer and an all-gather of the
   parameter buffer. The counter holds the bytes handed to each collective (the full buffer); the bytes a
   ring algorithm puts on each rank's link follow from it and are shown too.
3. overlap: step time at DP = 2 with and without --overlap-grad-reduce (same buckets), timed in
   alternating blocks in one pair of processes so a busy machine slows both alike; the time of one
   all-reduce of the gradient buffer, measured in the same processes, bounds what overlap can hide.

    OMP_NUM_THREADS=1 python bench/bench_data_parallel.py              # all three (about 1.5 min on 2 cores)
    OMP_NUM_THREADS=1 python bench/bench_data_parallel.py --only memory # one of: memory, overlap
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.distributed.finalize import finalize_grads  # noqa: E402
from megalite.model.build import build_model  # noqa: E402
from megalite.optimizer.optimizer import MegaliteOptimizer  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.training.batches import build_run_data, global_batch  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from megalite.training.train_step import build_buffers, reported_loss, run_microbatches  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.run_counts import storage_by_kind  # noqa: E402

QUIET = lambda s: None  # noqa: E731
ITERS = 2
MICROBATCHES = 4  # per DP rank and step: the buffer must still be reduced once per step
MEM_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                 hidden_dropout=0.0, attention_dropout=0.0)
MEM_VOCAB = 1000
PRECISIONS = {"bf16": dict(bf16=True), "fp16": dict(fp16=True, initial_loss_scale=4096.0), "fp32": {},
              "bf16, bf16 grads": dict(bf16=True, grad_reduce_in_bf16=True)}
# Expected bytes per parameter (without, with the sharded optimizer), docs/design.md §3.6. bf16 is
# Megatron's table row; megalite's fp16 keeps fp32 gradients like bf16 (so not the table's fp16-grad row
# 4 + 16/d); fp32 main params are the weights themselves (Megatron's fp32 row, 16 and 8 + 8/d);
# --grad-reduce-in-bf16 halves the gradient buffer.
TABLE = {"bf16": (lambda d: 18.0, lambda d: 6 + 12 / d), "fp16": (lambda d: 18.0, lambda d: 6 + 12 / d),
         "fp32": (lambda d: 16.0, lambda d: 8 + 8 / d), "bf16, bf16 grads": (lambda d: 16.0, lambda d: 4 + 12 / d)}
ELEMENT = {"bf16": (2, 4), "fp16": (2, 4), "fp32": (4, 4), "bf16, bf16 grads": (2, 2)}  # (param, grad) bytes


def make_cfg(world: int, model: dict, vocab: int, iters: int, m: int = MICROBATCHES, **extra) -> MegaliteConfig:
    cfg = MegaliteConfig.from_flat(dict(
        model, micro_batch_size=1, global_batch_size=world * m, train_iters=iters, lr=1e-4,
        log_interval=1, eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=vocab, seed=1234, **extra))
    validate(cfg, world)
    return cfg


def groups(world: int, rank: int) -> ProcessGroups:
    return ProcessGroups.build(RankLayout(world), rank)


def _memory_worker(rank: int, world: int) -> dict:
    out = {}
    for prec, flags in PRECISIONS.items():
        for distopt in (False, True):
            cfg = make_cfg(world, MEM_MODEL, MEM_VOCAB, ITERS, use_distributed_optimizer=distopt, **flags)
            pg = groups(world, rank)
            res = pretrain(cfg, pg, log=QUIET)
            mem = storage_by_kind(res)
            assert mem["adam states"] == len(res.optimizer.entries), "Adam state missing: a step was skipped"
            buf = res.optimizer.buffers
            out[(prec, distopt)] = dict(
                mem=mem, skipped=res.skipped_iterations, buckets=sum(len(b.buckets) for b in buf),
                comm={f"{k[1]}": v // ITERS for k, v in pg.comm_bytes.items() if k[0] == "dp"})
    return out


def bench_memory() -> tuple[list[dict], list[dict]]:
    mem_rows, comm_rows = [], []
    for d in (1, 2, 4):
        results = run_ranks(_memory_worker, d, timeout=600)
        for prec in PRECISIONS:
            for distopt in (False, True):
                per_rank = [r[(prec, distopt)] for r in results]
                mems = [r["mem"] for r in per_rank]
                n = mems[0]["numel"]
                row = dict(precision=prec, d=d, distopt=distopt, params_per_rank=n,
                           table=TABLE[prec][distopt](d))
                for kind in ("params", "grads", "main params", "adam moments"):
                    row[kind] = max(m[kind] for m in mems) / n  # the most loaded rank
                row["total"] = sum(row[k] for k in ("params", "grads", "main params", "adam moments"))
                mem_rows.append(row)
                if d > 1 and prec != "fp16":
                    r0 = per_rank[0]
                    ep, eg = ELEMENT[prec]
                    padded = -(-n // d) * d if distopt else n  # one bucket here, padded to a multiple of d
                    g, pbytes = padded * eg, padded * ep
                    if distopt:
                        expected = {"grad_reduce_scatter": g, "param_all_gather": pbytes}
                        ring = (d - 1) / d * (g + pbytes)
                    else:
                        expected = {"grad_all_reduce": g}
                        ring = 2 * (d - 1) / d * g
                    measured = {k: v for k, v in r0["comm"].items() if k in expected}
                    assert r0["buckets"] == 1
                    comm_rows.append(dict(precision=prec, d=d, distopt=distopt, measured=measured, expected=expected,
                                          scalars=r0["comm"].get("all_reduce", 0), ring_bytes=ring,
                                          exact=all(r["comm"].get(k) == v for r in per_rank
                                                    for k, v in expected.items())))
    return mem_rows, comm_rows


# ---- 3. overlap ------------------------------------------------------------------------------------
# Few tokens per step for many parameters, so that the gradient all-reduce is a visible share of the step.
TIME_MODEL = dict(num_layers=4, hidden_size=512, num_attention_heads=8, seq_length=64,
                  max_position_embeddings=64, hidden_dropout=0.0, attention_dropout=0.0)
TIME_VOCAB = 8192
TIME_MICROBATCHES = 2
BUCKET = 4_000_000  # elements: a few buckets, so the first ones can reduce while backward still runs
VARIANTS = ("no overlap", "--overlap-grad-reduce")


class Trainer:
    """pretrain()'s iteration body (training/loop.py) on models built by its own functions, so that two
    variants can take turns step by step: other processes on these cores then slow both alike."""

    def __init__(self, cfg: MegaliteConfig, pg: ProcessGroups) -> None:
        self.cfg, self.pg = cfg, pg
        self.data = build_run_data(cfg, pg)
        tracker = model_parallel_seed(cfg.training.seed, pg.tp_rank, pg.pp_rank)
        self.chunks = build_model(cfg, pg, self.data.tokenizer.vocab_size, tracker)
        self.buffers = build_buffers(self.chunks, cfg, pg)
        self.optimizer = MegaliteOptimizer(self.buffers, cfg, pg)
        self.launched: list[int] = []
        self.finished: list[int] = []
        for c in self.chunks:
            c.train()

    def step(self, iteration: int) -> float:
        t = self.cfg.training
        microbatches = global_batch(self.data.train, iteration * t.global_batch_size, self.cfg, self.pg,
                                    torch.device("cpu"))
        self.optimizer.zero_grad()
        for b in self.buffers:
            b.last_microbatch = False

        def last_backward(chunk: int, deferred: set | None = None) -> None:
            self.buffers[chunk].last_microbatch = True

        self.optimizer.wait_param_gather()
        losses = run_microbatches(self.chunks, microbatches, self.pg, last_backward=last_backward)
        # buckets whose reduction was launched during backward, and of those, already finished
        works = [b.work for buf in self.buffers for b in buf.buckets if b.work is not None]
        self.launched.append(len(works))
        self.finished.append(sum(w.is_completed() for w in works))
        finalize_grads(self.chunks, self.buffers, self.pg)
        self.optimizer.step(self.cfg.optimizer.lr, self.cfg.optimizer.clip_grad)
        return reported_loss(losses, self.pg)


def _overlap_worker(rank: int, world: int, steps: int) -> dict:
    pg = groups(world, rank)
    trainers = {name: Trainer(make_cfg(world, TIME_MODEL, TIME_VOCAB, steps, m=TIME_MICROBATCHES,
                                       ddp_bucket_size=BUCKET, overlap_grad_reduce=name != VARIANTS[0]), pg)
                for name in VARIANTS}
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(steps):
        for name in VARIANTS if i % 2 == 0 else reversed(VARIANTS):  # ABBA
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(trainers[name].step(i))
            times[name].append((time.perf_counter() - t0) * 1e3)
    buf = trainers[VARIANTS[0]].buffers[0].grad_data.clone()
    ar = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        ar.append((time.perf_counter() - t0) * 1e3)
    t = trainers[VARIANTS[0]]
    during = {k: (statistics.mean(tr.launched), statistics.mean(tr.finished)) for k, tr in trainers.items()}
    return dict(times={k: v[1:] for k, v in times.items()}, losses=losses, all_reduce_ms=statistics.median(ar),
                during_backward=during,
                buffer_mb=buf.numel() * 4 / 1e6, buckets=len(t.buffers[0].buckets),
                params=sum(p.numel() for p in t.chunks[0].parameters()))


def bench_overlap(steps: int) -> dict:
    out = run_ranks(_overlap_worker, 2, steps, timeout=600)[-1]
    a, b = (out["times"][k] for k in VARIANTS)
    out["median_ms"] = {k: statistics.median(v) for k, v in out["times"].items()}
    out["min_ms"] = {k: min(v) for k, v in out["times"].items()}
    out["paired_ratio"] = statistics.median(y / x for x, y in zip(a, b))  # same step index: same load
    out["losses_equal"] = out["losses"][VARIANTS[0]] == out["losses"][VARIANTS[1]]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["memory", "overlap"], help="memory also gives the DP bytes per step")
    ap.add_argument("--steps", type=int, default=31, help="timed steps per variant, taken in turns (overlap)")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"{os.cpu_count()} CPU cores, load average {os.getloadavg()[0]:.1f} at start", flush=True)
    report: dict = {}
    if a.only in (None, "memory"):
        mem_rows, comm_rows = bench_memory()
        report["memory"], report["dp_bytes"] = mem_rows, comm_rows
        print(f"\n1. bytes per parameter held by a rank (model: {MEM_MODEL['num_layers']} layers, hidden "
              f"{MEM_MODEL['hidden_size']}, vocab {MEM_VOCAB}; {mem_rows[0]['params_per_rank']} params per rank)\n"
              "| precision | d | distributed optimizer | params | grads | fp32 main params | Adam moments | total | "
              "table |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in mem_rows:
            print(f"| {r['precision']} | {r['d']} | {'yes' if r['distopt'] else 'no'} | {r['params']:.3f} | "
                  f"{r['grads']:.3f} | {r['main params']:.3f} | {r['adam moments']:.3f} | {r['total']:.3f} | "
                  f"{r['table']:.3f} |")
        print(f"\n2. DP bytes handed to collectives per step and rank ({MICROBATCHES} micro-batches per rank)\n"
              "| precision | d | distributed optimizer | measured | formula (N params x grad / param bytes) | "
              "exact on every rank | ring bytes on the link | scalar all-reduces |")
        print("|---|---|---|---|---|---|---|---|")
        for r in comm_rows:
            print(f"| {r['precision']} | {r['d']} | {'yes' if r['distopt'] else 'no'} | {r['measured']} | "
                  f"{r['expected']} | {'yes' if r['exact'] else 'NO'} | {r['ring_bytes']:.0f} | {r['scalars']} |")
    if a.only in (None, "overlap"):
        o = report["overlap"] = bench_overlap(a.steps)
        m = TIME_MODEL
        print(f"\n3. step time at DP=2 (fp32, {m['num_layers']} layers, hidden {m['hidden_size']}, vocab {TIME_VOCAB}: "
              f"{o['params'] / 1e6:.1f}M params, {o['buckets']} buckets of <= {BUCKET / 1e6:.0f}M elements, "
              f"{TIME_MICROBATCHES} micro-batches of 1 x {m['seq_length']} per rank)")
        for k, v in o["median_ms"].items():
            print(f"  {k:>22}: median {v:.0f} ms, fastest {o['min_ms'][k]:.0f} ms over {len(o['times'][k])} steps  "
                  f"{[round(x) for x in o['times'][k]]}")
        for k, (launched, finished) in o["during_backward"].items():
            print(f"  {k:>22}: buckets launched during backward {launched:.2f}, finished before it ended {finished:.2f}"
                  f" (of {o['buckets']})")
        print(f"  overlap / no overlap: median of per-step ratios {o['paired_ratio']:.3f}, fastest steps "
              f"{o['min_ms'][VARIANTS[1]] / o['min_ms'][VARIANTS[0]]:.3f}; same losses: {o['losses_equal']}; "
              f"one all-reduce of the {o['buffer_mb']:.0f} MB grad buffer alone: {o['all_reduce_ms']:.0f} ms")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (other processes share these cores)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
