"""Promise: the NCCL checkers see what NCCL would do with every operation, not only with the pipeline's batches:

- a collective on a kind aliased to a batch-carrying group (TP x CP = CP when TP = 1) is queued behind that
  communicator's batches, so a batch/all-reduce crossing is a deadlock (emulation and replay);
- a rank blocked in a collective of any group takes part in the deadlock search (reported in seconds, not
  after the group timeout);
- a batch never waited on by the end of a step is reported (emulation and replay);
- two ranks issuing the operations of two communicators in opposite orders are reported (emulation and
  replay), since NCCL can deadlock on them when they run at once.

Each scenario is two ranks with tiny tensors; each report names the ranks and the operations.
"""

from __future__ import annotations

import os

import pytest
import torch

from megalite.parallel import nccl_check
from megalite.parallel.groups import NCCL_SEMANTICS_ENV, Group, P2POp, ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.nccl_check import NcclCheckError, Op, Post, Wait, replay
from tests.harness import run_ranks

# The ranks must report within this many seconds or the harness fails the test (the deadlock search looks
# once a second; NCCL's group timeout, what a missed deadlock would end in, is 10 minutes).
REPORT_WITHIN_S = 90


def _emulated(layout: RankLayout, rank: int) -> ProcessGroups:
    os.environ[NCCL_SEMANTICS_ENV] = "1"
    return ProcessGroups.build(layout, rank)


def _send_or_recv(pg: ProcessGroups, kind: str, label: str = "x"):
    """Rank 0 sends a small tensor to rank 1 of group ``kind`` in one batch; rank 1 receives it."""
    op = P2POp("send", torch.ones(2), 1, label) if pg.index(kind) == 0 else P2POp("recv", torch.zeros(2), 0, label)
    return pg.post_p2p([op], kind=kind)


def _both(fn, *args) -> list[str]:
    return run_ranks(fn, 2, *args, timeout=REPORT_WITHIN_S)


# ---- 1. a collective on an alias joins the communicator's queue ---------------------------------------
def _alias_crossing(rank: int, world: int) -> str:
    pg = _emulated(RankLayout(2, cp=2), rank)  # TP x CP: the CP group itself (TP = 1)
    t = torch.ones(1)
    try:
        if rank == 0:  # batch, then all-reduce on the same communicator
            work = _send_or_recv(pg, Group.CP)
            pg.all_reduce(t, Group.TP_CP)
            work.wait()
        else:  # all-reduce, then batch
            pg.all_reduce(t, Group.TP_CP)
            _send_or_recv(pg, Group.CP).wait()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_emulation_queues_a_collective_on_an_alias_behind_the_batches():
    out = _both(_alias_crossing)
    for text in out:
        assert "NCCL-semantics deadlock" in text, text
        assert "rank 0" in text and "rank 1" in text and "cp:0,1" in text and "all_reduce" in text, text


# ---- 2. a rank blocked in a collective of any group is part of the cycle ------------------------------
def _blocked_in_collective(rank: int, world: int) -> str:
    pg = _emulated(RankLayout(2, pp=2), rank)  # MP = the same ranks as PP, its own communicator
    t = torch.ones(1)
    try:
        if rank == 0:  # reduces before sending what rank 1 waits for
            pg.all_reduce(t, Group.MP)
            _send_or_recv(pg, Group.PP).wait()
        else:
            _send_or_recv(pg, Group.PP).wait()
            pg.all_reduce(t, Group.MP)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_emulation_reports_a_rank_blocked_in_a_collective():
    out = _both(_blocked_in_collective)
    for text in out:
        assert "NCCL-semantics deadlock" in text, text
        assert "mp:0,1" in text and "all_reduce" in text and "pp:0,1" in text and "recv x from rank 0" in text, text


# ---- 3. a batch never waited on by the step end ---------------------------------------------------------
def _never_waited(rank: int, world: int) -> str:
    pg = _emulated(RankLayout(2, pp=2), rank)
    work = _send_or_recv(pg, Group.PP, "activation chunk 0 micro-batch 0")
    if rank == 1:
        work.wait()
    try:
        pg.end_step("test step")
    except RuntimeError as e:
        work.wait()  # let the message finish before the rank leaves
        return str(e)
    return "no error"


def test_emulation_reports_a_batch_never_waited_on():
    sender, receiver = _both(_never_waited)
    assert receiver == "no error"
    assert "rank 0 reaches the step end (test step) without waiting for" in sender, sender
    assert "send activation chunk 0 micro-batch 0 to rank 1] on pp:0,1" in sender and "never waited" in sender


def test_checker_reports_a_batch_never_waited_on():
    send = Post("pp:0,1", (Op("send", 1, "activation chunk 0 micro-batch 0", (2,)),), "round 0")
    recv = Post("pp:0,1", (Op("recv", 0, "activation chunk 0 micro-batch 0", (2,)),), "round 0")
    replay([[send, Wait(0)], [recv, Wait(0)]])  # waited on both sides: fine
    with pytest.raises(NcclCheckError, match=r"rank 0 reaches the step end \(end of the log\) without waiting for "
                       r"\[send activation chunk 0 micro-batch 0 to rank 1 \[2\]\] on pp:0,1 \(round 0\)"):
        replay([[send], [recv, Wait(0)]])


