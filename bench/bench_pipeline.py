"""Pipeline parallelism against docs/design.md §3.4: bubble fraction, P2P bytes, live activations.

Three measurements, each from real multi-rank runs of ``pretrain()`` (gloo ranks spawned by
tests/harness.py, mock data, fp32 unless said otherwise, dropout 0):

1. bubble: each rank's recorded timeline of a step (``--record-pipeline-timeline``) -> idle / busy time
   per rank, averaged (tools/plot_pipeline_timeline.py's measure), against (p - 1) / (v * m) and against
   the pure schedule table run on an ideal machine. Measured at p = 2 on 2 ranks, so each rank has a core
   of its own; p = 4 (4 ranks on 2 cores, oversubscribed) is shown too, with why it reads differently.
2. P2P bytes: ``ProcessGroups.comm_bytes[("pp", "send")]`` per step on every rank against the formula:
   per micro-batch every virtual-stage boundary (p * v - 1 of them) sends b * s * h activations forward
   and the same gradient backward (s / tp with sequence parallelism), times the element size.
3. live activations: ``PipelineRecord.peak_live`` (outputs whose backward has not run yet) and the bytes
   that the autograd graph saved for backward (saved-tensor hooks; parameters excluded), at their peak,
   for 1F1B, GPipe and interleaved 1F1B with p = 4, m = 8.

    OMP_NUM_THREADS=1 python bench/bench_pipeline.py              # all three (about 1.5 min on 2 cores)
    OMP_NUM_THREADS=1 python bench/bench_pipeline.py --only bytes # one of: bubble, bytes, memory
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megalite.config import validate  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.parallel.layout import RankLayout  # noqa: E402
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables, simulate  # noqa: E402
from megalite.training.loop import pretrain  # noqa: E402
from tests.harness import run_ranks  # noqa: E402
from tests.run_counts import SavedTensor, peak_saved_bytes  # noqa: E402
from tools.plot_pipeline_timeline import bubble, from_table, load_record  # noqa: E402

VOCAB = 512
# GPT-2 style, 8 layers; a layer costs the same on every stage, and the small vocab keeps the
# embedding/output layer (first/last stage extras) under a tenth of a stage's work.
MODEL = dict(num_layers=8, hidden_size=256, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
             hidden_dropout=0.0, attention_dropout=0.0)
MICRO_BATCH = 2
QUIET = lambda s: None  # noqa: E731


def make_cfg(world: int, *, pp: int, vp: int = 1, m: int, tp: int = 1, schedule: str = "1f1b", iters: int = 2,
             record: str | None = None, **extra) -> MegaliteConfig:
    """A validated config whose step runs m micro-batches per DP rank through p stages x v chunks."""
    dp = world // (tp * pp)
    layers = MODEL["num_layers"]
    cfg = MegaliteConfig.from_flat(dict(
        MODEL, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        num_layers_per_virtual_pipeline_stage=layers // (pp * vp) if vp > 1 else None,
        pipeline_schedule=schedule, record_pipeline_timeline=record, micro_batch_size=MICRO_BATCH,
        global_batch_size=MICRO_BATCH * dp * m, train_iters=iters, lr=1e-4, log_interval=1000,
        eval_iters=0, eval_interval=1000, mock_data=True, vocab_size=VOCAB, seed=1234, **extra))
    validate(cfg, world)
    return cfg


def groups(cfg: MegaliteConfig, world: int, rank: int) -> ProcessGroups:
    p = cfg.parallel
    return ProcessGroups.build(RankLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size),
                               rank)


# ---- 1. bubble fraction ---------------------------------------------------------------------------
def stage_bubbles(events: dict[int, list]) -> list[float]:
    """Idle / busy of each stage within the step's span (their mean is ``bubble``)."""
    start = min(e[3] for ev in events.values() for e in ev)
    end = max(e[4] for ev in events.values() for e in ev)
    busy = {r: sum(e[4] - e[3] for e in ev) for r, ev in events.items()}
    return [(end - start - busy[r]) / busy[r] for r in sorted(events)]


def replay_bubble(events: dict[int, list], p: int, v: int, m: int) -> float:
    """The bubble the schedule table would have with this step's measured action durations and free,
    instant P2P: separates stage imbalance and uneven action times (in here) from waiting on messages,
    process wake-ups and time-sharing of cores (in measured only)."""
    took = {r: {(k, c, mb): e - s for k, c, mb, s, e in ev} for r, ev in events.items()}
    trace = simulate(build_tables(ScheduleSpec(p, v, m)), p, v, duration=lambda r, a: took[r][tuple(a)])
    return bubble({r: [(a.kind, a.chunk, a.microbatch, s, e) for a, s, e in t] for r, t in trace.items()})


