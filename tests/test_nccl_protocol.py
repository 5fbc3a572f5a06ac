"""Promise: pipeline traffic is correct under NCCL's rules by construction (no tags; a pair's messages
matched in posting order; a send completes only when its receive is reached; a communicator runs its
operations in order unless they are one batch), shown two ways:

- the batches the real executor and the inference pipeline post, recorded on every rank of a layout
  (without communicating), replayed by the pure NCCL checker over a grid of (p, v, m), schedules,
  forward-only runs, host synchronisations and TP/DP replicas: no deadlock, no mismatched message;
- MEGALITE_NCCL_SEMANTICS=1 on real gloo ranks (the pipeline, CLI, task and generation tests run in
  that mode too, through the ``p2p_semantics`` fixture).

Both checkers have teeth: the posting order megalite used before (one unbatched operation at a time,
receives when needed) deadlocks 1F1B at p = 2, m = 4 in each, and a swapped message is reported.
"""

from __future__ import annotations

import os
import types

import pytest
import torch
from torch import nn

from megalite.inference.pipeline import pipeline_forward
from megalite.parallel.groups import NCCL_SEMANTICS_ENV, P2POp, ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.nccl_check import NcclCheckError, Op, Post, Wait, replay
from megalite.pipeline.executor import PipelinePass, PipelineRecord
from megalite.pipeline.p2p_plan import needed, produced
from megalite.pipeline.schedule_table import ScheduleSpec, build_tables
from megalite.pipeline.schedules import forward_backward
from megalite.pipeline.stages import StageMap
from tests.harness import run_ranks

H = 4
SHAPE = (2, 1, H)  # [s, b, h] between stages


class Stage(nn.Module):
    """A stand-in model chunk: the executor and the inference pipeline only call it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(H, H)
        self.cfg = types.SimpleNamespace(hidden_size=H)

    def forward(self, tokens=None, labels=None, hidden=None, kv_cache=None) -> torch.Tensor:
        x = hidden if hidden is not None else torch.ones(SHAPE)
        return self.lin(x)


def _step(chunk: nn.Module, mb: dict, hidden: torch.Tensor | None) -> torch.Tensor:
    out = chunk(hidden=hidden)
    return out.sum() if chunk.last else out


def record_training(world: int, tp: int, pp: int, vp: int, m: int, kind: str = "1f1b",
                    forward_only: bool = False, sync: bool = False, stages: StageMap | None = None) -> list[list]:
    """Every rank's recorded p2p events for one step of the real executor (no communication). Which chunk
    holds the loss comes from the schedule's own placement (the executor's: the V under ZB-V) unless
    ``stages`` says otherwise."""
    layout = RankLayout(world, tp, pp)
    stages = stages or ScheduleSpec(pp, vp, m, kind).stages
    logs = []
    for rank in range(world):
        pg = ProcessGroups.unconnected(layout, rank, record=True)
        chunks = [Stage() for _ in range(vp)]
        for c, chunk in enumerate(chunks):
            chunk.last = stages.stage(pg.pp_rank, c) == stages.last
        record = PipelineRecord(synchronize=True) if sync else None
        forward_backward(PipelinePass(chunks, [{}] * m, _step, pg, SHAPE, forward_only=forward_only, record=record),
                         kind)
        logs.append(pg.p2p_log)
    return logs


def record_inference(pp: int, vp: int) -> list[list]:
    logs = []
    for rank in range(pp):
        pg = ProcessGroups.unconnected(RankLayout(pp, 1, pp), rank, record=True)
        pipeline_forward([Stage() for _ in range(vp)], pg, torch.zeros(1, 2, dtype=torch.long))
        logs.append(pg.p2p_log)
    return logs


GRID = [(p, v, m, kind) for p in (2, 3, 4, 8) for v in (1, 2, 3) for kind in ("1f1b", "gpipe")
        for m in sorted({p, p * v, 2 * p, 4 * p + (p if v > 1 else 1), 64 - 64 % p})
        if not (v > 1 and m % p)]


@pytest.mark.parametrize("p,v,m,kind", GRID, ids=lambda x: str(x))
def test_recorded_training_traffic_is_nccl_safe(p, v, m, kind):
    replay(record_training(p, 1, p, v, m, kind))
    replay(record_training(p, 1, p, v, m, kind, forward_only=True))


ZB_CHUNKS = {"zb-h1": 1, "zbv": 2}  # zbv: two chunks per rank in a V; both take any m >= 1
ZB_GRID = [(p, m, kind) for p in (2, 3, 4, 8) for kind in ZB_CHUNKS for m in sorted({1, 2, p, 2 * p, 4 * p + 1})]


@pytest.mark.parametrize("p,m,kind", ZB_GRID, ids=lambda x: str(x))
def test_recorded_zero_bubble_traffic_is_nccl_safe(p, m, kind):
    """ZB-H1 and ZB-V, m below, at and above p: the B/W split and the V's turn (a hand-off on rank p - 1)."""
    v = ZB_CHUNKS[kind]
    for forward_only in (False, True):
        logs = record_training(p, 1, p, v, m, kind, forward_only=forward_only)
        assert all(any(isinstance(e, Post) for e in log) for log in logs)
        replay(logs)


