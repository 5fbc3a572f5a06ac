"""Sharding strategies (--data-parallel-sharding-strategy) against their formulas: bytes per parameter
a rank holds after a step, the transients of a step (gathered layers, a bucket's gradients), DP bytes
per step, and the biggest model each strategy fits under a fixed per-rank memory cap.

Real runs of ``pretrain()`` on d gloo ranks (tests/harness.py), bf16, mock data, two steps of m = 4
micro-batches per rank:

1. held after a step, per parameter of the rank: model weights (distinct storages: the flat buffers,
   ZeRO-3's ``param_shard``; a gathered weight would count too), gradients (``grad_data`` plus any
   ``.grad``), fp32 main params, Adam moments; against no_shard 18, optim 6 + 12/d, optim_grads
   2 + 4/d + 12/d, optim_grads_params (2 + 4 + 12)/d.
2. transients, recorded while the step runs: the most bytes of gathered full weights alive at once
   (ZeRO-3: the chunk's own unit, embedding and head, plus the layer computing and the one prefetched;
   everything with --fsdp-keep-params-across-microbatches) and the largest bucket's gradients before its
   reduce-scatter (its ``.grad`` tensors plus the flat fp32 copy) — ZeRO-2's peak gradient memory.
3. DP bytes handed to collectives per step (``ProcessGroups.comm_bytes``): G = N x 4 (fp32 gradients),
   P = N x 2 (bf16 weights), N the padded buffer size: no_shard G; optim G + P; optim_grads m G + P;
   optim_grads_params m (G + 2P) (a forward and a backward all-gather per micro-batch), with keep m G + P.
4. ``--only cap``: the biggest model that trains under a fixed per-rank cap (``CAP_MB``), measured. For
   each strategy the model grows by whole layers (h=256) and each size trains ``CAP_ITERS`` real steps of
   ``pretrain()`` on 4 ranks, the whole run inside torch's profiler; a step's peak is the most bytes live
   in torch's CPU allocator while it runs (bench/peak_memory.py: every weight, gradient buffer or shard,
   optimizer state, gathered layer, saved activation and temporary). The ranks hold identical shapes and
   the one counting error (a free on gloo's thread that the profiler does not see) only adds bytes, so the
   peak reported is the smallest over ranks and steps 2.. (Adam's state exists from step 1), the largest
   beside it. Sizes: 1 and 2 layers, a line through them predicts the boundary, then sizes are measured
   until L fits and L + 1 does not.

    OMP_NUM_THREADS=1 python bench/bench_sharding.py            # parts 1-3, about 2 min on 2 cores; --json FILE
    OMP_NUM_THREADS=1 python bench/bench_sharding.py --only cap # part 4, about 3 min on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_data_parallel import MEM_MODEL, MEM_VOCAB, QUIET, groups, make_cfg  # noqa: E402
from bench.peak_memory import labelled, measure  # noqa: E402
from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.distributed import grad_buffer, param_shard  # noqa: E402
from megalite.training import loop  # noqa: E402
from megalite.training.loop import TrainResult, pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.run_counts import storage_by_kind  # noqa: E402

ITERS = 2
M = 4
LAYER_BUCKET = 200_000  # ZeRO-2 buckets of about one layer (h=128: 198k parameters), so backward never holds more
STRATEGIES = {
    "no_shard": ({}, lambda d: 18.0),
    "optim": ({"data_parallel_sharding_strategy": "optim"}, lambda d: 6 + 12 / d),
    "optim_grads": ({"data_parallel_sharding_strategy": "optim_grads", "ddp_bucket_size": LAYER_BUCKET},
                    lambda d: 2 + 4 / d + 12 / d),
    "optim_grads_params": ({"data_parallel_sharding_strategy": "optim_grads_params"}, lambda d: 18 / d),
    "optim_grads_params, keep": ({"data_parallel_sharding_strategy": "optim_grads_params",
                                  "fsdp_keep_params_across_microbatches": True}, lambda d: 18 / d),
}
CAP_MB = 64  # per rank, part 4's measured cap
CAP_D = 4
CAP_MODEL = dict(hidden_size=256, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                 hidden_dropout=0.0, attention_dropout=0.0)
CAP_VOCAB = 1000
CAP_ITERS = 10
CAP_M = 2  # micro-batches per rank and step
CAP_BUCKET = 800_000  # about one layer at h=256 (789,760 parameters): ZeRO-2/3 free a layer's gradients at a time
CAP_STRATEGIES = {"no_shard": {}, "optim": {"data_parallel_sharding_strategy": "optim"},
                  "optim_grads": {"data_parallel_sharding_strategy": "optim_grads"},
                  "optim_grads_params": {"data_parallel_sharding_strategy": "optim_grads_params"}}


class Transients:
    """Wraps ParamGatherer.gather/release and GradBuffer's per-micro-batch reduction to record peaks."""

    def __init__(self) -> None:
        self.gathered = self.peak_gathered = self.peak_bucket = 0
        gather, release = param_shard.ParamGatherer.gather, param_shard.ParamGatherer.release
        reduce = grad_buffer.GradBuffer._reduce_scatter_microbatch

        def unit_bytes(g, i):
            return sum(b.numel for b in g.units[i]) * g.buffer.param_shard.element_size()

        def gather_(g, i):
            if i < len(g.units) and g.full[i] is None:
                self.gathered += unit_bytes(g, i)
                self.peak_gathered = max(self.peak_gathered, self.gathered)
            gather(g, i)

        def release_(g, i):
            if g.full[i] is not None:
                self.gathered -= unit_bytes(g, i)
            release(g, i)

        def reduce_(buf, bucket):
            grads = sum(p.grad.numel() * p.grad.element_size() for p in bucket.params if p.grad is not None)
            self.peak_bucket = max(self.peak_bucket, grads + bucket.numel * buf.grad_data.element_size())
            reduce(buf, bucket)

        param_shard.ParamGatherer.gather, param_shard.ParamGatherer.release = gather_, release_
        grad_buffer.GradBuffer._reduce_scatter_microbatch = reduce_

    def reset(self) -> None:
        self.gathered = self.peak_gathered = self.peak_bucket = 0


