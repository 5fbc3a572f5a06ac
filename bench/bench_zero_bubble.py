"""Zero-bubble schedules (docs/parallelism.md, "Zero-bubble schedules"): measured F, B, W, the tables
played with them, real p = 2 steps of 1F1B against ZB-H1 and ZB-V, the timeline picture.

1. fbw: one thread times, on a middle stage of bench_pipeline.py's GPT (h = 256, s = 128, b = 2; a stage
   of 2 layers and a chunk of 1), the forward F, the whole backward, and the split backward the executor
   runs: B under ``WeightGradStore.collect`` (input gradients; norms and biases) and W (``store.run``,
   the deferred GEMMs); also B as ``torch.autograd.grad`` w.r.t. the input alone, W as whole minus that.
   Median of ``--repeats``. The bytes the pending W keeps against ``megalite.planning.zero_bubble.deferred_w_bytes``.
2. tables: every schedule played on the ideal machine (free messages) with those times, p = 2, 4, 8 and
   m = p, 2p, 4p: bubble (idle / busy, mean over ranks) and each ratio to 1F1B's, next to the paper's
   closed forms; and with F = B = W.
3. p2: real ``train_step`` runs on 2 gloo ranks (one thread each), 1F1B, ZB-H1 and ZB-V side by side,
   their steps alternating: the step's span and idle fraction from the PipelineRecord timelines (and the
   table replayed with its measured durations), the fastest of ``--steps`` steps and the medians; peak
   activations in flight, W's pending and their bytes against the formula's peak (the table played with
   each W's chunk's bytes, ``megalite.planning.zero_bubble.peak_table_bytes``).
4. --plot FILE: 1F1B, interleaved 1F1B, ZB-H1 and ZB-V at p = 4, m = 8 with the measured chunk times.

    OMP_NUM_THREADS=1 python bench/bench_zero_bubble.py [--plot docs/pipeline_zero_bubble.png]
    OMP_NUM_THREADS=1 python bench/bench_zero_bubble.py --only fbw   # one of: fbw, tables, p2
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.bench_pipeline import MICRO_BATCH, MODEL, VOCAB, groups, make_cfg  # noqa: E402
from megalite.config.arguments import MegaliteConfig  # noqa: E402
from megalite.config.model import ModelConfig  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from megalite.parallel.groups import ProcessGroups  # noqa: E402
from megalite.pipeline.schedule_table import ScheduleSpec, bubble_fraction, build_tables, simulate  # noqa: E402
from megalite.pipeline.timeline import SCHEDULES, play  # noqa: E402
from megalite.planning.memory import run_holds  # noqa: E402
from megalite.planning.zero_bubble import deferred_w_bytes, peak_table_bytes  # noqa: E402
from megalite.tensor_parallel.context import BuildContext  # noqa: E402
from megalite.tensor_parallel.init import initialize_parameters  # noqa: E402
from megalite.tensor_parallel.random import model_parallel_seed  # noqa: E402
from megalite.tensor_parallel.weight_grad import WeightGradStore  # noqa: E402
from tests.zero_bubble_formulas import paper_bubble  # noqa: E402

FFN = 4 * MODEL["hidden_size"]


# ---- 1. F, B, W of one stage ---------------------------------------------------------------------
def model_cfg() -> ModelConfig:
    """bench_pipeline.py's model."""
    return MegaliteConfig.from_flat(dict(MODEL, vocab_size=VOCAB, mock_data=True)).model


def build_stage(layers: int) -> GPTModel:
    """A middle pipeline stage (no embedding, no output layer) of ``layers`` layers on one process."""
    cfg = model_cfg()
    pg = ProcessGroups.single()
    ctx = BuildContext(pg, model_parallel_seed(1234, 0, 0))
    chunk = GPTModel(cfg, ctx, VOCAB, layer_numbers=range(layers), pre_process=False, post_process=False)
    initialize_parameters(chunk, pg, 1234, cfg.init_method_std, cfg.num_layers)
    chunk.train()
    return chunk