def test_zero_bubble_replay_needs_the_v_placement():
    """Teeth: recorded as if ZB-V's chunks were round-robin, rank p - 1's chunk 1 hands on a loss (a scalar)
    where its neighbour receives hidden states, and the checker reports the mismatch."""
    with pytest.raises(NcclCheckError, match=r"from rank 3 to rank 2 is sent as activation chunk 1 micro-batch 0 "
                       r"\[\] but received as activation chunk 1 micro-batch 0 \[2, 1, 4\]"):
        replay(record_training(4, 1, 4, 2, 4, "zbv", forward_only=True, stages=StageMap(4, 2)))


@pytest.mark.parametrize("tp,dp,p,v,m", [(2, 2, 2, 2, 4), (2, 1, 4, 2, 8), (1, 2, 4, 1, 6), (2, 2, 2, 1, 3)])
def test_replicas_and_host_syncs_are_nccl_safe(tp, dp, p, v, m):
    """TP and DP replicas run their own pipelines on their own communicators; the timeline's host
    synchronisation before and after each action does not deadlock either."""
    logs = record_training(tp * dp * p, tp, p, v, m, sync=True)
    assert any(isinstance(e, Post) for e in logs[-1])
    replay(logs)


@pytest.mark.parametrize("p,v", [(2, 1), (2, 2), (4, 1), (4, 2), (3, 3)])
def test_recorded_inference_traffic_is_nccl_safe(p, v):
    replay(record_inference(p, v))


# ---- teeth ------------------------------------------------------------------------------------------
def legacy_events(p: int, m: int) -> list[list]:
    """The posting order megalite used before: each receive posted alone when its action needs it, each
    send alone after its action, on the pair's communicator (tags told the messages apart)."""
    tables = build_tables(ScheduleSpec(p, 1, m))
    logs = []
    for r, table in enumerate(tables):
        events: list = []
        for a in table:
            need = needed(a, p, r, 1)
            if need:
                events.append(Post(_pair(r, need[0]), (Op("recv", need[0], need[1].label(), SHAPE),)))
                events.append(Wait(len(events) - 1))
            out = produced(a, p, r, 1)
            if out:
                events.append(Post(_pair(r, out[0]), (Op("send", out[0], out[1].label(), SHAPE),)))
        logs.append(events)
    return logs


def _pair(a: int, b: int) -> str:
    return f"pair:{min(a, b)},{max(a, b)}"


def test_checker_finds_the_old_posting_order_deadlocks():
    with pytest.raises(NcclCheckError, match="deadlock") as err:
        replay(legacy_events(2, 4))
    text = str(err.value)
    assert "rank 0" in text and "rank 1" in text and "activation chunk 0 micro-batch 1" in text


def test_checker_reports_a_swapped_message():
    logs = record_training(2, 1, 2, 1, 4)
    sends = [i for i, e in enumerate(logs[0]) if isinstance(e, Post) and e.ops[0].kind == "send"]
    a, b = sends[0], sends[1]
    logs[0][a], logs[0][b] = logs[0][b], logs[0][a]
    with pytest.raises(NcclCheckError, match="message 0 from rank 0 to rank 1 is sent as activation chunk 0 "
                       "micro-batch 1 .* but received as activation chunk 0 micro-batch 0"):
        replay(logs)


def test_checker_reports_a_shape_mismatch():
    logs = [[Post("pp:0,1", (Op("send", 1, "x", (2, 3)),))], [Post("pp:0,1", (Op("recv", 0, "x", (3, 2)),))]]
    with pytest.raises(NcclCheckError, match=r"mismatch.*\[2, 3\].*\[3, 2\]"):
        replay(logs)


# ---- the emulation on real ranks --------------------------------------------------------------------
def _legacy_on_ranks(rank: int, world: int) -> str:
    os.environ[NCCL_SEMANTICS_ENV] = "1"
    pg = ProcessGroups.build(RankLayout(2, 1, 2), rank)
    works = {}
    try:
        for i, ev in enumerate(legacy_events(2, 4)[rank]):
            if isinstance(ev, Post):
                op = ev.ops[0]
                works[i] = pg.post_p2p([P2POp(op.kind, torch.zeros(SHAPE), op.peer, op.label)], batched=False)
            else:
                works[ev.post].wait()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_emulation_reports_the_old_posting_order_as_a_deadlock():
    out = run_ranks(_legacy_on_ranks, 2, timeout=60)
    for text in out:
        assert "NCCL-semantics deadlock" in text, text
        assert "rank 0" in text and "rank 1" in text and "pair:0,1" in text


def _mismatch_on_ranks(rank: int, world: int) -> str:
    os.environ[NCCL_SEMANTICS_ENV] = "1"
    pg = ProcessGroups.build(RankLayout(2, 1, 2), rank)
    ops = [P2POp("send", torch.zeros(2, 3), 1, "activation chunk 0 micro-batch 0")] if rank == 0 else \
        [P2POp("recv", torch.zeros(3, 2), 0, "activation chunk 0 micro-batch 0")]
    try:
        pg.post_p2p(ops).wait()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_emulation_checks_shapes_gloo_does_not():
    sender, receiver = run_ranks(_mismatch_on_ranks, 2, timeout=60)
    assert sender == "no error"
    assert "mismatch" in receiver and "[3, 2]" in receiver and "[2, 3]" in receiver, receiver