def _worker(rank: int, world: int) -> dict:
    tr = Transients()
    out = {}
    for name, (flags, _) in STRATEGIES.items():
        tr.reset()
        cfg = make_cfg(world, MEM_MODEL, MEM_VOCAB, ITERS, m=M, bf16=True, **flags)
        pg = groups(world, rank)
        res = pretrain(cfg, pg, log=QUIET)
        mem = storage_by_kind(res)
        bufs = res.optimizer.buffers
        shards = [b.param_shard for b in bufs if b.param_shard is not None]
        mem["params"] += sum(s.numel() * s.element_size() for s in shards)
        layer = max(sum(b.numel for b in u) for b in bufs for u in b.unit_buckets[1:]) if shards else 0
        out[name] = dict(mem=mem, numel=sum(b.numel for b in bufs), layer_bytes=layer * 2,
                         peak_gathered=tr.peak_gathered, peak_bucket=tr.peak_bucket,
                         comm={k[1]: v // ITERS for k, v in pg.comm_bytes.items() if k[0] == "dp"})
    return out


def expected_comm(name: str, n: int) -> dict[str, int]:
    g, p = 4 * n, 2 * n
    return {"no_shard": {"grad_all_reduce": g}, "optim": {"grad_reduce_scatter": g, "param_all_gather": p},
            "optim_grads": {"grad_reduce_scatter": M * g, "param_all_gather": p},
            "optim_grads_params": {"grad_reduce_scatter": M * g, "param_all_gather": 2 * M * p},
            "optim_grads_params, keep": {"grad_reduce_scatter": M * g, "param_all_gather": p}}[name]


def bench(ds: tuple[int, ...]) -> list[dict]:
    rows = []
    for d in ds:
        results = run_ranks(_worker, d, timeout=900)
        for name, (_, formula) in STRATEGIES.items():
            per_rank = [r[name] for r in results]
            n = per_rank[0]["mem"]["numel"]
            row = dict(strategy=name, d=d, params_per_rank=n, formula=formula(d))
            for kind in ("params", "grads", "main params", "adam moments"):
                row[kind] = max(r["mem"][kind] for r in per_rank) / n
            row["total"] = sum(row[k] for k in ("params", "grads", "main params", "adam moments"))
            r0 = per_rank[0]
            row["peak_gathered_per_param"] = max(r["peak_gathered"] for r in per_rank) / n
            row["peak_gathered_layers"] = r0["peak_gathered"] / r0["layer_bytes"] if r0["layer_bytes"] else 0
            row["peak_bucket_per_param"] = max(r["peak_bucket"] for r in per_rank) / n
            exp = expected_comm(name, r0["numel"])
            row["comm"] = {k: r0["comm"].get(k, 0) for k in exp}
            row["comm_expected"] = exp
            row["comm_exact"] = all(r["comm"].get(k, 0) == v for r in per_rank for k, v in exp.items())
            rows.append(row)
    return rows


def _cap_cfg(world: int, layers: int, flags: dict) -> MegaliteConfig:
    cfg = MegaliteConfig.from_flat(dict(
        CAP_MODEL, num_layers=layers, micro_batch_size=1, global_batch_size=world * CAP_M, train_iters=CAP_ITERS,
        lr=1e-3, log_interval=1, eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=CAP_VOCAB, seed=1234,
        bf16=True, ddp_bucket_size=CAP_BUCKET, **flags))
    validate(cfg, world)
    return cfg


def held_state(res: TrainResult) -> int:
    """Bytes of weights (or ZeRO-3 shards), gradient buffer, main params and Adam moments after the run."""
    mem = storage_by_kind(res)
    shards = [b.param_shard for b in res.optimizer.buffers if b.param_shard is not None]
    return int(sum(mem[k] for k in ("params", "grads", "main params", "adam moments"))
               + sum(s.numel() * s.element_size() for s in shards))


def _cap_run(rank: int, world: int, layers: int, flags: dict) -> dict:
    """Train one size under the profiler; every rank's step peaks and held bytes, gathered."""
    cfg = _cap_cfg(world, layers, flags)
    gc.collect()
    with measure() as rep:
        res = pretrain(cfg, groups(world, rank), log=QUIET)
    n = sum(e - s for b in res.optimizer.buffers for s, e in b.ranges.values())
    mine = torch.tensor(rep.steps + [rep.held, held_state(res)], dtype=torch.float64)
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    loss = [float(v) for v in res.losses]
    del res
    gc.collect()
    steady = [float(v) for r in every for v in r[1:CAP_ITERS]]  # steps 2..: Adam state exists
    return dict(layers=layers, params=n, peak=min(steady), peak_max=max(steady),
                held=min(float(r[CAP_ITERS]) for r in every), state=max(float(r[-1]) for r in every), loss=loss)


def _cap_worker(rank: int, world: int) -> dict:
    loop.train_step = labelled(loop.train_step)  # each step is one window of the profile
    cap = CAP_MB * 2**20
    out = {}
    for name, flags in CAP_STRATEGIES.items():
        runs: dict[int, dict] = {}

        def at(layers: int, runs: dict = runs, flags: dict = flags) -> dict:
            if layers not in runs:
                runs[layers] = _cap_run(rank, world, layers, flags)
            return runs[layers]

        per_layer = at(2)["peak"] - at(1)["peak"]
        best = max(1, int((cap - at(1)["peak"]) // per_layer) + 1)
        while best > 1 and at(best)["peak"] > cap:
            best -= 1
        while at(best)["peak"] <= cap and at(best + 1)["peak"] <= cap:
            best += 1
        out[name] = dict(runs=[runs[k] for k in sorted(runs)], best=best if at(best)["peak"] <= cap else 0)
    return out


def bench_cap() -> dict:
    return run_ranks(_cap_worker, CAP_D, timeout=3600)[0]


def _loss(run: dict) -> str:
    loss = run["loss"]
    finite = all(math.isfinite(v) for v in loss)
    return f"{loss[0]:.3f} -> {statistics.mean(loss[-3:]):.3f}" + ("" if finite else " (NOT FINITE)")


def print_cap(res: dict) -> None:
    mb = 2**20
    print(f"\nbf16, h={CAP_MODEL['hidden_size']}, seq {CAP_MODEL['seq_length']}, vocab {CAP_VOCAB}, d={CAP_D}, "
          f"{CAP_M} micro-batches per rank, --ddp-bucket-size {CAP_BUCKET}, {CAP_ITERS} steps (MiB per rank)")
    print("| strategy | layers | params | peak of a step | largest count seen | held after the last step | "
          "of it weights + grads + optimizer | loss: step 1, mean of the last 3 |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in res.items():
        for run in r["runs"]:
            mark = f" **(biggest under {CAP_MB} MiB)**" if run["layers"] == r["best"] else ""
            print(f"| {name} | {run['layers']}{mark} | {run['params']:,} | {run['peak'] / mb:.2f} | "
                  f"{run['peak_max'] / mb:.1f} | {run['held'] / mb:.1f} | {run['state'] / mb:.1f} | "
                  f"{_loss(run)} |")
    print(f"\nbiggest model under {CAP_MB} MiB per rank")
    print("| strategy | layers | params | measured peak (MiB) | next size's peak (MiB) | loss: step 1, last 3 |")
    print("|---|---|---|---|---|---|")
    for name, r in res.items():
        runs = {x["layers"]: x for x in r["runs"]}
        if r["best"] == 0:
            print(f"| {name} | none fits | | | |")
            continue
        run, nxt = runs[r["best"]], runs[r["best"] + 1]
        print(f"| {name} | {run['layers']} | {run['params']:,} | {run['peak'] / mb:.2f} | {nxt['peak'] / mb:.2f} | "
              f"{_loss(run)} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="+", default=[2, 4], help="data-parallel sizes")
    ap.add_argument("--json", help="also write the figures to this file")
    ap.add_argument("--only", choices=["cap"], help="cap: part 4 only, the biggest model under a measured cap")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if a.only == "cap":
        res = bench_cap()
        print_cap(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    rows = bench(tuple(a.d))
    print(f"\nbf16, {MEM_MODEL['num_layers']} layers, hidden {MEM_MODEL['hidden_size']}, vocab {MEM_VOCAB} "
          f"({rows[0]['params_per_rank']} params), {M} micro-batches per rank\n"
          "| strategy | d | weights | grads | main params | Adam | **total** | formula | gathered peak (B/param, "
          "layers) | bucket grads peak (B/param) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['d']} | {r['params']:.3f} | {r['grads']:.3f} | {r['main params']:.3f} | "
              f"{r['adam moments']:.3f} | **{r['total']:.3f}** | {r['formula']:.3f} | "
              f"{r['peak_gathered_per_param']:.3f}, {r['peak_gathered_layers']:.2f} | "
              f"{r['peak_bucket_per_param']:.3f} |")
    print("\nDP bytes per step and rank handed to collectives, measured vs formula")
    print("| strategy | d | measured | formula | exact on every rank |")
    print("|---|---|---|---|---|")
    for r in rows:
        exact = "yes" if r["comm_exact"] else "NO"
        print(f"| {r['strategy']} | {r['d']} | {r['comm']} | {r['comm_expected']} | {exact} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
