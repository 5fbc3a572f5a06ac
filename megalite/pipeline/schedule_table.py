"""Pipeline schedules as pure tables: for every rank, the ordered list of (F|B|W, chunk, micro-batch).

The executor runs a table; tests check the tables without processes (warm-up counts, each
(micro-batch, chunk) forward then backward exactly once, dependencies satisfiable without deadlock).

- no pipelining (p = 1): F0 B0 F1 B1 ... (gradient accumulation)
- GPipe: all forwards, then all backwards
- 1F1B: warm-up of min(p - r - 1, m) forwards, then one-forward-one-backward, then the cool-down
- interleaved 1F1B (v chunks per rank): warm-up (p - r - 1) * 2 + (v - 1) * p, capped at m * v;
  micro-batches advance in groups of p through the chunks (needs m divisible by p)
- zero bubble, ZB-H1 and ZB-V (``zero_bubble.py``): the backward split into B (input gradient) and W
  (weight gradients), the W's placed where 1F1B would wait; ZB-V on two chunks per rank in a V
  (``stages.py``). In the other schedules "B" is the whole backward.
"""

from __future__ import annotations

from collections.abc import Callable

from megalite.pipeline.stages import ZERO_BUBBLE, Action, ScheduleSpec, StageMap
from megalite.pipeline.zero_bubble import defer_weights, h1_delay, zbv_tables

__all__ = ["ZERO_BUBBLE", "Action", "ScheduleSpec", "StageMap", "build_tables", "simulate"]


def _forward_order(k: int, pp: int, vp: int) -> tuple[int, int]:
    """(chunk, micro-batch) of the k-th forward on a rank under the interleaved order."""
    group, pos = divmod(k, pp * vp)
    return (k // pp) % vp, group * pp + pos % pp


def _backward_order(k: int, pp: int, vp: int) -> tuple[int, int]:
    chunk, mb = _forward_order(k, pp, vp)
    return vp - 1 - chunk, mb


def warmup_count(spec: ScheduleSpec, rank: int) -> int:
    p, v, m = spec.pp, spec.vp, spec.microbatches
    if spec.kind == "gpipe":
        return m * v
    if v == 1:
        return min(p - rank - 1, m)
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def rank_table(spec: ScheduleSpec, rank: int) -> list[Action]:
    p, v, m = spec.pp, spec.vp, spec.microbatches
    total = m * v
    fwd = [Action("F", *_forward_order(k, p, v)) for k in range(total)]
    bwd = [Action("B", *_backward_order(k, p, v)) for k in range(total)]
    warm = warmup_count(spec, rank)
    table = fwd[:warm]
    for k in range(total - warm):
        table += [fwd[warm + k], bwd[k]]
    return table + bwd[total - warm:]


def forward_only_table(spec: ScheduleSpec) -> list[Action]:
    """Every micro-batch through every chunk, in the order the stages visit the chunks (the V shape: chunk 0,
    then chunk 1, per micro-batch)."""
    if spec.kind == "zbv":  # down the ranks through chunk 0, then back up through chunk 1
        return [Action("F", c, mb) for c in range(2) for mb in range(spec.microbatches)]
    return [Action("F", *_forward_order(k, spec.pp, spec.vp)) for k in range(spec.microbatches * spec.vp)]


def build_tables(spec: ScheduleSpec) -> list[list[Action]]:
    if spec.kind == "zbv":
        return zbv_tables(spec)
    if spec.kind == "zb-h1":
        if spec.vp != 1:
            raise ValueError(f"--pipeline-schedule zb-h1 runs one model chunk per rank, not {spec.vp}")
        return [defer_weights(rank_table(ScheduleSpec(spec.pp, 1, spec.microbatches), r), h1_delay(spec, r))
                for r in range(spec.pp)]
    return [rank_table(spec, r) for r in range(spec.pp)]


def simulate(tables: list[list[Action]], pp: int, vp: int, f_time: float = 1.0, b_time: float = 2.0,
             duration: Callable[[int, Action], float] | None = None, w_time: float = 0.0,
             stages: StageMap | None = None) -> dict[int, list[tuple[Action, float, float]]]:
    """Run the tables on an ideal machine (p2p is free) and return each rank's (action, start, end).

    Raises RuntimeError naming the stuck ranks if the tables deadlock (a receive whose send can never
    happen). Forward of virtual stage s needs the forward of s-1; backward of s needs the backward of
    s+1 (the last stage's backward needs its own forward); W needs its own B. ``b_time`` is a whole
    backward in tables without W, its input-gradient part in tables with them (then ``w_time`` is W's).
    ``duration(rank, action)`` overrides the fixed times (e.g. to replay a measured step)."""
    stages = stages or StageMap(pp, vp)
    times = {"F": f_time, "B": b_time, "W": w_time}
    done: dict[tuple[str, int, int], float] = {}  # (kind, virtual stage, mb) -> end time
    pos = [0] * pp
    clock = [0.0] * pp
    trace: dict[int, list[tuple[Action, float, float]]] = {r: [] for r in range(pp)}
    remaining = sum(len(t) for t in tables)
    while remaining:
        progressed = False
        for r in range(pp):
            if pos[r] == len(tables[r]):
                continue
            a = tables[r][pos[r]]
            dep = _dependency(a, stages.stage(r, a.chunk), stages.last)
            if dep is not None and dep not in done:
                continue
            start = max(clock[r], done[dep] if dep else 0.0)
            end = start + (duration(r, a) if duration else times[a.kind])
            done[(a.kind, stages.stage(r, a.chunk), a.microbatch)] = end
            clock[r] = end
            trace[r].append((a, start, end))
            pos[r] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            stuck = {r: tables[r][pos[r]] for r in range(pp) if pos[r] < len(tables[r])}
            raise RuntimeError(f"pipeline schedule deadlocks; ranks wait at {stuck}")
    return trace


def _dependency(a: Action, s: int, last: int) -> tuple[str, int, int] | None:
    """What action ``a`` of virtual stage ``s`` waits for."""
    if a.kind == "F":
        return ("F", s - 1, a.microbatch) if s > 0 else None
    if a.kind == "W":
        return ("B", s, a.microbatch)
    return ("B", s + 1, a.microbatch) if s < last else ("F", s, a.microbatch)


def bubble_fraction(trace: dict[int, list[tuple[Action, float, float]]]) -> float:
    """Idle time over busy time, averaged over ranks: compare with (p - 1) / (v * m)."""
    span = max(end for t in trace.values() for _, _, end in t) - min(s for t in trace.values() for _, s, _ in t)
    fracs = []
    for t in trace.values():
        busy = sum(end - start for _, start, end in t)
        fracs.append((span - busy) / busy)
    return sum(fracs) / len(fracs)