def _bubble_worker(rank: int, world: int, runs: list[tuple[str, dict]], root: str, repeats: int) -> None:
    torch.manual_seed(0)
    for name, kw in runs:
        for rep in range(repeats):  # the record keeps a run's last step: 2 steps, the first is warm-up
            cfg = make_cfg(world, iters=2, record=os.path.join(root, name, str(rep)), **kw)
            pretrain(cfg, groups(cfg, world, rank), log=QUIET)


def bench_bubble(repeats: int) -> list[dict]:
    rows = []
    for world, grid in [(2, [(1, 4), (1, 8), (2, 4), (2, 8)]), (4, [(1, 8), (2, 8)])]:
        runs = [(f"p{world}_v{v}_m{m}", dict(pp=world, vp=v, m=m)) for v, m in grid]
        with tempfile.TemporaryDirectory() as root:
            t0 = time.perf_counter()
            run_ranks(_bubble_worker, world, runs, root, repeats, timeout=600)
            wall = time.perf_counter() - t0
            for name, kw in runs:
                p, v, m = kw["pp"], kw["vp"], kw["m"]
                measured, replayed, per_stage, spans = [], [], [], []
                for rep in range(repeats):
                    events, _ = load_record(os.path.join(root, name, str(rep)))
                    measured.append(bubble(events))
                    replayed.append(replay_bubble(events, p, v, m))
                    per_stage.append(stage_bubbles(events))
                    spans.append(max(e[4] for ev in events.values() for e in ev)
                                 - min(e[3] for ev in events.values() for e in ev))
                best = spans.index(min(spans))  # the least disturbed step: other processes share the cores
                rows.append(dict(p=p, v=v, m=m, ranks=world, formula=(p - 1) / (v * m),
                                 ideal_table=bubble(from_table(p, v, m, "1f1b")),
                                 replayed=replayed[best], measured=measured[best],
                                 measured_median=statistics.median(measured), measured_all=measured,
                                 per_stage=per_stage[best], step_s=spans[best]))
        print(f"  bubble runs on {world} ranks: {wall:.0f} s", flush=True)
    return rows


# ---- 2. P2P bytes ---------------------------------------------------------------------------------
BYTES_RUNS = {  # name -> (world, config kwargs)
    "p2 v1 m4 fp32": (2, dict(pp=2, m=4)),
    "p2 v2 m4 fp32": (2, dict(pp=2, vp=2, m=4)),
    "p2 v2 m4 bf16": (2, dict(pp=2, vp=2, m=4, bf16=True)),
    "p4 v2 m8 fp32": (4, dict(pp=4, vp=2, m=8)),
    "p4 v1 m4 gpipe": (4, dict(pp=4, m=4, schedule="gpipe")),
    "tp2 p2 v2 m4 seq-par": (4, dict(tp=2, pp=2, vp=2, m=4, sequence_parallel=True)),
    "dp2 p2 v1 m4": (4, dict(pp=2, m=4)),
}
ITERS = 2


def _bytes_worker(rank: int, world: int, runs: list[tuple[str, dict]]) -> dict:
    out = {}
    for name, kw in runs:
        cfg = make_cfg(world, iters=ITERS, **kw)
        pg = groups(cfg, world, rank)
        pretrain(cfg, pg, log=QUIET)
        out[name] = dict(pp_rank=pg.pp_rank, sent=pg.comm_bytes[("pp", "send")] // ITERS)
    return out


def expected_send_bytes(kw: dict, pp_rank: int) -> int:
    """Bytes this pipeline rank sends per step: for each micro-batch, a forward send from each of its
    chunks but the last virtual stage, a backward send from each but virtual stage 0."""
    p, v, m, tp = kw["pp"], kw.get("vp", 1), kw["m"], kw.get("tp", 1)
    seq = MODEL["seq_length"] // (tp if kw.get("sequence_parallel") else 1)
    elt = 2 if kw.get("bf16") or kw.get("fp16") else 4
    sends = (v - (pp_rank == p - 1)) + (v - (pp_rank == 0))
    return sends * m * MICRO_BATCH * seq * MODEL["hidden_size"] * elt


def bench_bytes() -> list[dict]:
    rows = []
    for world in (2, 4):
        runs = [(n, kw) for n, (w, kw) in BYTES_RUNS.items() if w == world]
        results = run_ranks(_bytes_worker, world, runs, timeout=600)
        for name, kw in runs:
            p, v, m = kw["pp"], kw.get("vp", 1), kw["m"]
            tp = kw.get("tp", 1)
            seq = MODEL["seq_length"] // (tp if kw.get("sequence_parallel") else 1)
            elt = 2 if kw.get("bf16") else 4
            per_rank = [r[name]["sent"] for r in results]
            expected = [expected_send_bytes(kw, r[name]["pp_rank"]) for r in results]
            replicas = world // p  # TP x DP copies of the pipeline, each sending its own activations
            rows.append(dict(run=name, ranks=world, per_rank=per_rank, expected_per_rank=expected,
                             total=sum(per_rank),
                             formula_total=replicas * 2 * (p * v - 1) * m * MICRO_BATCH * seq * MODEL["hidden_size"]
                             * elt, exact=per_rank == expected))
    return rows


# ---- 3. live activations ----------------------------------------------------------------------------
def _memory_worker(rank: int, world: int, runs: list[tuple[str, dict]], root: str) -> dict:
    out = {}
    for name, kw in runs:
        record = os.path.join(root, name)
        cfg = make_cfg(world, iters=2, record=record, **kw)
        pg = groups(cfg, world, rank)
        log: list = []
        pack = lambda t, log=log: SavedTensor(t, log)  # noqa: E731
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda s: s.tensor):
            res = pretrain(cfg, pg, log=QUIET)
        params = {p.untyped_storage().data_ptr() for c in res.chunks for p in c.parameters()}
        with open(os.path.join(record, f"rank{rank:05d}.json")) as f:
            peak_live = json.load(f)["peak_live"]
        out[name] = dict(pp_rank=pg.pp_rank, peak_live=peak_live, peak_bytes=peak_saved_bytes(log, params))
    return out


