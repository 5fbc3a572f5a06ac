"""Which messages a pipeline rank sends and receives, and in which batch: derived from the schedule tables.

NCCL ignores tags and matches the point-to-point messages of a pair of ranks in the order they are
posted; a send completes only when its receive has been posted, and the operations on a communicator run
one after another unless they were posted together as one batch. A rank that waits for a message while
its own earlier send still waits for a receive its peer posts later deadlocks. So the traffic is planned
in rounds, from the tables of all ranks, identically on every rank:

- in round k each rank runs at most one action of its table, the next one, if the message it needs was
  sent in an earlier round (the pipeline's own dependency order, as on an ideal machine);
- at the end of round k each rank posts one batch: the message its action produced, and the receive of
  every message its neighbours produced for it in round k (posted at once, before it is needed);
- a round with nothing for a rank posts nothing.

Batch k of rank a toward b holds exactly the messages of b's batch k from a, so every batch matches its
peers' batch of the same round; the messages an action needs arrived in an earlier round, so by
induction every round completes: no deadlock, and no message taken for another, with or without tags.
``megalite.parallel.nccl_check`` replays what the executor recorded to show it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from megalite.pipeline.schedule_table import Action
from megalite.pipeline.stages import StageMap


class Message(NamedTuple):
    """One tensor moved between virtual stages: forward activations ("F") of ``microbatch`` into the
    receiving ``chunk``, or the gradient ("B") flowing back into it."""

    kind: str
    chunk: int  # the receiving rank's model chunk
    microbatch: int

    def label(self) -> str:
        return f"{'activation' if self.kind == 'F' else 'gradient'} chunk {self.chunk} micro-batch {self.microbatch}"


class Step(NamedTuple):
    """One round of one rank: its action (or None), then one batch of sends and receives, each a
    (peer pipeline rank, message) pair."""

    round: int
    action: Action | None
    sends: tuple[tuple[int, Message], ...]
    recvs: tuple[tuple[int, Message], ...]


def needed(action: Action, p: int, r: int, vp: int, stages: StageMap | None = None) -> tuple[int, Message] | None:
    """(source pipeline rank, message) that ``action`` on rank ``r`` must receive first, if any; the source
    is ``r`` itself where the V shape turns (rank p-1's chunk 0 feeds its chunk 1: a hand-off, no message).
    Weight-gradient actions ("W") need nothing."""
    stages = stages or StageMap(p, vp)
    stage = stages.stage(r, action.chunk)
    if action.kind == "W":
        return None
    if action.kind == "F":
        return (stages.holder(stage - 1)[0], Message("F", action.chunk, action.microbatch)) if stage > 0 else None
    return (stages.holder(stage + 1)[0], Message("B", action.chunk, action.microbatch)) if stage < stages.last else None


def produced(action: Action, p: int, r: int, vp: int, stages: StageMap | None = None) -> tuple[int, Message] | None:
    """(destination pipeline rank, message) that ``action`` on rank ``r`` hands on when it is done (to ``r``
    itself where the V shape turns)."""
    stages = stages or StageMap(p, vp)
    stage = stages.stage(r, action.chunk)
    if action.kind == "W" or (action.kind == "F" and stage == stages.last) or (action.kind == "B" and stage == 0):
        return None
    dst, chunk = stages.holder(stage + 1 if action.kind == "F" else stage - 1)
    return dst, Message(action.kind, chunk, action.microbatch)


def round_plan(tables: Sequence[Sequence[Action]], p: int, vp: int, stages: StageMap | None = None
               ) -> list[list[Step]]:
    """Every rank's rounds (only those where it acts or communicates). A hand-off to the rank itself is no
    message (its table orders producer before consumer). Raises RuntimeError naming the stuck ranks when
    the tables cannot complete."""
    pos, arrived = [0] * p, set()  # messages received by the end of the previous round
    plan: list[list[Step]] = [[] for _ in range(p)]
    k = 0
    while any(pos[r] < len(tables[r]) for r in range(p)):
        acted: list[Action | None] = [None] * p
        for r in range(p):
            if pos[r] < len(tables[r]):
                a = tables[r][pos[r]]
                need = needed(a, p, r, vp, stages)
                if need is None or need[0] == r or (r, need[1]) in arrived:
                    acted[r], pos[r] = a, pos[r] + 1
        if not any(acted):
            stuck = {r: tables[r][pos[r]] for r in range(p) if pos[r] < len(tables[r])}
            raise RuntimeError(f"pipeline schedule deadlocks; ranks wait at {stuck}")
        out = {r: produced(a, p, r, vp, stages) if a else None for r, a in enumerate(acted)}
        out = {r: o if o is None or o[0] != r else None for r, o in out.items()}  # hand-offs stay local
        for r in range(p):
            sends = (out[r],) if out[r] else ()
            recvs = tuple((src, msg) for src, o in out.items() if o for dst, msg in [o] if dst == r)
            if acted[r] or sends or recvs:
                plan[r].append(Step(k, acted[r], sends, recvs))
        arrived |= {(dst, msg) for o in out.values() if o for dst, msg in [o]}
        k += 1
    return plan
