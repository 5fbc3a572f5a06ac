"""Promises (docs/parallelism.md, "Hierarchical context parallelism and per-layer comm types"):

- the a2a+p2p sub-groups of every CP group are pure arithmetic: each CP rank in exactly one all-to-all group
  (a consecutive CP ranks) and one ring (the c/a CP ranks with its index in their all-to-all group), a x c/a
  = c, Megatron-LM's levels for two sizes;
- ProcessGroups builds them (only when the sizes are given; a sub-group that is all of CP shares CP's
  communicator) and they carry an all-to-all and a ring batch on real ranks, plain and under
  MEGALITE_NCCL_SEMANTICS=1, and replay cleanly under the NCCL checker.
"""

from __future__ import annotations

import os

import pytest
import torch

from megalite.parallel.groups import NCCL_SEMANTICS_ENV, Group, P2POp, ProcessGroups
from megalite.parallel.layout import RankLayout, split_cp_group
from megalite.parallel.nccl_check import replay
from tests.harness import run_ranks


# ---- rank arithmetic ------------------------------------------------------------------------------------
@pytest.mark.parametrize("c, a", [(2, 1), (2, 2), (4, 2), (6, 2), (6, 3), (8, 2), (8, 4)])
def test_split_cp_group_puts_every_rank_in_one_group_of_each_kind(c, a):
    ranks = [5 + 3 * i for i in range(c)]  # a CP group's ranks in CP order (any stride)
    a2a, ring = split_cp_group(ranks, a)
    for groups, size in ((a2a, a), (ring, c // a)):
        assert sorted(r for g in groups for r in g) == ranks  # every rank exactly once
        assert {len(g) for g in groups} == {size}
    assert len(a2a[0]) * len(ring[0]) == c
    for g in a2a:  # consecutive in CP order
        idx = [ranks.index(r) for r in g]
        assert idx == list(range(idx[0], idx[0] + a))
    for i, r in enumerate(ranks):  # a2a member i % a, ring member i // a: the same index in every a2a group
        mine = next(g for g in a2a if r in g)
        assert mine.index(r) == i % a
        assert next(g for g in ring if r in g).index(r) == i // a
    with pytest.raises(ValueError, match="does not divide a context-parallel group"):
        split_cp_group(ranks, c + 1)


def test_two_sizes_are_megatrons_first_two_levels():
    """Megatron-LM's docstring: sizes [2, 2] over g0..g3 make level-1 groups [g0, g1], [g2, g3] and level-2
    groups [g0, g2], [g1, g3]; more sizes: the ring is every rank with the same a2a index."""
    assert RankLayout(4, cp=4, hierarchical_cp=(2, 2)).cp_hierarchical_groups() == ([[0, 1], [2, 3]], [[0, 2], [1, 3]])
    a2a, ring = RankLayout(8, cp=8, hierarchical_cp=[2, 2, 2]).cp_hierarchical_groups()
    assert a2a == [[0, 1], [2, 3], [4, 5], [6, 7]] and ring == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ValueError, match=r"\[2, 3\] do not multiply to cp 4"):
        RankLayout(4, cp=4, hierarchical_cp=(2, 3))


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-cp-pp-dp"])
def test_layout_sub_groups_split_each_cp_group(order):
    layout = RankLayout(32, tp=2, pp=2, cp=4, order=order, local_world_size=8, hierarchical_cp=(2, 2))
    a2a, ring = layout.cp_hierarchical_groups()
    for groups, size in ((a2a, 2), (ring, 2)):
        assert sorted(r for g in groups for r in g) == list(range(32)) and {len(g) for g in groups} == {size}
    for rank in range(32):
        cp_index = layout.coords(rank)["cp"]
        cp_group = layout.group_of(rank, "cp")
        mine, my_ring = (next(g for g in gs if rank in g) for gs in (a2a, ring))
        assert set(mine) <= set(cp_group) and set(my_ring) <= set(cp_group)
        assert mine.index(rank) == cp_index % 2 and my_ring.index(rank) == cp_index // 2
        assert len(layout.nodes_of(mine)) == 1  # consecutive CP ranks next to TP: inside a node
    text = layout.describe(limit=None)
    assert "cp all-to-all (a2a+p2p) groups: 16 of 2 ranks" in text and "cp ring (a2a+p2p) groups: 16 of 2 ranks" in text


def test_process_groups_hold_the_sub_groups_only_when_given():
    pg = ProcessGroups.unconnected(RankLayout(8, tp=2, cp=4, hierarchical_cp=(2, 2)), 5)  # tp 1, cp index 2
    assert pg.ranks[Group.CP] == [1, 3, 5, 7]
    assert pg.ranks[Group.CP_A2A] == [5, 7] and pg.ranks[Group.CP_RING] == [1, 5]
    assert (pg.cp_a2a_size, pg.cp_a2a_rank, pg.cp_ring_size, pg.cp_ring_rank) == (2, 0, 2, 1)
    assert len({pg.comms[k] for k in (Group.CP, Group.CP_A2A, Group.CP_RING)}) == 3
    whole_a2a = ProcessGroups.unconnected(RankLayout(4, cp=4, hierarchical_cp=(4,)), 1)  # the a2a group is CP
    assert whole_a2a.comms[Group.CP_A2A] == whole_a2a.comms[Group.CP] and whole_a2a.cp_ring_size == 1
    whole_ring = ProcessGroups.unconnected(RankLayout(4, cp=4, hierarchical_cp=(1, 4)), 1)
    assert whole_ring.comms[Group.CP_RING] == whole_ring.comms[Group.CP] and whole_ring.cp_a2a_size == 1
    plain = ProcessGroups.unconnected(RankLayout(4, cp=4), 1)
    assert Group.CP_A2A not in plain.ranks and Group.CP_RING not in plain.ranks
    with pytest.raises(RuntimeError, match="without hierarchical context-parallel sizes"):
        plain.cp_ring_size  # noqa: B018


def test_ring_batches_replay_cleanly_on_the_ring_group():
    layout = RankLayout(8, tp=2, cp=4, hierarchical_cp=(2, 2))
    logs = []
    for rank in range(8):
        pg = ProcessGroups.unconnected(layout, rank, record=True)
        r, n = pg.cp_ring_rank, pg.cp_ring_size
        ops = [P2POp("send", torch.zeros(3), (r + 1) % n, "kv"), P2POp("recv", torch.zeros(3), (r - 1) % n, "kv")]
        pg.post_p2p(ops, kind=Group.CP_RING).wait()
        pg.end_step()
        assert pg.p2p_log[0].comm == pg.comms[Group.CP_RING]
        logs.append(pg.p2p_log)
    replay(logs)


def _a2a_and_ring(rank: int, world: int) -> dict:
    """An all-to-all on the a2a group and one ring batch on the ring group, plain gloo then NCCL semantics."""
    out = {}
    for mode in ("gloo", "nccl_semantics"):
        os.environ[NCCL_SEMANTICS_ENV] = "1" if mode == "nccl_semantics" else "0"
        pg = ProcessGroups.build(RankLayout(world, cp=4, hierarchical_cp=(2, 2)), rank)
        pg.p2p_log = []
        a, i = pg.cp_a2a_size, pg.cp_a2a_rank
        send = torch.tensor([[100.0 * rank + j] for j in range(a)])  # part j goes to a2a member j
        recv = torch.empty_like(send)
        pg.all_to_all(recv, send, Group.CP_A2A, "a2a test")
        r, n = pg.cp_ring_rank, pg.cp_ring_size
        got = torch.zeros(3)
        pg.post_p2p([P2POp("send", torch.full((3,), float(rank)), (r + 1) % n, "kv"),
                     P2POp("recv", got, (r - 1) % n, "kv")], kind=Group.CP_RING).wait()
        pg.end_step("test step")
        out[mode] = dict(a2a=recv.flatten().tolist(), want_a2a=[100.0 * s + i for s in pg.ranks[Group.CP_A2A]],
                         ring=got.tolist(), want_ring=[float(pg.ranks[Group.CP_RING][(r - 1) % n])] * 3,
                         bytes=dict(pg.comm_bytes), log=pg.p2p_log)
    return out


def test_a2a_and_ring_groups_communicate_on_real_ranks():
    results = run_ranks(_a2a_and_ring, 4, timeout=180)
    for mode in ("gloo", "nccl_semantics"):
        for rank, res in enumerate(results):
            got = res[mode]
            assert got["a2a"] == got["want_a2a"] and got["ring"] == got["want_ring"], (mode, rank, got)
            assert got["bytes"] == {("cp_a2a", "a2a test"): 8, ("cp_ring", "send"): 12}, got["bytes"]
        replay([res[mode]["log"] for res in results])