MEMORY_RUNS = {
    "1F1B p4 v1 m8": dict(pp=4, m=8),
    "GPipe p4 v1 m8": dict(pp=4, m=8, schedule="gpipe"),
    "interleaved 1F1B p4 v2 m8": dict(pp=4, vp=2, m=8),
    "GPipe p4 v2 m8": dict(pp=4, vp=2, m=8, schedule="gpipe"),
}


def bench_memory() -> list[dict]:
    runs = list(MEMORY_RUNS.items())
    with tempfile.TemporaryDirectory() as root:
        results = run_ranks(_memory_worker, 4, runs, root, timeout=600)
    rows = []
    for name, kw in runs:
        by_stage = sorted((r[name]["pp_rank"], r[name]["peak_live"], r[name]["peak_bytes"]) for r in results)
        rows.append(dict(run=name, p=kw["pp"], v=kw.get("vp", 1), m=kw["m"],
                         peak_live=[s[1] for s in by_stage], peak_mib=[round(s[2] / 2**20, 2) for s in by_stage]))
    return rows


# ---- report -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["bubble", "bytes", "memory"])
    ap.add_argument("--repeats", type=int, default=5,
                    help="recorded steps per bubble configuration; the fastest one is reported")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"model: {MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, seq {MODEL['seq_length']}, "
          f"micro-batch {MICRO_BATCH}, vocab {VOCAB}; {os.cpu_count()} CPU cores, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    report: dict[str, list] = {}
    if a.only in (None, "bubble"):
        rows = report["bubble"] = bench_bubble(a.repeats)
        print("\n1. bubble fraction (idle / busy, mean over ranks; the fastest of "
              f"{a.repeats} recorded steps, and the median of all)\n| p | v | m | ranks | (p-1)/(v*m) | ideal table | "
              "table replayed with measured durations | measured | measured per stage | median measured | step (s) |")
        print("|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            stages = " ".join(f"{x:.3f}" for x in r["per_stage"])
            print(f"| {r['p']} | {r['v']} | {r['m']} | {r['ranks']} on {os.cpu_count()} cores | {r['formula']:.3f} | "
                  f"{r['ideal_table']:.3f} | {r['replayed']:.3f} | {r['measured']:.3f} | {stages} | "
                  f"{r['measured_median']:.3f} | {r['step_s']:.2f} |")
    if a.only in (None, "bytes"):
        rows = report["bytes"] = bench_bytes()
        print("\n2. P2P bytes sent per step (comm_bytes[('pp', 'send')]) against the formula\n"
              "| run | ranks | measured per rank | formula per rank | total | 2(pv-1)·m·b·s·h·elt × replicas | exact |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['ranks']} | {r['per_rank']} | {r['expected_per_rank']} | {r['total']} | "
                  f"{r['formula_total']} | {'yes' if r['exact'] and r['total'] == r['formula_total'] else 'NO'} |")
    if a.only in (None, "memory"):
        rows = report["memory"] = bench_memory()
        print("\n3. peak live activations per stage (stage 0 .. p-1)\n"
              "| run | peak live micro-batch outputs | peak saved-for-backward MiB |")
        print("|---|---|---|")
        for r in rows:
            print(f"| {r['run']} | {r['peak_live']} | {r['peak_mib']} |")
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end (other processes share these cores)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