def _time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls after one warm-up."""
    fn()
    took = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        took.append(time.perf_counter() - t0)
    return statistics.median(took)


def split_backward(chunk: GPTModel, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, float, int]:
    """One F under ``deferrable``, then B under ``collect`` and W: their seconds and the bytes W kept."""
    store = WeightGradStore()
    with store.deferrable():
        out = chunk(hidden=x)
    t0 = time.perf_counter()
    with store.collect((0, 0)):
        torch.autograd.backward(out, grad)
    t1 = time.perf_counter()
    kept = store.pending_bytes()
    store.run((0, 0))
    return t1 - t0, time.perf_counter() - t1, kept


def measure_fbw(layers: int, repeats: int) -> dict:
    """F, whole backward, B and W (split as the executor runs them, and by autograd.grad) of one stage."""
    chunk = build_stage(layers)
    s, b, h = MODEL["seq_length"], MICRO_BATCH, MODEL["hidden_size"]
    x = torch.randn(s, b, h, requires_grad=True)
    grad = torch.randn(s, b, h)
    f = _time(lambda: chunk(hidden=x), repeats)

    def whole() -> None:
        torch.autograd.backward(chunk(hidden=x), grad)

    def input_only() -> None:
        torch.autograd.grad(chunk(hidden=x), x, grad)

    whole_s, input_s = _time(whole, repeats) - f, _time(input_only, repeats) - f
    split_backward(chunk, x, grad)  # warm-up
    runs = [split_backward(chunk, x, grad) for _ in range(repeats)]
    return dict(layers=layers, F=f, whole=whole_s, B=statistics.median(r[0] for r in runs),
                W=statistics.median(r[1] for r in runs), B_grad=input_s, W_grad=whole_s - input_s,
                kept=runs[0][2], formula=deferred_w_bytes(model_cfg(), layers, s * b, 0, output=False))


def print_fbw(rows: list[dict]) -> None:
    print("\n1. one stage's F, B, W (ms, median; one thread)\n| layers | F | whole backward | B (split) | W (split) "
          "| B + W | B (autograd.grad, input only) | whole − that | F : B : W (split) | W kept (bytes) | formula |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ms = {k: r[k] * 1e3 for k in ("F", "whole", "B", "W", "B_grad", "W_grad")}
        print(f"| {r['layers']} | {ms['F']:.2f} | {ms['whole']:.2f} | {ms['B']:.2f} | {ms['W']:.2f} | "
              f"{ms['B'] + ms['W']:.2f} | {ms['B_grad']:.2f} | {ms['W_grad']:.2f} | 1 : {r['B'] / r['F']:.2f} : "
              f"{r['W'] / r['F']:.2f} | {r['kept']} | {r['formula']} |")


# ---- 2. the tables played with those times -------------------------------------------------------
def chunk_times(fbw: dict[int, dict] | None, name: str) -> tuple[float, float, float, float]:
    """(F, B, W, whole backward) of one of the schedule's chunks: the stage's when v = 1, else the
    half-stage chunk's; without measurements a stage's F = B = W = 1 (a chunk's 1/2)."""
    v = SCHEDULES[name][1]
    if fbw is None:
        return 1 / v, 1 / v, 1 / v, 2 / v
    r = fbw[2 if v == 1 else 1]
    return r["F"], r["B"], r["W"], r["whole"]


def table_rows(fbw: dict[int, dict] | None, grid: list[tuple[int, int]]) -> list[dict]:
    """Bubble and step span of every schedule at each (p, m), with measured times (or F = B = W = 1)."""
    rows = []
    for p, m in grid:
        base = None
        for name in SCHEDULES:
            trace = play(name, p, m, *chunk_times(fbw, name))
            step = max(e for t in trace.values() for _, _, e in t)
            sf, sb, sw, swhole = chunk_times(fbw, "1f1b")  # the stage's: the closed forms' units
            split = SCHEDULES[name][0] != "1f1b"
            idle = paper_bubble(name, p, sf, sb, sw) if split else paper_bubble(name, p, sf, swhole, 0.0)
            busy = m * (sf + (sb + sw if split else swhole))
            row = dict(p=p, m=m, name=name, bubble=bubble_fraction(trace), step=step,
                       paper=None if idle is None else idle / busy)
            base = base or row
            row.update(bubble_ratio=row["bubble"] / base["bubble"], step_ratio=step / base["step"])
            rows.append(row)
    return rows


def print_tables(rows: list[dict], title: str, unit: str) -> None:
    print(f"\n2. {title}\n| p | m | schedule | bubble (idle / busy) | paper's closed form | bubble / 1F1B's | "
          f"step ({unit}) | step / 1F1B's |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        paper = "—" if r["paper"] is None else f"{r['paper']:.3f}"
        step = f"{r['step'] * 1e3:.1f}" if unit == "ms" else f"{r['step']:.0f}"
        print(f"| {r['p']} | {r['m']} | {r['name']} | {r['bubble']:.3f} | {paper} | {r['bubble_ratio']:.3f} | {step} | "
              f"{r['step_ratio']:.3f} |")


# ---- 3. p = 2 on 2 ranks ------------------------------------------------------------------------------
P2_KINDS = ("1f1b", "zb-h1", "zbv")


def _p2_worker(rank: int, world: int, m: int, repeats: int) -> dict:
    """Both schedules' runs side by side, their steps alternating (one warm-up step each first)."""
    from megalite.training.loop import start_run
    from megalite.training.timers import Timers

    torch.manual_seed(0)
    runs = {}
    for kind in P2_KINDS:
        cfg = make_cfg(world, pp=2, m=m, schedule=kind, iters=repeats + 1, record="unused",
                       untie_embeddings_and_output_weights=True)  # ZB-V's V needs it; all alike
        runs[kind] = start_run(cfg, groups(cfg, world, rank), None, lambda s: None)
    out: dict[str, list] = {kind: [] for kind in P2_KINDS}
    for step in range(repeats + 1):
        for kind, run in runs.items():
            t0 = time.perf_counter()
            res = run.step(Timers(0))
            took = time.perf_counter() - t0
            run.record(res)
            rec = res.record
            if step:
                out[kind].append(dict(timeline=list(rec.timeline), step_s=took, peak_live=rec.peak_live,
                                      peak_deferred=rec.peak_deferred, deferred_bytes=rec.peak_deferred_bytes,
                                      padded_vocab=run.chunks[0].padded_vocab,
                                      holds=run_holds(run.cfg, world, run.vocab_size)))
    return out


def p2_rows(m: int, repeats: int) -> list[dict]:
    """Per schedule: the fastest recorded step's span and idle fraction, the medians, W's pending."""
    from tests.harness import run_ranks
    from tools.plot_pipeline_timeline import bubble

    results = run_ranks(_p2_worker, 2, m, repeats, timeout=900)
    rows = []
    for kind in P2_KINDS:
        steps = []
        for k in range(repeats):
            events = {r: results[r][kind][k]["timeline"] for r in range(2)}
            span = max(e[4] for ev in events.values() for e in ev) - min(e[3] for ev in events.values() for e in ev)
            took = max(results[r][kind][k]["step_s"] for r in range(2))
            holds = results[0][kind][k]["holds"]
            steps.append(dict(span=span, idle=bubble(events), step_s=took, replayed=replay(events, kind, m, holds)))
        best = min(steps, key=lambda s: s["span"])
        last = [results[r][kind][-1] for r in range(2)]
        rows.append(dict(kind=kind, m=m, span=best["span"], idle=best["idle"], step_s=best["step_s"],
                         replayed=best["replayed"],
                         span_median=statistics.median(s["span"] for s in steps),
                         idle_median=statistics.median(s["idle"] for s in steps),
                         peak_live=[x["peak_live"] for x in last], peak_deferred=[x["peak_deferred"] for x in last],
                         deferred_bytes=[x["deferred_bytes"] for x in last],
                         formula=[expected_peak_bytes(kind, r, m, x["padded_vocab"], x["holds"])
                                  for r, x in enumerate(last)], holds=last[0]["holds"]))
    return rows


def replay(events: dict[int, list], kind: str, m: int, holds: tuple[int, ...] | None = None) -> float:
    """The table's bubble with this step's measured action durations and free, instant messages: what
    the schedule itself leaves idle, apart from waiting on messages and the OS (``holds``: the run's)."""
    took = {r: {(k, c, mb): e - s for k, c, mb, s, e in ev} for r, ev in events.items()}
    spec = ScheduleSpec(2, 2 if kind == "zbv" else 1, m, kind, holds)
    trace = simulate(build_tables(spec), 2, spec.vp, duration=lambda r, a: took[r][tuple(a)], stages=spec.stages)
    return bubble_fraction(trace)


def expected_peak_bytes(kind: str, rank: int, m: int, padded_vocab: int, holds: tuple[int, ...] | None = None) -> int:
    """The formula's peak bytes of pending W's on pipeline rank ``rank`` at p = 2: the table played with each
    W's chunk's bytes (its layers' GEMMs; the unfused output layer's where the chunk holds the loss; the word
    embedding's on the first stage), under the run's ``holds`` (planning/zero_bubble_memory.py)."""
    spec = ScheduleSpec(2, SCHEDULES[kind][1], m, kind, holds if kind in ("zb-h1", "zbv") else None)
    return peak_table_bytes(model_cfg(), spec, rank, MODEL["seq_length"] * MICRO_BATCH, padded_vocab)


def print_p2(rows: list[dict], repeats: int) -> None:
    print(f"\n3. p = 2, 2 gloo ranks (one thread each), fastest of {repeats} steps per schedule, alternating\n"
          "| m | schedule | pipeline span (s) | / 1F1B's | idle / busy | table replayed | whole step (s) | median span "
          "| median idle | peak live (chunks) | peak W's pending | their bytes | formula |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    base = {r["m"]: r for r in rows if r["kind"] == "1f1b"}
    for r in rows:
        ratio = r["span"] / base[r["m"]]["span"]
        kind = r["kind"] + (f" {list(r['holds'])}" if r["holds"] else "")  # the holds training chose
        print(f"| {r['m']} | {kind} | {r['span']:.3f} | {ratio:.3f} | {r['idle']:.3f} | {r['replayed']:.3f} | "
              f"{r['step_s']:.3f} | {r['span_median']:.3f} | {r['idle_median']:.3f} | {r['peak_live']} | "
              f"{r['peak_deferred']} | {r['deferred_bytes']} | {r['formula']} |")


# ---- 4. the picture -----------------------------------------------------------------------------------
COLORS = {"F": ("#4c78a8", "#1d4f7a"), "B": ("#54a24b", "#2b6d24"), "W": ("#f58518", "#b35c00")}
TITLES = {"1f1b": "1F1B", "interleaved": "interleaved 1F1B (v = 2)", "zb-h1": "ZB-H1", "zbv": "ZB-V (2 chunks, V)"}


def plot(fbw: dict[int, dict] | None, output: str, p: int = 4, m: int = 8) -> None:
    """The four schedules' traces one above the other on one time axis; F/B/W coloured, chunk 1 darker
    (in 1F1B and interleaved 1F1B, B is the whole backward)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(SCHEDULES), 1, figsize=(15, 1.2 + 1.1 * p * len(SCHEDULES) / 2), sharex=True)
    for ax, name in zip(axes, SCHEDULES, strict=True):
        trace = play(name, p, m, *chunk_times(fbw, name))
        scale = 1e3 if fbw else 1.0
        for rank, actions in trace.items():
            for a, start, end in actions:
                ax.barh(p - 1 - rank, (end - start) * scale, left=start * scale, height=0.8,
                        color=COLORS[a.kind][a.chunk], edgecolor="black", linewidth=0.3)
                ax.text((start + end) / 2 * scale, p - 1 - rank, str(a.microbatch), ha="center", va="center",
                        fontsize=6, color="white")
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {p - 1 - i}" for i in range(p)], fontsize=7)
        ax.set_title(f"{TITLES[name]}: bubble {bubble_fraction(trace):.3f}, step "
                     f"{max(e for t in trace.values() for _, _, e in t) * scale:.1f}", fontsize=9, loc="left")
    axes[-1].set_xlabel("time (ms, the measured F, B, W of one stage / chunk)" if fbw else "time (F = B = W = 1)")
    handles = [Patch(color=COLORS[k][c], label=f"{k} chunk {c}") for k in "FBW" for c in (0, 1)]
    fig.legend(handles=handles, loc="upper right", ncol=6, fontsize=7)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(output, dpi=110)
    print(f"\nwrote {output}")


# ---- report -----------------------------------------------------------------------------------------
def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["fbw", "tables", "p2"])
    ap.add_argument("--repeats", type=int, default=20, help="timed repetitions of each action (fbw)")
    ap.add_argument("--steps", type=int, default=10, help="recorded steps per schedule and m (p2)")
    ap.add_argument("--plot", help="also draw the p = 4, m = 8 timelines with the measured times to this PNG")
    a = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    print(f"commit {_commit()}; model: h {MODEL['hidden_size']}, heads {MODEL['num_attention_heads']}, seq "
          f"{MODEL['seq_length']}, micro-batch {MICRO_BATCH}, ffn {FFN}; {os.cpu_count()} CPU cores, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    fbw = None
    if a.only in (None, "fbw", "tables") or a.plot:
        fbw = {n: measure_fbw(n, a.repeats) for n in (2, 1)}
        print_fbw(list(fbw.values()))
    if a.only in (None, "tables"):
        grid = [(p, k * p) for p in (2, 4, 8) for k in (1, 2, 4)]
        print_tables(table_rows(fbw, grid), "the tables with the measured times (stage = 2 layers, chunk = 1)", "ms")
        print_tables(table_rows(None, grid), "the tables with F = B = W = 1 per stage (a chunk: 1/2)", "steps")
    if a.only in (None, "p2"):
        rows = [r for m in (4, 8) for r in p2_rows(m, a.steps)]
        print_p2(rows, a.steps)
    if a.plot:
        plot(fbw, a.plot)
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
