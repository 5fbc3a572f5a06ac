"""The planner's time model on published runs (docs/planning.md, "Held-out validation"). Rounds 1 to 4's
rows were seen at their first and only runs (all four missed their bounds, as recorded there) and now
calibrate the one throughput-fitted constant, each GPU's sustained share (tests/planning_rows/calibration.py); round
5's rows are held out and held to its bounds, which its first run met. Also:
--search keeps its memory headroom, the headroom and imbalance flags, NCCL's latency, the cpu preset.
"""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from megalite.planning.cli import plan_config
from megalite.planning.hardware import BORROWED, GPUS, SUSTAINED
from tests.planning_rows.calibration import calibrated_share, calibration_rows, row_error
from tests.planning_rows.heldout import HELD_OUT, HELD_OUT_V2, HELD_OUT_V3, HELD_OUT_V4, REPORTED, plan_row
from tests.planning_rows.heldout_v5 import HELD_OUT_V5
from tests.test_planning import _run

ROW_BOUND = 0.25  # rounds 1 and 2 held each row to it (docs/planning.md), both missed


def _error(run) -> float:
    plan, predicted = plan_row(run)
    assert plan.fits, (run.id, plan.memory.total)
    return predicted / run.tflops_per_gpu - 1


SEEN = HELD_OUT + HELD_OUT_V2 + HELD_OUT_V3 + HELD_OUT_V4


@pytest.mark.parametrize("run", SEEN, ids=[r.id for r in SEEN])
def test_seen_rows_still_plan(run):
    """Rounds 1 to 4's rows, seen since their first runs and now calibration rows: planned, predicted
    within a factor of 4 (a sanity check, not evidence)."""
    plan, predicted = plan_row(run)
    assert 0.25 < predicted / run.tflops_per_gpu < 4.0 and plan.memory.total > 0


@pytest.mark.parametrize("gpu", sorted(SUSTAINED))
def test_sustained_shares_are_the_calibrated_ones(gpu):
    """The presets' one throughput-fitted constant is what tests/planning_rows/calibration.py computes from the named
    seen rows (a changed model or row moves it and fails this until the preset follows)."""
    assert calibrated_share(gpu) == pytest.approx(SUSTAINED[gpu], abs=0.005)
    assert all(GPUS[g].sustained_share == SUSTAINED[BORROWED[g]] for g in BORROWED)


@pytest.mark.parametrize("gpu,median,within", [("a100-80g", 0.08, 0.85), ("h100-sxm", 0.12, 0.75)])
def test_calibration_rows_after_calibration(gpu, median, within):
    """In sample, not evidence: the calibrated model's median |error| on its own rows and its rows within 25%
    (docs/planning.md: A100 6.4% and 31 of 33, H100 10.3% and 43 of 52; the bounds leave margin)."""
    errors = [abs(row_error(r)) for r in calibration_rows(gpu)]
    assert statistics.median(errors) <= median
    assert sum(e <= ROW_BOUND for e in errors) >= within * len(errors)


def _round5() -> list[tuple[str, float, float]]:
    """(id, |error|, memory over the device) of each round-5 row at the presets' shares."""
    out = []
    for run in HELD_OUT_V5:
        plan, predicted = plan_row(run)
        out.append((run.id, abs(predicted / run.tflops_per_gpu - 1), plan.memory.total / plan.cluster.memory_bytes()))
    return out


def test_round5_held_out_rows_hold_the_stated_bounds():
    """Round 5 (docs/planning.md): 26 rows of sources no constant was taken from, bounds committed before
    their first run: at least 3 in 4 within 25% of the published step, the median |error| at most 15%, at
    least 3 in 4 estimated to fit and none above 1.5 times the device. First run: 24 of 26, 7.0%, 22 of 26,
    at most 1.38 times; after the fixes found by a second read: 24 of 26, 7.1%, 24 of 26."""
    rows = _round5()
    errors, memory = [e for _, e, _ in rows], [m for _, _, m in rows]
    assert len(rows) == 26
    assert sum(e <= ROW_BOUND for e in errors) >= 0.75 * len(rows), rows
    assert statistics.median(errors) <= 0.15
    assert sum(m <= 1.0 for m in memory) >= 0.75 * len(rows) and max(memory) <= 1.5, rows


