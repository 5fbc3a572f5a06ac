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
4. the biggest model under a cap: cap / measured bytes per parameter, minus the measured transients
   scaled to the model (state only: activations come on top and are the same for every strategy).

    OMP_NUM_THREADS=1 python bench/bench_sharding.py            # about 2 min on 2 cores; --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_data_parallel import MEM_MODEL, MEM_VOCAB, QUIET, groups, make_cfg, storage_by_kind  # noqa: E402
from megalite.distributed import grad_buffer, param_shard  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402

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
CAP_GB = 80.0  # per rank


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
            transient = row["peak_gathered_per_param"] + row["peak_bucket_per_param"]
            row["max_params_under_cap_b"] = CAP_GB / (row["total"] + transient)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d", type=int, nargs="+", default=[2, 4], help="data-parallel sizes")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = bench(tuple(a.d))
    print(f"\nbf16, {MEM_MODEL['num_layers']} layers, hidden {MEM_MODEL['hidden_size']}, vocab {MEM_VOCAB} "
          f"({rows[0]['params_per_rank']} params), {M} micro-batches per rank\n"
          "| strategy | d | weights | grads | main params | Adam | **total** | formula | gathered peak (B/param, "
          "layers) | bucket grads peak (B/param) | params under 80 GB (billions) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['d']} | {r['params']:.3f} | {r['grads']:.3f} | {r['main params']:.3f} | "
              f"{r['adam moments']:.3f} | **{r['total']:.3f}** | {r['formula']:.3f} | "
              f"{r['peak_gathered_per_param']:.3f}, {r['peak_gathered_layers']:.2f} | "
              f"{r['peak_bucket_per_param']:.3f} | "
              f"{r['max_params_under_cap_b']:.1f} |")
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