# ---- 4. the replay orders collectives of a batch-carrying communicator among its batches ----------------
def test_checker_records_collectives_among_batches():
    logs = []
    for rank in range(2):
        pg = ProcessGroups.unconnected(RankLayout(2, cp=2), rank, record=True)
        t = torch.ones(1)
        if rank == 0:
            work = _send_or_recv(pg, Group.CP)
            pg.all_reduce(t, Group.TP_CP)
            work.wait()
        else:
            pg.all_reduce(t, Group.TP_CP)
            _send_or_recv(pg, Group.CP).wait()
        logs.append(pg.p2p_log)
    assert pg.comms[Group.TP_CP] == pg.comms[Group.CP] == "cp:0,1"  # TP x CP is the CP group when TP = 1
    assert logs[0][1] == nccl_check.Collective("cp:0,1", (0, 1), "all_reduce")
    with pytest.raises(NcclCheckError, match="deadlock") as err:
        replay(logs)
    text = str(err.value)
    assert "rank 0 waits for [all_reduce with rank 1] on cp:0,1" in text, text
    assert "rank 1 waits for [all_reduce with rank 0] on cp:0,1" in text, text


# ---- 5. operations of two communicators issued in opposite orders --------------------------------------
def _orders(rank: int, world: int) -> list[str]:
    pg = _emulated(RankLayout(2, cp=2), rank)  # DP x CP = the same ranks as CP, its own communicator
    out = []
    for crossed in (False, True):
        t = torch.ones(1)
        if rank == 0 or not crossed:
            work = _send_or_recv(pg, Group.CP)
            pg.all_reduce(t, Group.DP_CP)
            work.wait()
        else:
            pg.all_reduce(t, Group.DP_CP)
            _send_or_recv(pg, Group.CP).wait()
        try:
            pg.end_step("crossed" if crossed else "same order")
            out.append("no error")
        except RuntimeError as e:
            out.append(str(e))
    return out


def test_emulation_reports_operations_issued_in_different_orders():
    out = _both(_orders)
    assert [o[0] for o in out] == ["no error", "no error"], out
    reports = [o[1] for o in out if o[1] != "no error"]
    assert reports, out  # whichever rank reaches the step end second compares the two orders
    for text in reports:
        assert "issue-order mismatch between rank" in text and "rank 0 issues send x to rank 1 on cp:0,1" in text
        assert "before all_reduce #1 on dp_cp:0,1" in text and "rank 1 issues all_reduce #1 on dp_cp:0,1 before " \
            "recv x from rank 0 on cp:0,1" in text, text


def test_checker_reports_operations_issued_in_different_orders():
    x = Op("send", 1, "x", (2,)), Op("recv", 0, "x", (2,))
    y = Op("send", 1, "y", (2,)), Op("recv", 0, "y", (2,))
    same = [[Post("pp:0,1", (x[0],)), Post("pair:0,1", (y[0],)), Wait(0), Wait(1)],
            [Post("pp:0,1", (x[1],)), Post("pair:0,1", (y[1],)), Wait(0), Wait(1)]]
    replay(same)
    crossed = [same[0], [Post("pair:0,1", (y[1],)), Post("pp:0,1", (x[1],)), Wait(0), Wait(1)]]
    with pytest.raises(NcclCheckError, match=r"mismatch between rank 0 and rank 1: rank 0 issues send x to rank 1 "
                       r"\[2\] on pp:0,1 before send y to rank 1 \[2\] on pair:0,1, but rank 1 issues recv y from "
                       r"rank 0 \[2\] on pair:0,1 before recv x from rank 0 \[2\] on pp:0,1"):
        replay(crossed)


# ---- the deadlock search follows what each host waits on ------------------------------------------------
def _state(waits: list[str], queues: dict[str, list[list]]) -> dict:
    """A published state: the queues the host waits on, and each queue's operations (the first is the head)."""
    return {"v": 0, "blocked": "waits", "waits": waits, "queued": queues,
            "heads": [{"comm": c, "item": c, "pending": ops[:1]} for c, ops in queues.items()]}


def test_emulation_takes_no_slow_peer_for_a_deadlock():
    """Rank 0 waits for rank 2 (busy, so publishing nothing) in a DP all-reduce; its CP queue holds a send
    rank 1 will receive only after a TP all-reduce that rank 0 posts once rank 2 arrives: slow, no cycle.
    With rank 1 waiting for a message queued behind that send instead, it is one (rank 0's host is off
    it, its queue is on it)."""
    from megalite.parallel.nccl_emulation import _find_cycle

    slow = {0: _state(["dp"], {"dp": [["collective", 2, 0, "all_reduce"]], "cp": [["send", 1, 0, "x"]]}),
            1: _state(["tp"], {"tp": [["collective", 0, 0, "all_reduce"]]})}
    assert _find_cycle(("host", 0), slow) is None and _find_cycle(("host", 1), slow) is None
    stuck = {0: _state(["dp"], {"dp": [["collective", 2, 0, "all_reduce"]],
                                "cp": [["recv", 1, 0, "y"], ["send", 1, 0, "x"]]}),
             1: _state(["cp"], {"cp": [["recv", 0, 0, "x"]]})}
    assert _find_cycle(("host", 0), stuck) is None
    assert _find_cycle(("host", 1), stuck) == [("host", 1), ("queue", 1, "cp"), ("queue", 0, "cp")]
