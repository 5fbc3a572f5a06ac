"""Pure functions over schedule tables and simulated traces: what the tables promise about memory and
idle time, for the zero-bubble figures (bench/bench_zero_bubble.py, docs/parallelism.md).

- ``peak_in_flight``: the most (chunk, micro-batch) pairs a rank holds between their F and their B (the
  activations autograd keeps) or their W (the split backward also keeps what the W needs);
- ``peak_pending_w`` / ``peak_pending_w_bytes``: the most W's pending at once, and the most bytes they keep
  when each W keeps its own chunk's (ZB-V's pending W's mix chunks of different sizes);
- ``peak_loss_buffers``: the most loss-chunk micro-batches holding the logits (or their gradient) at once;
- ``peak_live_bytes``: the most bytes a rank's table holds at once, activations, pending W's and the loss's
  and the embedding's moments together, given each chunk's (``ChunkBytes``): the planner's per-rank peak;
- ``play``: a named schedule (``SCHEDULES``) run on the ideal machine with given F, B, W times per chunk;
- ``idle_per_rank``: each rank's idle time within the step's span (``bubble_fraction`` divides by busy).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from megalite.pipeline.schedule_table import Action, ScheduleSpec, build_tables, simulate

Trace = dict[int, list[tuple[Action, float, float]]]

# name -> (table kind, model chunks per rank); "interleaved" is 1F1B over v = 2 chunks
SCHEDULES: dict[str, tuple[str, int]] = {"1f1b": ("1f1b", 1), "interleaved": ("1f1b", 2), "zb-h1": ("zb-h1", 1),
                                         "zbv": ("zbv", 2)}


def spec_for(name: str, p: int, m: int, holds: tuple[int, ...] | None = None) -> ScheduleSpec:
    """The table spec of a named schedule (``SCHEDULES``); ``holds``: ScheduleSpec.holds (zero bubble)."""
    kind, v = SCHEDULES[name]
    return ScheduleSpec(p, v, m, kind, holds if kind in ("zb-h1", "zbv") else None)


def peak_in_flight(table: list[Action], until: str = "B") -> int:
    """Most (chunk, micro-batch) pairs held at once after their F and before their ``until`` (B or W).

    With ``until="B"`` it is the activation count autograd keeps; with ``"W"`` (split tables only) it also
    counts the pairs whose B ran and whose W has not (their weight-gradient inputs are kept)."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in table:
        if a.kind == "F":
            live.add((a.chunk, a.microbatch))
        elif a.kind == until:
            live.discard((a.chunk, a.microbatch))
        peak = max(peak, len(live))
    return peak


def peak_pending_w(table: list[Action]) -> int:
    """Most W's pending at once (their B ran, their W not yet): what the split backward keeps."""
    pending = peak = 0
    for a in table:
        pending += (a.kind == "B") - (a.kind == "W")
        peak = max(peak, pending)
    return peak if any(a.kind == "W" for a in table) else 0


def peak_pending_w_bytes(table: list[Action], w_bytes: Callable[[int], int],
                         prompt_bytes: Callable[[int], int] | None = None) -> int:
    """Most bytes the pending W's keep at once, a W of chunk c keeping ``w_bytes(c)``: the count times one
    W's bytes only where every chunk keeps the same, which ZB-V's chunks of uneven splits do not.
    ``prompt_bytes(c)``: what a B of chunk c keeps only until just after it (the output layer's weight
    gradient, run as soon as B's input gradient is sent), on top of the pending W's at that moment."""
    if not any(a.kind == "W" for a in table):
        return 0  # an unsplit table: its B's are whole backwards and keep nothing for later
    pending = peak = 0
    for a in table:
        if a.kind in ("B", "W"):
            pending += w_bytes(a.chunk) if a.kind == "B" else -w_bytes(a.chunk)
        extra = prompt_bytes(a.chunk) if prompt_bytes is not None and a.kind == "B" else 0
        peak = max(peak, pending + extra)
    return peak