def test_round5_rows_are_no_calibration_rows():
    """Held out means never used for a constant: no round-5 row is among the rows the shares are fitted on."""
    calibration = {r.id for r in calibration_rows()}
    assert not calibration & {r.id for r in HELD_OUT_V5}


def test_held_out_rows_are_enough_and_reported_rows_plan():
    for run in REPORTED:
        plan, predicted = plan_row(run)
        assert predicted > 0 and plan.shape.model_shape.moe_layers


LLAMA70 = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64", "--group-query-attention",
           "--num-query-groups", "8", "--ffn-hidden-size", "28672", "--swiglu", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
           "--seq-length", "8192", "--max-position-embeddings", "8192", "--vocab-size", "128255", "--bf16",
           "--micro-batch-size", "1", "--global-batch-size", "128", "--num-nodes", "8", "--gpus-per-node", "8",
           "--gpu", "h100-sxm"]
GPT3_1024 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536", "--bf16",
             "--num-nodes", "128", "--gpus-per-node", "8", "--gpu", "a100-80g"]


def _ranked_gb(stdout: str) -> list[float]:
    return [float(line.split("TFLOP/s/GPU")[1].split("GB")[0]) for line in stdout.splitlines()
            if "ms/step" in line]


@pytest.mark.parametrize("argv", [LLAMA70, GPT3_1024], ids=["llama3-70b-64xh100", "gpt3-175b-1024xa100"])
def test_search_ranks_no_layout_past_the_headroom(argv):
    proc = _run("tools/plan.py", [*argv, "--search", "--top", "50"])
    assert proc.returncode == 0, proc.stderr
    ranked = _ranked_gb(proc.stdout)
    assert ranked and max(ranked) <= 80 - 4.0, (max(ranked), proc.stdout[:2000])
    assert "within the --memory-headroom-gb headroom" in proc.stdout


def test_report_lists_the_overheads_and_marks_the_headroom():
    plan, _ = plan_config(["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length",
                           "1024", "--max-position-embeddings", "1024", "--bf16", "--micro-batch-size", "1",
                           "--global-batch-size", "8", "--tensor-model-parallel-size", "2"],
                          ["--num-nodes", "1", "--gpus-per-node", "8", "--memory-headroom-gb", "79"])
    for term in ("CUDA context", "NCCL buffers", "allocator fragmentation"):
        assert plan.memory.terms[term] > 0, term
    assert plan.fits and plan.within_headroom


@pytest.mark.parametrize("flag,value,text", [
    ("--memory-headroom-gb", "-1", "--memory-headroom-gb must be"),
    ("--moe-imbalance", "0.5", "--moe-imbalance must be"),
    ("--gemm-tflops", "0", "--gemm-tflops must be")])
def test_bad_planner_flags_name_the_flag(flag, value, text):
    proc = _run("tools/plan.py", [*GPT3_1024[:-6], "--num-nodes", "1", "--gpus-per-node", "8", flag, value])
    assert proc.returncode == 2 and text in proc.stderr, proc.stderr


def test_moe_imbalance_slows_the_experts_and_is_shown():
    from megalite.planning.estimate import format_report

    moe = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
           "--max-position-embeddings", "1024", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
           "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "8",
           "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
    balanced, _ = plan_config(moe, ["--num-nodes", "1", "--gpus-per-node", "8"])
    skewed, _ = plan_config(moe, ["--num-nodes", "1", "--gpus-per-node", "8", "--moe-imbalance", "1.5"])
    assert skewed.time.terms["compute"] > balanced.time.terms["compute"]
    assert skewed.time.terms["MoE dispatch (EP)"] == pytest.approx(1.5 * balanced.time.terms["MoE dispatch (EP)"])
    assert "MoE routing imbalance (max/mean, assumed) 1.50" in format_report(skewed)


def test_cpu_preset_has_no_context_nor_nccl():
    plan, _ = plan_config(["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4", "--seq-length",
                           "64", "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size",
                           "2"], ["--num-nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu"])
    assert plan.memory.terms["CUDA context"] == 0 and plan.memory.terms["NCCL buffers"] == 0
    assert plan.time.step_s > 0


