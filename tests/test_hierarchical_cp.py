"""Promises (docs/parallelism.md, "Context parallelism in training" and "Hierarchical context parallelism"):

- the a2a+p2p sub-groups of every CP group are pure arithmetic: each CP rank in exactly one all-to-all group
  (a consecutive CP ranks) and one ring (the c/a CP ranks with its index in their all-to-all group), a x c/a
  = c, Megatron-LM's levels for two sizes;
- ProcessGroups builds them (only when the sizes are given; a sub-group that is all of CP shares CP's
  communicator) and they carry an all-to-all and a ring batch on real ranks, plain and under
  MEGALITE_NCCL_SEMANTICS=1, and replay cleanly under the NCCL checker;
- --cp-comm-type takes one value or one per layer, both spellings of allgather, from flags and files; each
  layer's Attention gets its own, and a CP4 run whose layers use p2p and a2a (hierarchical groups built,
  unused) follows the single-process curve;
- validation counts the heads as the model holds them (GQA with fewer groups than TP ranks included), at
  the entry point too;
- the planner prices each layer's comm type, a2a+p2p over its two groups' links.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from megalite.config import ConfigError, parse_args, validate
from megalite.config.arguments import MegaliteConfig
from megalite.model.gpt import GPTModel
from megalite.parallel.groups import NCCL_SEMANTICS_ENV, Group, P2POp, ProcessGroups
from megalite.parallel.layout import RankLayout, split_cp_group
from megalite.parallel.nccl_check import replay
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.harness import run_ranks
from tests.layouts import assert_matches_serial, layout_curves, serial_curve
from tests.tp_utils import GPT2, layout_flat

BASE = ["--mock-data", "--vocab-size", "64", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "8",
        "--seq-length", "32"]


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


# ---- the flags -------------------------------------------------------------------------------------------
def test_comm_type_spellings_and_per_layer_lists(tmp_path):
    assert parse_args(BASE + ["--cp-comm-type", "all_gather"]).parallel.cp_comm_type == ["allgather"]
    cli = parse_args(BASE + ["--cp-comm-type", "p2p", "all_gather", "a2a", "a2a+p2p"]).parallel
    assert cli.layer_cp_comm_types(4) == ("p2p", "allgather", "a2a", "a2a+p2p")
    assert parse_args(BASE).parallel.layer_cp_comm_types(4) == ("p2p",) * 4
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("cp_comm_type: all_gather\nhierarchical_context_parallel_sizes: [2, 2]\n")
    p = parse_args(BASE + ["--config", str(yaml_path)]).parallel
    assert p.cp_comm_type == ["allgather"] and p.hierarchical_context_parallel_sizes == [2, 2]
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps({"parallel": {"cp_comm_type": ["a2a", "all_gather", "p2p", "allgather"]}}))
    assert parse_args(BASE + ["--config", str(json_path)]).parallel.cp_comm_type == ["a2a", "allgather", "p2p",
                                                                                      "allgather"]
    assert MegaliteConfig.from_flat({"cp_comm_type": "a2a"}).parallel.cp_comm_type == ["a2a"]  # as callers write it


@pytest.mark.parametrize("text, expected", [
    ("cp_comm_type: ring\n", "'cp_comm_type' must be one of p2p, a2a, allgather, a2a+p2p, all_gather, got 'ring'"),
    ("cp_comm_type: [p2p, ring]\n", "got 'ring'"),
    ("cp_comm_type: 3\n", "'cp_comm_type' expects a string or a list of strings, got int 3"),
    ("hierarchical_context_parallel_sizes: 2\n", "'hierarchical_context_parallel_sizes' expects a list of integers"),
])
def test_bad_comm_type_in_a_file_is_named(tmp_path, capsys, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--config", str(path)])
    assert expected in capsys.readouterr().err


def _errors(extra: list[str], world: int) -> str:
    with pytest.raises(ConfigError) as err:
        validate(parse_args(BASE + extra), world)
    return str(err.value)


def test_rules_apply_to_each_comm_type_present():
    gqa1 = ["--group-query-attention", "--num-query-groups", "1"]
    # TP2 x CP2: one query group replicated on both TP ranks does not split 2 ways, whichever layer asks
    text = _errors(["--tensor-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "p2p",
                    "a2a", "p2p", "p2p", *gqa1], 4)
    assert "--cp-comm-type a2a: --num-query-groups per tensor-parallel rank (1 over 2 ranks: 1 each, replicated)" \
        in text
    assert "--num-attention-heads" not in text, text  # 8 / 2 = 4 heads split 2 ways
    # a2a+p2p is held to its all-to-all size only: 2 groups split 2 ways, not 4
    ok = parse_args(BASE + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-"
                            "parallel-sizes", "2", "2", "--group-query-attention", "--num-query-groups", "2"])
    validate(ok, 4)
    text = _errors(["--context-parallel-size", "4", "--cp-comm-type", "a2a", "a2a+p2p", "a2a", "a2a+p2p",
                    "--hierarchical-context-parallel-sizes", "2", "2", "--group-query-attention",
                    "--num-query-groups", "2"], 4)
    assert "--cp-comm-type a2a: --num-query-groups per tensor-parallel rank (2 / 1 = 2)" in text
    assert "--cp-comm-type a2a+p2p:" not in text, text
    # hierarchical sizes without a2a+p2p are accepted (Megatron-LM builds the groups, unused), but must multiply
    validate(parse_args(BASE + ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "2", "2"]), 4)
    assert "(4 x 2 = 8) must multiply to --context-parallel-size (4)" in _errors(
        ["--context-parallel-size", "4", "--hierarchical-context-parallel-sizes", "4", "2"], 4)


def test_attention_gets_its_layers_comm_type_and_the_models_head_counts():
    cfg = MegaliteConfig.from_flat({**GPT2, "num_layers": 3, "num_attention_heads": 8, "group_query_attention": True,
                                    "num_query_groups": 1}).model
    pg = ProcessGroups.unconnected(RankLayout(4, tp=2, cp=2, hierarchical_cp=(2,)), 0)
    ctx = BuildContext(pg, RNGTracker(), device=torch.device("meta"), cp_comm_types=("p2p", "a2a", "allgather"))
    model = GPTModel(cfg, ctx, 64)
    assert [model.layers[str(i)].attention.cp_comm_type for i in range(3)] == ["p2p", "a2a", "allgather"]
    attn = model.layers["1"].attention
    assert (attn.heads_local, attn.groups_local) == cfg.heads_per_tp_rank(2) == (4, 1)  # the replicated group
    assert ctx.hierarchical_cp == (2,)
    one = BuildContext(pg, RNGTracker(), device=torch.device("meta"), cp_comm_types=("a2a",))
    assert GPTModel(cfg, one, 64).layers["2"].attention.cp_comm_type == "a2a"


# ---- a run whose layers use different comm types ----------------------------------------------------------
MIXED = layout_flat({**GPT2, "seq_length": 32}, vocab=256, iters=3, context_parallel_size=4,
                    cp_comm_type=["p2p", "a2a"], hierarchical_context_parallel_sizes=[2, 2])


def _cp_bytes(result, pg: ProcessGroups) -> dict:
    return {op: n for (kind, op), n in pg.comm_bytes.items() if kind == "cp"}


def test_layers_with_different_comm_types_follow_the_serial_curve():
    per_rank = layout_curves(4, {"mixed": MIXED}, {"mixed": "nccl_semantics"}, extract={"mixed": _cp_bytes})
    serial = {k: v for k, v in MIXED.items() if k not in ("context_parallel_size", "cp_comm_type",
                                                          "hierarchical_context_parallel_sizes")}
    assert_matches_serial(per_rank, "mixed", serial_curve(serial), 3)
    for curves in per_rank:  # layer 0 passed K/V around the ring, layer 1 all-to-alled
        assert curves["mixed"].extra.get("send", 0) > 0 and curves["mixed"].extra.get("all_to_all qkv", 0) > 0


# ---- the planner -----------------------------------------------------------------------------------------
def _shape(**flat):
    from megalite.planning.shape import RunShape

    cfg = MegaliteConfig.from_flat({**GPT2, "num_layers": 4, "seq_length": 64, "bf16": True, "micro_batch_size": 2,
                                    "global_batch_size": 8, "tensor_model_parallel_size": 2, "context_parallel_size": 4,
                                    **flat})
    return RunShape.of(cfg, 8, 256)


def test_planner_prices_each_layers_comm_type():
    from megalite.planning.hardware import ClusterConfig
    from megalite.planning.timing import cp_comm_s, cp_layer_bytes, link

    cl = ClusterConfig(num_nodes=2, gpus_per_node=4)  # CP ranks 2 apart: an a2a pair inside a node, the ring across
    p2p, a2a = cp_comm_s(_shape(cp_comm_type="p2p"), cl), cp_comm_s(_shape(cp_comm_type="a2a"), cl)
    assert cp_comm_s(_shape(cp_comm_type=["p2p", "a2a", "a2a", "p2p"]), cl) == pytest.approx((p2p + a2a) / 2)
    sh = _shape(cp_comm_type="a2a+p2p", hierarchical_context_parallel_sizes=[2, 2])
    (ax1, n1, b1), (ax2, n2, b2) = cp_layer_bytes(sh, "a2a+p2p")
    assert (ax1, n1, ax2, n2) == ("cp_a2a", 2, "cp_ring", 2)
    assert b1 == pytest.approx(cp_layer_bytes(sh, "a2a")[0][2] * (1 / 2) / (3 / 4))  # (a - 1)/a of the buffer
    assert b2 == pytest.approx(cp_layer_bytes(sh, "p2p")[0][2] / 3)  # one ring step of 2, not 3 of 4
    assert link(sh, cl, "cp_a2a", 2) > link(sh, cl, "cp_ring", 2)  # NVLink vs the network
    per_layer = b1 / link(sh, cl, "cp_a2a", 2) + b2 / link(sh, cl, "cp_ring", 2)
    assert cp_comm_s(sh, cl) == pytest.approx(4 * sh.m * per_layer)


def test_plan_tool_accepts_the_new_flags(capsys):
    from megalite.planning.cli import plan_main

    flags = [*BASE, "--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "p2p", "all_gather", "a2a",
             "--hierarchical-context-parallel-sizes", "2", "2", "--num-nodes", "1", "--gpus-per-node", "8"]
    assert plan_main(flags) == 0, capsys.readouterr().err
    assert "CP comm" in capsys.readouterr().out
    assert plan_main([*flags, "--search", "--top", "2"]) == 0, capsys.readouterr().err