def peak_loss_buffers(table: list[Action], loss_chunk: int, prompt: bool = True) -> int:
    """Most micro-batches of the loss chunk whose logits or logits gradient (the fused path: its fp32 partial
    weight gradient) are held at once: from their F to their B (the cross-entropy's saved logits) and, in a
    split table, on to the output layer's weight gradient, which runs right after B with ``prompt`` (the
    executor) or at the table's W without (1F1B holds one; a W deferred p − 1 micro-batches held p)."""
    live: set[int] = set()
    peak = 0
    split = any(a.kind == "W" for a in table)
    free_at = "B" if prompt or not split else "W"
    for a in table:
        if a.chunk != loss_chunk:
            continue
        if a.kind == "F":
            live.add(a.microbatch)
        peak = max(peak, len(live))
        if a.kind == free_at:
            live.discard(a.microbatch)
    return peak


@dataclass(frozen=True)
class ChunkBytes:
    """What one micro-batch of a model chunk keeps, in bytes: ``activation`` from its F to its B (the layers'
    saved tensors), ``w`` from its B to its W (each GEMM's input and output gradient, the embedding's
    lookup gradient), ``logits`` from F to just after B (the loss chunk's logits, its gradient in place),
    ``prompt`` at the end of the loss chunk's B only (the output layer's weight gradient, made there),
    ``embedding`` at the end of the first stage's backward, or of its W, only (the dense embedding gradient)."""

    activation: float
    w: float = 0.0
    logits: float = 0.0
    prompt: float = 0.0
    embedding: float = 0.0


def peak_live_bytes(table: Sequence[Action], chunks: Sequence[ChunkBytes]) -> tuple[float, float]:
    """(the most bytes the table keeps at once, the pending W's part of them then): the table played, an F
    adding its chunk's activation and logits, a B turning the activation into its W bytes (a whole backward,
    in tables without W's: freeing them) with the output layer's weight gradient on top at its end, the
    logits freed just after it, a W freeing its bytes; the embedding's gradient on top at the end of the
    first stage's backward (or W). docs/design.md §3.4; measured: bench/zero_bubble_memory.py."""
    split = any(a.kind == "W" for a in table)
    live = pending = 0.0
    best = (0.0, 0.0)

    def seen(extra: float = 0.0) -> None:
        nonlocal best
        if live + extra > best[0]:
            best = (live + extra, pending)

    for a in table:
        c = chunks[a.chunk]
        if a.kind == "F":
            live += c.activation + c.logits
            seen()
        elif a.kind == "B" and split:
            live += c.w - c.activation
            pending += c.w
            seen(c.prompt)
            live -= c.logits
        elif a.kind == "B":
            seen(c.prompt)
            live -= c.activation + c.logits
            seen(c.embedding)
        else:
            live -= c.w
            pending -= c.w
            seen(c.embedding)
    return best


def play(name: str, p: int, m: int, f: float, b: float, w: float, whole: float | None = None,
         holds: tuple[int, ...] | None = None) -> Trace:
    """The named schedule on the ideal machine (free messages). ``f``, ``b``, ``w``: one chunk's forward,
    input-gradient backward and weight-gradient times (chunk = stage when v = 1); tables without W's run
    their backward as one action of ``whole`` (default b + w); ``holds``: ScheduleSpec.holds."""
    spec = spec_for(name, p, m, holds)
    tables = build_tables(spec)
    split = any(a.kind == "W" for t in tables for a in t)
    back = b if split else (b + w if whole is None else whole)
    return simulate(tables, p, spec.vp, f_time=f, b_time=back, w_time=w if split else 0.0, stages=spec.stages)


def span(trace: Trace) -> float:
    """Time from the first action's start to the last one's end."""
    return max(e for t in trace.values() for _, _, e in t) - min(s for t in trace.values() for _, s, _ in t)


def idle_per_rank(trace: Trace) -> list[float]:
    """Each rank's time within the span spent on no action (rank order)."""
    total = span(trace)
    return [total - sum(e - s for _, s, e in trace[r]) for r in sorted(trace)]
