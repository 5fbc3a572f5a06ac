"""The planner's time model on held-out published runs (docs/planning.md, "Held-out validation"): rows no
constant was taken from, with the bounds committed before any prediction was computed. Round 1's rows were
seen at its first run (and a model change followed), so they are planned and reported, not bound; round 2's
rows are held to the same bounds, the misses of its first and only run recorded as strict expected failures
(a change that makes one pass turns its test red until the record is updated); the bounds are not changed.
Also: --search keeps its memory headroom, the headroom and imbalance flags, the cpu preset.
"""

from __future__ import annotations

import statistics

import pytest

from megalite.planning.cli import plan_config
from megalite.planning.heldout import HELD_OUT, HELD_OUT_V2, REPORTED, plan_row
from tests.test_planning import _run

ROW_BOUND, MEDIAN_BOUND = 0.25, 0.12  # the protocol's bounds, both rounds (docs/planning.md)
# recorded misses of round 2's first run (docs/planning.md, "Held-out results, round 2")
MISSED = {"DG-L31-8B-8", "DG-L31-8B-128", "DG-L31-70B-64", "DG-L31-70B-2048", "DG-L31-405B-576",
          "DG-L31-405B-2304", "DG-N4-15B-16", "DG-N4-15B-2048", "DG-N4-340B-128", "DG-N4-340B-2048", "TT-L3-8B",
          "TT-L3-70B", "TT-L2-13B", "TT-L2-70B"}


def _error(run) -> float:
    plan, predicted = plan_row(run)
    assert plan.fits, (run.id, plan.memory.total)
    return predicted / run.tflops_per_gpu - 1


@pytest.mark.parametrize("run", [pytest.param(r, id=r.id, marks=pytest.mark.xfail(
    strict=True, reason="missed the protocol's bound (docs/planning.md)")) if r.id in MISSED else
    pytest.param(r, id=r.id) for r in HELD_OUT_V2])
def test_held_out_row_within_bound(run):
    assert abs(_error(run)) <= ROW_BOUND


@pytest.mark.xfail(strict=True, reason="round 2's median |error| 25.8% > 12%: missed the protocol's bound")
def test_held_out_median_error_within_bound():
    assert statistics.median(abs(plan_row(r)[1] / r.tflops_per_gpu - 1) for r in HELD_OUT_V2) <= MEDIAN_BOUND


@pytest.mark.parametrize("run", HELD_OUT, ids=[r.id for r in HELD_OUT])
def test_round_one_rows_still_plan_and_fit(run):
    """Seen rows: planned, fitting, predicted within a factor of 2 (a sanity check, not evidence)."""
    assert 0.5 < _error(run) + 1 < 2.0


def test_held_out_rows_are_enough_and_reported_rows_plan():
    assert len([r for r in HELD_OUT_V2 if r.bound]) >= 8
    for run in REPORTED:
        plan, predicted = plan_row(run)
        assert predicted > 0 and plan.shape.is_moe


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
