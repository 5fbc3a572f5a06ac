"""Promises of the topology-aware layout:
- TP groups stay inside a node whenever TP divides the ranks per node, in both rank orders; the groups
  equal Megatron's for "tp-cp-dp-pp" and its --use-tp-pp-dp-mapping order "tp-cp-pp-dp";
- a layout whose TP group would span nodes is reported (layout warning, show_layout.py, start-up);
- a launcher that did not fill nodes with consecutive ranks is detected at start-up;
- --hierarchical-dp-reduce (reduce-scatter in the node, all-reduce across nodes, all-gather in the node)
  gives the flat reduction's and the single-process loss curve within 1e-5 on 4 ranks as 2 nodes x 2,
  with and without the distributed optimizer, and only 1/k of the buffer crosses nodes;
- the expert groups (EP, expert-TP, both, expert-DP) are the per-rank expert coordinates' groups, built at a
  cost linear in the world size."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megalite.config import ConfigError, parse_args, validate
from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.report import announce_layout, placement_warnings
from megalite.training.loop import TrainResult
from tests.asserts import assert_rel_close
from tests.harness import run_ranks
from tests.layouts import layout_curves, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---- pure layout ---------------------------------------------------------------------------------
@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "tp-cp-pp-dp"])
@pytest.mark.parametrize("world,per_node,tp,pp", [(16, 8, 8, 1), (16, 8, 4, 2), (32, 8, 2, 4), (8, 4, 4, 1),
                                                 (24, 8, 4, 3), (64, 8, 8, 4)])
def test_tp_groups_stay_inside_a_node(order, world, per_node, tp, pp):
    layout = RankLayout(world, tp, pp, order=order, local_world_size=per_node)
    assert not layout.tp_crosses_nodes() and not layout.warnings()
    for g in layout.groups("tp"):
        assert len({r // per_node for r in g}) == 1


def test_groups_equal_megatron_for_both_orders():
    # Megatron-core's RankGenerator on 8 ranks, tp 2 pp 2 (dp 2).
    default = RankLayout(8, 2, 2)
    assert default.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert default.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert default.groups("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    alt = RankLayout(8, 2, 2, order=parse_args(["--use-tp-pp-dp-mapping"]).parallel.layout_order)
    assert alt.order == "tp-cp-pp-dp"
    assert alt.groups("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert alt.groups("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert alt.groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert alt.embedding_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_layout_from_config_maps_every_field_by_name():
    # Every size different, so a field read into the wrong slot (or dropped) changes the layout.
    p = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "3",
                    "--context-parallel-size", "4", "--expert-model-parallel-size", "8",
                    "--expert-tensor-parallel-size", "1", "--use-tp-pp-dp-mapping",
                    "--hierarchical-context-parallel-sizes", "2", "2"]).parallel
    layout = RankLayout.from_config(p, 48, 16)
    assert layout == RankLayout(48, tp=2, pp=3, cp=4, order="tp-cp-pp-dp", local_world_size=16, ep=8, etp=1,
                                hierarchical_cp=(2, 2))
    assert (layout.dp, layout.cp_a2a) == (2, 2)
    assert RankLayout.from_config(parse_args([]).parallel, 4) == RankLayout(4)


@pytest.mark.parametrize("kw", [dict(tp=2, pp=2, ep=2), dict(tp=2, pp=2, ep=2, etp=1), dict(pp=4, cp=2, ep=4),
                                dict(tp=4, ep=2, etp=2), dict(pp=2, ep=1, etp=2)])
@pytest.mark.parametrize("axes", ["ep", "etp", "etp-ep", "edp"])
def test_expert_groups_match_each_ranks_expert_coords(kw, axes):
    """Each expert group holds the ranks of one stage whose expert coordinates differ only along ``axes``."""
    layout = RankLayout(32, **kw)
    fixed = [a for a in ("etp", "ep", "edp") if a not in axes.split("-")]
    want: dict[tuple, list[int]] = {}
    for r in range(32):
        c = layout.expert_coords(r)
        want.setdefault((layout.coords(r)["pp"], *(c[a] for a in fixed)), []).append(r)
    assert layout.expert_groups(axes) == sorted(want.values())


def test_expert_groups_cost_linear_in_the_world(monkeypatch):
    """Building the expert groups looks each rank's coordinates up a bounded number of times (it was once
    per rank per rank: minutes of start-up at thousands of ranks)."""
    calls = []
    coords = RankLayout.coords
    monkeypatch.setattr(RankLayout, "coords", lambda self, rank: calls.append(rank) or coords(self, rank))
    layout = RankLayout(1024, tp=2, pp=4, ep=8)
    for axes in ("ep", "etp", "etp-ep", "edp"):
        layout.expert_groups(axes)
    assert len(calls) <= 4 * 1024 * layout.pp, len(calls)


def test_tp_pp_dp_mapping_keeps_pipeline_inside_node_and_dp_across():
    layout = RankLayout(16, 2, 4, order="tp-cp-pp-dp", local_world_size=8)
    assert all(len(layout.nodes_of(g)) == 1 for g in layout.groups("pp"))
    assert all(layout.nodes_of(g) == [0, 1] for g in layout.groups("dp"))
    default = RankLayout(16, 2, 4, local_world_size=8)
    assert all(len(default.nodes_of(g)) == 2 for g in default.groups("pp"))


@pytest.mark.parametrize("world,per_node,tp", [(8, 4, 8), (12, 6, 4), (16, 8, 16)])
def test_tp_across_nodes_is_warned(world, per_node, tp):
    layout = RankLayout(world, tp, local_world_size=per_node)
    assert layout.tp_crosses_nodes()
    (warning,) = layout.warnings()
    assert "spans nodes" in warning and "--tensor-model-parallel-size" in warning
    text = layout.describe()
    assert "<- crosses nodes" in text and "WARNING: tensor-parallel group" in text


def test_describe_names_every_group_and_node():
    text = RankLayout(8, 4, local_world_size=4).describe()
    assert "2 node(s) x 4 ranks" in text
    assert "node 0: r0[t0 d0 p0] r1[t1 d0 p0] r2[t2 d0 p0] r3[t3 d0 p0]" in text
    assert "ranks [0, 1, 2, 3] on node 0" in text and "ranks [4, 5, 6, 7] on node 1" in text
    assert "ranks [0, 4] on nodes [0, 1]" in text and "WARNING" not in text


def test_dp_node_groups_split_and_uneven_split_rejected():
    intra, inter = RankLayout(8, local_world_size=4).dp_node_groups()
    assert intra == [[0, 1, 2, 3], [4, 5, 6, 7]] and inter == [[0, 4], [1, 5], [2, 6], [3, 7]]
    intra, inter = RankLayout(16, 2, order="tp-cp-dp-pp", local_world_size=4).dp_node_groups()
    assert intra[:2] == [[0, 2], [1, 3]] and inter[:2] == [[0, 4, 8, 12], [1, 5, 9, 13]]
    with pytest.raises(ValueError, match="same number of its ranks on every node"):
        RankLayout(6, 2, local_world_size=3).dp_node_groups()


def test_hierarchical_flag_validated_against_ranks_per_node():
    base = ["--mock-data", "--vocab-size", "1000", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--tensor-model-parallel-size", "2"]
    validate(parse_args(base + ["--hierarchical-dp-reduce"]), 8, local_world_size=4)
    with pytest.raises(ConfigError, match="--hierarchical-dp-reduce: data-parallel group"):
        validate(parse_args(base + ["--hierarchical-dp-reduce"]), 6, local_world_size=3)
    validate(parse_args(base), 6, local_world_size=3)  # the flat reduction has no such rule


def test_slurm_cyclic_placement_is_detected():
    layout = RankLayout(8, 4, local_world_size=4)
    block = [f"node{r // 4}" for r in range(8)]
    cyclic = [f"node{r % 2}" for r in range(8)]
    assert placement_warnings(layout, block) == []
    (w,) = placement_warnings(layout, cyclic)[:1]
    assert "--distribution=block" in w and "layout node 0" in w


def test_show_layout_tool(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import show_layout

    args = ["--nnodes", "2", "--nproc-per-node", "4", "--tensor-model-parallel-size", "4"]
    assert show_layout.main(args + ["--use-tp-pp-dp-mapping", "--hierarchical-dp-reduce"]) == 0
    out = capsys.readouterr().out
    assert "order tp-cp-pp-dp" in out and "ranks [0, 1, 2, 3] on node 0" in out
    assert "dp inter-node groups" in out and "WARNING" not in out
    assert show_layout.main(["--nnodes", "2", "--nproc-per-node", "4", "--tensor-model-parallel-size", "8",
                             "--strict"]) == 1
    assert "spans nodes [0, 1]" in capsys.readouterr().out
    assert show_layout.main(["--world-size", "6", "--tensor-model-parallel-size", "4"]) == 2
    assert "not divisible" in capsys.readouterr().err
    script = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "show_layout.py"), *args],
                            capture_output=True, text=True, timeout=60, cwd="/")  # runs from any folder
    assert script.returncode == 0 and "tp groups: 2 of 4 ranks" in script.stdout


# ---- on real ranks: start-up report and the hierarchical reduction --------------------------------
VOCAB = 500
ITERS = 5
MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "untie_embeddings_and_output_weights": False}
# name -> (tp, pp, order, hierarchical, extra flags); 4 ranks as 2 nodes x 2
LAYOUTS = {
    "dp4_flat": (1, 1, "tp-cp-dp-pp", False, {}),
    "dp4_hier": (1, 1, "tp-cp-dp-pp", True, {}),
    "dp4_hier_overlap_small_buckets": (1, 1, "tp-cp-dp-pp", True, {"overlap_grad_reduce": True,
                                                                     "ddp_bucket_size": 2000}),
    "dp4_hier_distopt_overlap": (1, 1, "tp-cp-dp-pp", True, {"use_distributed_optimizer": True,
                                                               "overlap_grad_reduce": True, "ddp_bucket_size": 3000}),
    "tp2_dp2_hier_distopt": (2, 1, "tp-cp-dp-pp", True, {"use_distributed_optimizer": True}),  # 1 per node
    "pp2_dp2_hier": (1, 2, "tp-cp-dp-pp", True, {}),  # DP inside a node: nothing crosses
    "pp2_dp2_tp_pp_dp_mapping": (1, 2, "tp-cp-pp-dp", False, {}),
}


def flat(tp: int = 1, pp: int = 1, **extra) -> dict:
    return layout_flat(MODEL, vocab=VOCAB, iters=ITERS, tp=tp, pp=pp, **extra)


def _grad_bytes(res: TrainResult, pg: ProcessGroups) -> tuple[dict, int]:
    """(bytes of each gradient collective, the gradient buffer's bytes over the run)."""
    buffer_bytes = sum(b.grad_data.numel() * 4 for b in res.optimizer.buffers) * ITERS
    return {k: v for k, v in pg.comm_bytes.items() if k[1].startswith("grad")}, buffer_bytes


@pytest.fixture(scope="module")
def curves() -> list[dict]:
    runs = {name: flat(tp, pp, hierarchical_dp_reduce=hier, use_tp_pp_dp_mapping=order == "tp-cp-pp-dp", **extra)
            for name, (tp, pp, order, hier, extra) in LAYOUTS.items()}
    return layout_curves(4, runs, extract={"dp4_hier": _grad_bytes}, local_world=2)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_hierarchical_dp_and_tp_pp_dp_mapping_match_serial(curves, layout):
    serial = serial_curve(flat()).losses
    for rank, c in enumerate(curves):
        for ref, want in (("serial", serial), ("dp4_flat", c["dp4_flat"].losses)):
            assert len(c[layout].losses) == ITERS
            assert_rel_close(c[layout].losses, want, 1e-5, f"rank {rank} {layout} vs {ref}")


def test_hierarchical_sends_one_kth_across_nodes(curves):
    for c in curves:
        moved, buffer_bytes = c["dp4_hier"].extra
        assert moved == {("dp_intra", "grad_reduce_scatter"): buffer_bytes,
                         ("dp_inter", "grad_all_reduce"): buffer_bytes // 2,  # k = 2 DP ranks per node
                         ("dp_intra", "grad_all_gather"): buffer_bytes}


def _report(rank: int, world: int) -> dict:
    """Start-up report: rank 0 prints the table; a TP group over both "nodes" and a cyclic placement warn."""
    printed: list[str] = []
    pg = ProcessGroups.build(RankLayout(world, 4, local_world_size=2), rank)
    os.environ["GROUP_RANK"] = str(rank % 2)  # as if the launcher dealt ranks round-robin over 2 nodes
    return {"warnings": announce_layout(pg, print_layout=True, say=printed.append), "printed": printed}


def test_startup_report_prints_layout_and_warns():
    curves = run_ranks(_report, 4)
    text = "\n".join(curves[0]["printed"])
    assert "tp groups: 1 of 4 ranks" in text and "ranks [0, 1, 2, 3] on nodes [0, 1]   <- crosses nodes" in text
    assert "WARNING: tensor-parallel group [0, 1, 2, 3] spans nodes [0, 1]" in text
    assert "run on 2 different nodes" in text  # the round-robin placement
    assert all(not c["printed"] for c in curves[1:]), "only rank 0 prints"
    assert all(len(c["warnings"]) == 3 for c in curves)