def test_ring_latency_follows_nccls_cost_model():
    """A ring collective's latency (NCCL's tuning model: 8.4 us, 3.4 us per step inside a node, 9.6 across):
    512 ranks on 64 nodes take 448 intra-node and 63 inter-node steps; ZeRO-3's per-layer collectives pay it
    per layer, so its DP term grows with it; the cpu preset (gloo) models none."""
    from megalite.planning.timing import dp_comm_s, ring_latency_s

    flags = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "512",
             "--data-parallel-sharding-strategy", "optim_grads_params", "--overlap-grad-reduce"]
    plan, _ = plan_config(flags, ["--num-nodes", "64", "--gpus-per-node", "8"])
    sh, cl = plan.shape, plan.cluster
    assert ring_latency_s(sh, cl, "dp", 512) == pytest.approx((8.4 + 448 * 3.4 + 63 * 9.6) * 1e-6)
    steps = 448 * 3.4 + 63 * 9.6
    assert ring_latency_s(sh, cl, "dp", 512, all_reduce=True) == pytest.approx((8.4 + 2 * steps) * 1e-6)
    import megalite.planning.hardware as hw

    no_latency = dataclasses.replace(cl.spec(), ring_latency_us=None)
    saved = hw.GPUS[cl.gpu]
    hw.GPUS[cl.gpu] = no_latency
    try:
        without = dp_comm_s(sh, cl)
    finally:
        hw.GPUS[cl.gpu] = saved
    assert dp_comm_s(sh, cl) > without
    cpu, _ = plan_config(flags[:-3], ["--num-nodes", "1", "--gpus-per-node", "2", "--gpu", "cpu"])
    assert ring_latency_s(cpu.shape, cpu.cluster, "dp", 2) == 0.0


def test_te_layers_keep_fewer_moe_activations():
    """--model-te-layers: Megatron-Core's fused permutation and SwiGLU keep less per routed row than
    megalite's eager MoE layer (docs/planning.md, Mixture of experts)."""
    flags = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--num-experts", "8", "--moe-router-topk", "2", "--expert-model-parallel-size", "8", "--swiglu",
             "--moe-token-dispatcher-type", "alltoall", "--disable-bias-linear"]
    eager, _ = plan_config(flags, ["--num-nodes", "1", "--gpus-per-node", "8"])
    te, _ = plan_config(flags, ["--num-nodes", "1", "--gpus-per-node", "8", "--model-te-layers"])
    assert 0 < te.memory.terms["MoE activations"] < eager.memory.terms["MoE activations"]


def test_ring_over_nodes_uses_each_ranks_nic():
    """NCCL's rings enter and leave a node once each, one ring per NIC: a group with k ranks on each node moves
    a rank's bytes at k NICs' bandwidth, capped by NVLink; one rank per node (TP8 below it) has one NIC."""
    from megalite.planning.timing import ring_bytes_per_s, ring_link

    flags = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "1024",
             "--max-position-embeddings", "1024", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "64"]
    plan, _ = plan_config(flags, ["--num-nodes", "4", "--gpus-per-node", "8", "--gpu", "a100-80g"])
    cl = plan.cluster
    nic, nvlink = cl.link_bytes_per_s(True), cl.link_bytes_per_s(False)
    assert ring_link(plan.shape, cl, "dp", 32) == pytest.approx(min(8 * nic, nvlink))
    assert ring_bytes_per_s(cl, True, 2) == pytest.approx(2 * nic) and ring_bytes_per_s(cl, False, 8) == nvlink
    tp8, _ = plan_config([*flags, "--tensor-model-parallel-size", "8"],
                         ["--num-nodes", "4", "--gpus-per-node", "8", "--gpu", "a100-80g"])
    assert ring_link(tp8.shape, tp8.cluster, "dp", 4) == pytest.approx(nic)


