"""Zero-bubble schedule tables (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): ZB-H1 and ZB-V.

Each micro-batch's backward is split into B, the gradient of the stage's input (on the critical path:
the previous stage waits for it), and W, the weight gradients (needed only by the optimizer step), so W
can run wherever the rank would otherwise wait.

- **ZB-H1** (one chunk per rank, any m): 1F1B's order of F and B, and rank r runs the W of micro-batch k
  right after the B of micro-batch k + r (the last r W's at the end). So rank r holds at most p - r
  micro-batches between their F and their B (1F1B's count) and at most p between their F and their W
  (1F1B's count on rank 0): 1F1B's activation memory, plus what the r deferred W's keep (each layer's
  GEMM inputs and output gradients; not the output layer's, whose W the executor runs right after its B,
  docs/design.md §3.4). With F = B = W the bubble is (p - 1)(F + B - W) against 1F1B's
  (p - 1)(F + B + W): a third (checked for p up to 8 by the simulator in the tests).
- **ZB-V** (two chunks per rank in a V, ``stages.StageMap``, any m): a micro-batch runs down the ranks
  through chunk 0 and back up through chunk 1, so rank 0 holds the first and the last stage. The table is
  built by playing the pipeline on an ideal machine in unit steps (F = B = W per chunk, messages free):
  each rank takes, when free, the first that is ready of: a B (chunk 0's first), an F (chunk 1's first)
  while it holds fewer than 2p chunk-micro-batches (half a stage each: 1F1B's peak of p stages) short of
  their B and of their W, the oldest pending W. With F = B = W the bubble is p - 1 chunk steps, the
  least any V allows (rank p - 1 waits that long for its first forward), against 1F1B's 6(p - 1): a sixth.
  With m < p the tables are valid but the start-up dominates (the simulator gives the figures).

Those are the schedules' own holds (p micro-batches between F and W for ZB-H1, 2p chunk-micro-batches for
ZB-V). ``ScheduleSpec.holds`` lowers a rank's (``h1_delay``; ZB-V's F rule), where the planner finds its
bytes would pass 1F1B's highest rank (``planning/zero_bubble_memory.py``): ZB-H1's last rank beside a large
vocabulary's logits, ZB-V's rank 0 beside both vocabulary matrices.

Every table is checked by the simulator (``schedule_table.simulate``) and the round planner before use.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megalite.pipeline.stages import Action, ScheduleSpec, StageMap


@dataclass
class _Rank:
    """One rank's progress while the table is played: next F / B per chunk, pending W's, counts held."""

    chunks: int
    next_f: list[int] = field(default_factory=list)
    next_b: list[int] = field(default_factory=list)
    pending_w: deque = field(default_factory=deque)
    forwards: int = 0
    backwards: int = 0
    weights: int = 0
    table: list[Action] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.next_f, self.next_b = [0] * self.chunks, [0] * self.chunks


def defer_weights(table: list[Action], delay: int) -> list[Action]:
    """A table whose B's are whole backwards turned into B's and W's: W of the k-th backward right after
    the (k + delay)-th B, the last ``delay`` at the end (ZB-H1 with delay = the rank)."""
    out: list[Action] = []
    backwards = [a for a in table if a.kind == "B"]
    for a in table:
        out.append(a)
        if a.kind == "B":
            k = len([x for x in out if x.kind == "B"]) - 1 - delay
            if k >= 0:
                out.append(Action("W", *backwards[k][1:]))
    done = len([a for a in out if a.kind == "W"])
    return out + [Action("W", *b[1:]) for b in backwards[done:]]


def h1_delay(spec: ScheduleSpec, rank: int) -> int:
    """ZB-H1: how many B's rank ``rank``'s W's follow theirs: r, or less where its hold says so. Rank r holds
    min(p - r, m) micro-batches between F and B (1F1B's) plus the W's it delays, so a hold leaves
    hold - min(p - r, m) of them; a hold below 1F1B's own count cannot be kept by moving W's."""
    p, m = spec.pp, spec.microbatches
    in_flight = min(p - rank, m)
    if spec.hold(rank) < in_flight:
        raise ValueError(f"zb-h1 rank {rank} holds {in_flight} micro-batches between F and B (1F1B's count); "
                         f"a hold of {spec.hold(rank)} is below it")
    return min(rank, spec.hold(rank) - in_flight)


def _dep(kind: str, stage: int, mb: int, last: int) -> tuple[str, int, int] | None:
    if kind == "F":
        return ("F", stage - 1, mb) if stage > 0 else None
    return ("B", stage + 1, mb) if stage < last else ("F", stage, mb)


def _choose(spec: ScheduleSpec, stages: StageMap, rk: _Rank, r: int, done: dict, t: int) -> Action | None:
    """The action rank r takes at step t: a ready B (the shallower chunk's first), else a ready F (the
    deeper chunk's first) while it holds fewer than its hold (2p, or ``spec.holds``) chunk-micro-batches short
    of their W, else the oldest pending W. Below 2p a shallower chunk's F also leaves one place free for
    each deeper chunk with F's to come: without it a rank fills its hold with chunk 0's micro-batches and
    waits for ever for the chunk 1 F that would complete one of them."""
    m, ready = spec.microbatches, (lambda d: d is None or done.get(d, t + 1) <= t)
    deep_first = sorted(range(rk.chunks), key=lambda c: -stages.stage(r, c))
    for c in reversed(deep_first):
        mb = rk.next_b[c]
        if mb < m and mb < rk.next_f[c] and ready(_dep("B", stages.stage(r, c), mb, stages.last)):
            return Action("B", c, mb)
    hold = spec.hold(r)
    reserve = hold < 2 * spec.pp
    for i, c in enumerate(deep_first):
        kept = sum(1 for d in deep_first[:i] if rk.next_f[d] < m) if reserve else 0
        mb = rk.next_f[c]
        if mb < m and rk.forwards - rk.weights < hold - kept and ready(_dep("F", stages.stage(r, c), mb,
                                                                             stages.last)):
            return Action("F", c, mb)
    return Action("W", *rk.pending_w[0]) if rk.pending_w else None


def _take(rk: _Rank, a: Action) -> None:
    rk.table.append(a)
    if a.kind == "F":
        rk.next_f[a.chunk] += 1
        rk.forwards += 1
    elif a.kind == "B":
        rk.next_b[a.chunk] += 1
        rk.backwards += 1
        rk.pending_w.append((a.chunk, a.microbatch))
    else:
        rk.pending_w.popleft()
        rk.weights += 1


def zbv_tables(spec: ScheduleSpec) -> list[list[Action]]:
    """Every rank's table of F, B and W actions of ZB-V (two chunks per rank)."""
    if spec.vp != 2 or spec.microbatches < 1:
        raise ValueError(f"--pipeline-schedule zbv runs 2 model chunks per rank and at least one micro-batch, "
                         f"not {spec.vp} and {spec.microbatches}")
    stages, p = spec.stages, spec.pp
    ranks = [_Rank(spec.vp) for _ in range(p)]
    total = 3 * spec.microbatches * spec.vp
    done: dict[tuple[str, int, int], int] = {}
    t = 0
    while any(len(rk.table) < total for rk in ranks):
        moved = False
        for r, rk in enumerate(ranks):
            a = _choose(spec, stages, rk, r, done, t) if len(rk.table) < total else None
            if a is not None:
                _take(rk, a)
                done[(a.kind, stages.stage(r, a.chunk), a.microbatch)] = t + 1
                moved = True
        if not moved and all(v <= t for v in done.values()):
            stuck = {r: rk.table[-1:] for r, rk in enumerate(ranks) if len(rk.table) < total}
            raise RuntimeError(f"zbv table for p={p}, m={spec.microbatches} cannot complete: {stuck}")
        t += 1
    return [rk.table for rk in ranks]