def test_flash_attention_kernel_follows_the_layers():
    """On H100, Transformer Engine's fused attention runs at FlashAttention-3's share, other layers (SDPA's
    flash backend, Triton) at a FlashAttention-2-class kernel's; on A100 both are FlashAttention-2's."""
    from megalite.planning.hardware import FA2_H100, GPUS
    from megalite.planning.kernels import attention_s

    flags = ["--num-layers", "2", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "8192",
             "--max-position-embeddings", "8192", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8"]
    times = {}
    for gpu in ("h100-sxm", "a100-80g"):
        for te in ((), ("--model-te-layers",)):
            plan, _ = plan_config(flags, ["--num-nodes", "1", "--gpus-per-node", "8", "--gpu", gpu, *te])
            times[gpu, bool(te)] = attention_s(plan.shape, plan.cluster)
    assert times["h100-sxm", False] / times["h100-sxm", True] == pytest.approx(GPUS["h100-sxm"].flash_share / FA2_H100)
    assert times["a100-80g", False] == pytest.approx(times["a100-80g", True])


def test_block_recomputation_reruns_only_its_layers():
    """--recompute-method block reruns the forward of its --recompute-num-layers layers only: the compute
    term and the FLOPs with recomputation lie between no recomputation's and uniform full recomputation's, at
    the recomputed share (8 of 24 layers: a third of the extra forward)."""
    base = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8"]
    cluster = ["--num-nodes", "1", "--gpus-per-node", "8"]
    none, _ = plan_config(base, cluster)
    full, _ = plan_config([*base, "--recompute-granularity", "full"], cluster)
    block, _ = plan_config([*base, "--recompute-granularity", "full", "--recompute-method", "block",
                            "--recompute-num-layers", "8"], cluster)
    c = {k: p.time.terms["compute"] for k, p in (("none", none), ("full", full), ("block", block))}
    assert c["none"] < c["block"] < c["full"]
    assert c["block"] - c["none"] == pytest.approx((c["full"] - c["none"]) / 3, rel=0.02)
    assert block.time.hardware_flops - none.time.hardware_flops == pytest.approx(
        (full.time.hardware_flops - none.time.hardware_flops) / 3)


def test_dp_cp_group_counts_its_ranks_per_node_in_either_rank_order():
    """A DP x CP group's ranks on a node: CP2 x DP8 under PP4 on 8-GPU nodes has 8 ranks per node in the
    default order (tp-cp-dp-pp) and 2 under tp-cp-pp-dp (DP then lies tp x cp x pp apart): 4x the NICs,
    so the gradient reduction takes longer in the second order."""
    from megalite.planning.timing import dp_comm_s, dp_cp_ranks_per_node

    flags = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "4096",
             "--max-position-embeddings", "4096", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "64",
             "--context-parallel-size", "2", "--pipeline-model-parallel-size", "4", "--use-distributed-optimizer"]
    cluster = ["--num-nodes", "8", "--gpus-per-node", "8"]
    default, _ = plan_config(flags, cluster)
    pp_inner, _ = plan_config([*flags, "--use-tp-pp-dp-mapping"], cluster)
    assert dp_cp_ranks_per_node(default.shape, default.cluster) == 8
    assert dp_cp_ranks_per_node(pp_inner.shape, pp_inner.cluster) == 2
    assert dp_comm_s(pp_inner.shape, pp_inner.cluster) > dp_comm_s(default.shape, default.cluster)


def test_block_recomputation_rebuilds_one_layer_and_no_recomputation_reruns_the_output_layer():
    """Block recomputation checkpoints each of its layers alone, so backward rebuilds one layer at a time
    (uniform: a group of --recompute-num-layers); the output layer is never recomputed, in time or FLOPs."""
    from megalite.planning.flops import flops_per_token, training_flops
    from megalite.planning.kernels import logits_s
    from megalite.planning.memory import full_layer_bytes, recompute_working_bytes

    base = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "2048",
            "--max-position-embeddings", "2048", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--recompute-granularity", "full", "--recompute-num-layers", "4"]
    cluster = ["--num-nodes", "1", "--gpus-per-node", "8"]
    block, _ = plan_config([*base, "--recompute-method", "block"], cluster)
    uniform, _ = plan_config([*base, "--recompute-method", "uniform"], cluster)
    none, _ = plan_config(base[:-4], cluster)
    layer = full_layer_bytes(block.shape)
    assert recompute_working_bytes(block.shape) == pytest.approx(layer)
    assert recompute_working_bytes(uniform.shape) == pytest.approx(4 * layer)
    assert logits_s(uniform.shape, uniform.cluster) == pytest.approx(logits_s(none.shape, none.cluster))
    m = none.shape.cfg.model
    f, logits = flops_per_token(m, 50304, 2048), 2 * 1024 * 50304
    assert training_flops(m, 50304, 2048, 1, recompute=True) == pytest.approx(4 * f - logits)
