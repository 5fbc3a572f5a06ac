"""The layout planner (megalite/planning, docs/planning.md) against measurement and published runs.

Memory: the activation bytes of a layer (bytes autograd saves, on CPU) and the parameters, gradients and
optimizer state each rank holds after a real training step, for TP, SP, PP, VP, DP, recomputation and
the distributed optimizer, within 5%; the in-flight micro-batches against the schedule tables the
executor runs. Time: the published runs of docs/planning.md fit, are predicted within the stated error,
and their layout ranks among the search's top choices.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from megalite.config.arguments import MegaliteConfig, parse_args
from megalite.config.validate import fill_derived_defaults
from megalite.pipeline.schedule_table import ScheduleSpec, rank_table
from megalite.planning.cli import cluster_from_values, split_argv, vocab_of
from megalite.planning.estimate import estimate
from megalite.planning.layout import layout_rule_errors
from megalite.planning.memory import activation_bytes, chunk_activation_bytes, in_flight_chunks, stage_memory
from megalite.planning.search import rank_of, search
from megalite.planning.shape import RunShape
from tests.cli_utils import ROOT
from tests.harness import run_ranks
from tests.plan_measure import rms_norm_overcount
from tests.planning_rows.published import PUBLISHED, cluster_flags, run_flags

TOLERANCE = 0.05
GPT = dict(seq_length=192, max_position_embeddings=192, hidden_size=320, num_attention_heads=4)
LLAMA = dict(seq_length=192, hidden_size=256, num_attention_heads=4, swiglu=True, normalization="RMSNorm",
             position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
             disable_bias_linear=True)
GEMMA = {**LLAMA, "swiglu": False, "geglu": True, "sublayer_norms": "pre-post", "qk_layernorm": True,
         "apply_layernorm_1p": True, "softmax_scale": 0.1}
# (name, model, tp, sequence parallel, recompute granularity, extra model fields, bf16)
LAYER_ROWS = [
    ("TP1", GPT, 1, False, None, {}, True),
    ("TP1 selective", GPT, 1, False, "selective", {}, True),
    ("TP1 full", GPT, 1, False, "full", {}, True),
    ("TP1 fp32 no dropout", GPT, 1, False, None, dict(hidden_dropout=0.0, attention_dropout=0.0), False),
    ("TP1 Llama (SwiGLU, RMSNorm, RoPE, GQA)", LLAMA, 1, False, None, {}, True),
    ("TP2", GPT, 2, False, None, {}, True),
    ("TP2 SP", GPT, 2, True, None, {}, True),
    ("TP2 SP selective", GPT, 2, True, "selective", {}, True),
    ("TP2 SP full", GPT, 2, True, "full", {}, True),
    ("TP2 SP Llama selective", LLAMA, 2, True, "selective", {}, True),
    ("TP1 Gemma (GeGLU, four norms, q/k norms)", GEMMA, 1, False, None, {}, True),
    ("TP2 SP Gemma", GEMMA, 2, True, None, {}, True),
]
MICRO_BATCH, VOCAB = 3, 1000


def planner_cfg(model: dict, world: int, **flat) -> MegaliteConfig:
    cfg = MegaliteConfig.from_flat({**model, "mock_data": True, "vocab_size": VOCAB, **flat})
    errors = layout_rule_errors(cfg, world, world)
    assert not errors, errors
    fill_derived_defaults(cfg, world)
    return cfg


def _layer_worker(rank: int, world: int) -> dict:
    import torch

    from megalite.config.model import ModelConfig
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from tests.plan_measure import layer_activation_bytes

    out = {}
    for name, model, tp, sp, gran, extra, bf16 in LAYER_ROWS:
        if tp == 1 and rank > 0:
            continue
        cfg = ModelConfig(num_layers=1, attention_backend="unfused", recompute_granularity=gran, **model, **extra)
        pg = ProcessGroups.single() if tp == 1 else ProcessGroups.build(RankLayout(world, tp), rank)
        dtype = torch.bfloat16 if bf16 else torch.float32
        out[name] = layer_activation_bytes(cfg, pg, MICRO_BATCH, VOCAB, sequence_parallel=sp, dtype=dtype)
    return out


def test_layer_activation_bytes_match_measured():
    measured = run_ranks(_layer_worker, 2)[0]
    for name, model, tp, sp, gran, extra, bf16 in LAYER_ROWS:
        cfg = planner_cfg({**model, **extra}, tp, num_layers=1, attention_backend="unfused", bf16=bf16,
                          tensor_model_parallel_size=tp, sequence_parallel=sp, recompute_granularity=gran,
                          micro_batch_size=MICRO_BATCH)
        shape = RunShape.of(cfg, tp, vocab_of(cfg))
        predicted = chunk_activation_bytes(shape) - rms_norm_overcount(shape)
        assert predicted == pytest.approx(measured[name], rel=TOLERANCE), (name, predicted, measured[name])


# (name, world, flat flags): every rank's weights + gradients + optimizer state after one real step.
STATE_ROWS = [
    ("TP2 x DP2, distributed optimizer, bf16", dict(tensor_model_parallel_size=2, use_distributed_optimizer=True,
                                                    bf16=True)),
    ("PP2 x DP2, interleaved (VP), bf16", dict(pipeline_model_parallel_size=2,
                                               num_layers_per_virtual_pipeline_stage=1, bf16=True)),
    ("TP2 x PP2, SP, fp32", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                 sequence_parallel=True)),
    ("DP4, distributed optimizer, fp16", dict(use_distributed_optimizer=True, fp16=True)),
]
STATE_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                   hidden_dropout=0.0, attention_dropout=0.0)


def _state_flags(flat: dict) -> dict:
    return {**STATE_MODEL, **flat, "micro_batch_size": 1, "global_batch_size": 8, "train_iters": 1,
            "eval_iters": 0, "log_interval": 1, "initial_loss_scale": 4096.0 if flat.get("fp16") else 2.0**32}


def _state_worker(rank: int, world: int) -> dict:
    from megalite.config import validate
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from megalite.training.loop import pretrain
    from tests.run_counts import storage_by_kind

    out = {}
    for name, flat in STATE_ROWS:
        cfg = MegaliteConfig.from_flat({**_state_flags(flat), "mock_data": True, "vocab_size": VOCAB})
        validate(cfg, world)
        p = cfg.parallel
        layout = RankLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
        pg = ProcessGroups.build(layout, rank)
        mem = storage_by_kind(pretrain(cfg, pg, log=lambda s: None))
        state = mem["params"] + mem["grads"] + mem["main params"] + mem["adam moments"]
        out[name] = (pg.pp_rank, mem["numel"], state)
    return out


def test_state_bytes_match_measured():
    results = run_ranks(_state_worker, 4, timeout=600)
    for name, flat in STATE_ROWS:
        cfg = planner_cfg(STATE_MODEL, 4, **{k: v for k, v in _state_flags(flat).items()})
        sh = RunShape.of(cfg, 4, vocab_of(cfg))
        for rank_out in results:
            stage, numel, state = rank_out[name]
            mem = stage_memory(sh, stage)
            assert mem.params == numel, (name, stage, mem.params, numel)
            predicted = mem.terms["weights"] + mem.terms["gradients"] + mem.terms["optimizer state"]
            assert predicted == pytest.approx(state, rel=TOLERANCE), (name, stage, predicted, state)


# (name, flat flags) on 2 ranks: the peak bytes the autograd graph holds during a real training step.
PEAK_MODEL = dict(num_layers=4, hidden_size=128, num_attention_heads=4, seq_length=64, max_position_embeddings=64,
                  micro_batch_size=2, train_iters=1, eval_iters=0, log_interval=1, bf16=True,
                  attention_backend="unfused")
PEAK_ROWS = [
    ("PP2 1F1B m4", dict(pipeline_model_parallel_size=2, global_batch_size=8)),
    ("PP2 interleaved v2 m4", dict(pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=1,
                                   global_batch_size=8)),
    ("PP2 GPipe m4", dict(pipeline_model_parallel_size=2, pipeline_schedule="gpipe", global_batch_size=8)),
    ("PP2 full recompute", dict(pipeline_model_parallel_size=2, recompute_granularity="full", global_batch_size=8)),
    ("TP2 SP selective", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                              recompute_granularity="selective", global_batch_size=4)),
    ("DP2", dict(global_batch_size=8)),
]


def _peak_worker(rank: int, world: int) -> dict:
    import torch

    from megalite.config import validate
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from megalite.training.loop import pretrain
    from tests.run_counts import SavedTensor, peak_saved_bytes

    out = {}
    for name, flat in PEAK_ROWS:
        cfg = MegaliteConfig.from_flat({**PEAK_MODEL, **flat, "mock_data": True, "vocab_size": VOCAB})
        validate(cfg, world)
        p = cfg.parallel
        pg = ProcessGroups.build(RankLayout(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size),
                                 rank)
        log: list = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, log=log: SavedTensor(t, log), lambda s: s.tensor):
            res = pretrain(cfg, pg, log=lambda s: None)
        params = {q.untyped_storage().data_ptr() for c in res.chunks for q in c.parameters()}
        out[name] = (pg.pp_rank, peak_saved_bytes(log, params))
    return out


def test_stage_activation_peak_matches_measured():
    """A pipeline rank's activations at their peak over a real step: chunks in flight x chunk bytes,
    the embedding outputs, the logits the loss keeps (all m under GPipe), full recomputation's
    working set."""
    results = run_ranks(_peak_worker, 2, timeout=600)
    for name, flat in PEAK_ROWS:
        cfg = planner_cfg(PEAK_MODEL, 2, **flat)
        sh = RunShape.of(cfg, 2, vocab_of(cfg))
        for rank_out in results:
            stage, measured = rank_out[name]
            predicted = activation_bytes(sh, stage)
            assert predicted == pytest.approx(measured, rel=TOLERANCE), (name, stage, predicted, measured)


@pytest.mark.parametrize("p,v,m,kind", [(2, 1, 4, "1f1b"), (4, 1, 8, "1f1b"), (4, 1, 2, "1f1b"), (2, 2, 4, "1f1b"),
                                        (4, 2, 8, "1f1b"), (4, 3, 8, "1f1b"), (4, 1, 8, "gpipe"), (4, 2, 4, "gpipe")])
def test_in_flight_matches_schedule_tables(p, v, m, kind):
    """The planner's live chunks per pipeline rank equal the peak of forwards not yet backwarded in the
    table the executor runs (bench/README.md measures the same peak on real ranks)."""
    cfg = planner_cfg(dict(GPT, num_layers=p * v * 2), p, pipeline_model_parallel_size=p, pipeline_schedule=kind,
                      num_layers_per_virtual_pipeline_stage=2 if v > 1 else None, micro_batch_size=1,
                      global_batch_size=m)
    sh = RunShape.of(cfg, p, VOCAB)
    for r in range(p):
        live = peak = 0
        for action in rank_table(ScheduleSpec(p, v, m, kind), r):
            live += 1 if action.kind == "F" else -1
            peak = max(peak, live)
        assert in_flight_chunks(sh, r) == peak, (r, in_flight_chunks(sh, r), peak)


# ---- published runs: the development rows of docs/planning.md ---------------------------------------
# These rows were seen while the time model was built (docs/planning.md, "Held-out validation: the
# protocol"); they are reported, not evidence: the tests hold only that each fits and that the search
# finds its layout among those that fit. The held-out rows and their bounds: tests/test_planning_heldout.py.


def _published_plan(run):
    values, rest = split_argv(run_flags(run) + cluster_flags(run))
    cfg, cluster = parse_args(rest), cluster_from_values(values)
    assert not layout_rule_errors(cfg, cluster.world_size, cluster.gpus_per_node)
    fill_derived_defaults(cfg, cluster.world_size)
    return cfg, cluster, estimate(cfg, cluster, vocab_of(cfg))


@pytest.mark.parametrize("run", PUBLISHED, ids=[f"{r.gpu}-{r.name}" for r in PUBLISHED])
def test_published_run_fits(run):
    _, cluster, plan = _published_plan(run)
    assert cluster.memory_bytes() == 80e9 and plan.fits, plan.memory.total
    assert plan.time.tflops_per_gpu(run.counts_recompute) > 0


@pytest.mark.parametrize("run", PUBLISHED[::6], ids=[f"{r.gpu}-{r.name}" for r in PUBLISHED[::6]])
def test_published_layout_is_found(run):
    cfg, cluster, _ = _published_plan(run)
    cluster.memory_headroom_gb = 0.0  # the published runs fit: the headroom is the planner's own margin
    assert rank_of(search(cfg, cluster, vocab_of(cfg), context_parallel=False), run.tp, run.pp) is not None


# ---- the command lines ---------------------------------------------------------------------------
GPT3 = ["--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536"]
CLUSTER = ["--num-nodes", "128", "--gpus-per-node", "8", "--gpu", "a100-80g"]


def _run(script: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_plan_tool_prints_the_report():
    proc = _run("tools/plan.py", [*GPT3, "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
                                  "16", *CLUSTER, "--bf16", "--recompute-granularity", "full"])
    assert proc.returncode == 0, proc.stderr
    for text in ("memory per rank", "weights", "optimizer state", "activations", "of 80 GB: fits",
                 "pipeline bubble", "TP comm", "model TFLOP/s per GPU", "TP 8 (NVLink)", "PP 16 (network)"):
        assert text in proc.stdout, (text, proc.stdout)


def test_plan_tool_search_prints_ranked_layouts_with_flags():
    proc = _run("tools/plan.py", [*GPT3, "--bf16", *CLUSTER, "--search", "--top", "3"])
    assert proc.returncode == 0, proc.stderr
    ranked = [line for line in proc.stdout.splitlines() if line.strip().startswith("--tensor-model-parallel-size")]
    assert len(ranked) == 3, proc.stdout
    assert "  1. " in proc.stdout and "  3. " in proc.stdout


def test_plan_tool_does_not_import_torch():
    code = ("import sys; from megalite.planning.cli import plan_main; "
            f"plan_main({[*GPT3, *CLUSTER]!r}); assert 'torch' not in sys.modules, 'torch imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr


def test_plan_tool_names_the_broken_rule():
    proc = _run("tools/plan.py", [*GPT3, "--tensor-model-parallel-size", "5", *CLUSTER])
    assert proc.returncode == 2
    assert "--tensor-model-parallel-size (5) must divide --num-attention-heads (96)" in proc.stderr
    proc = _run("tools/plan.py", [*GPT3, "--gpus-per-node", "0"])
    assert proc.returncode == 2 and "--gpus-per-node must be an integer in [1, 1048576], got 0" in proc.stderr


def test_dry_run_validates_and_prints_the_plan():
    args = ["--dry-run", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "1000", "--tensor-model-parallel-size", "2", "--bf16"]
    proc = _run("pretrain_gpt.py", args, env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "1 node(s) x 4" in proc.stdout and "TP 2 (NVLink) x CP 1 x DP 2" in proc.stdout, proc.stdout
    proc = _run("pretrain_gpt.py", [*args[:-1], "--num-nodes", "2", "--gpus-per-node", "8", "--fp16", "--bf16"])
    assert proc.returncode == 2 and "--fp16 and --bf16 are exclusive" in proc.stderr, proc.stderr


def test_search_proposes_only_what_pretrain_accepts():
    """Every ranked layout passes pretrain_gpt.py's full validation on the cluster's world."""
    from megalite.config import validate

    cfg = parse_args([*GPT3[:8], "--micro-batch-size", "1", "--global-batch-size", "64", "--num-layers", "8",
                      "--bf16", "--mock-data", "--vocab-size", "50000"])
    values, _ = split_argv(["--num-nodes", "4", "--gpus-per-node", "8", "--gpu", "h100-sxm"])
    cluster = cluster_from_values(values)
    result = search(cfg, cluster, vocab_of(cfg))
    assert result.plans and result.refused
    # where the distributed optimizer alone does not fit, ZeRO-2/3 layouts are proposed (and validated below)
    assert {p.layout.sharding for p in result.plans} & {"optim_grads", "optim_grads_params"}
    for plan in result.plans:
        run = plan.layout.apply(cfg)
        validate(run, cluster.world_size, cluster.gpus_per_node)
        assert plan.fits and plan.memory.total <= 80e9


def _cp_shape(cp: int, **flat) -> RunShape:
    """A context-parallel run's shape (TP2 with SP, bf16) on 8 ranks."""
    cfg = MegaliteConfig.from_flat({**GPT, "num_layers": 4, "bf16": True, "micro_batch_size": 2,
                                    "global_batch_size": 16, "context_parallel_size": cp,
                                    "tensor_model_parallel_size": 2, "sequence_parallel": True, **flat})
    return RunShape.of(cfg, 8, VOCAB)


def test_context_parallel_terms():
    from megalite.planning.hardware import ClusterConfig
    from megalite.planning.memory import optimizer_bytes
    from megalite.planning.timing import cp_comm_s, link

    one, two = _cp_shape(1, recompute_granularity="selective"), _cp_shape(2, recompute_granularity="selective")
    assert two.dp * two.cp == one.dp and two.local_tokens * 2 == one.local_tokens
    assert chunk_activation_bytes(two) == pytest.approx(chunk_activation_bytes(one) / 2)
    dist = _cp_shape(2, use_distributed_optimizer=True)
    assert optimizer_bytes(dist, 1000) == pytest.approx(12 * 1000 / (dist.dp * 2))  # shards over DP x CP
    # ring p2p: each rank sends its K/V chunk 2·b·(s/c)·(groups/tp)·d·bytes c - 1 times forward and dK/dV
    # c - 1 times backward, per layer and micro-batch
    cl = ClusterConfig(num_nodes=1, gpus_per_node=8)
    b, s, groups, d = 2, GPT["seq_length"], GPT["num_attention_heads"], GPT["hidden_size"] // GPT["num_attention_heads"]
    for c in (2, 4):
        sh = _cp_shape(c)
        kv = 2 * b * (s // c) * (groups // 2) * d * 2
        expected = 2 * kv * (c - 1) * sh.layers_per_stage * sh.m
        assert cp_comm_s(sh, cl) * link(sh, cl, "cp", c) == pytest.approx(expected)
    assert cp_comm_s(_cp_shape(1), cl) == 0.0


@pytest.mark.parametrize("d", [2, 4])
def test_zero_terms_hold_the_measured_bytes_per_parameter(d):
    """Without the step's transients (one bucket's full gradients; ZeRO-3's gathered units), the planner's
    weights + gradients + optimizer state per parameter are what bench/bench_sharding.py measures held
    after a step in bf16: 2 + 4/d + 12/d (ZeRO-2) and 18/d (ZeRO-3); ZeRO-3 moves the most DP bytes."""
    from megalite.planning.memory import grad_bytes, layer_params, optimizer_bytes, stage_params, weight_bytes
    from megalite.planning.timing import dp_comm_s

    def shape(strategy: str | None, **extra) -> RunShape:
        cfg = MegaliteConfig.from_flat({**GPT, "num_layers": 4, "bf16": True, "micro_batch_size": 1,
                                        "global_batch_size": 2 * d, "data_parallel_sharding_strategy": strategy,
                                        "ddp_bucket_size": 10_000, **extra})
        return RunShape.of(cfg, d, VOCAB)

    z2, z3, opt = shape("optim_grads"), shape("optim_grads_params"), shape("optim")
    n = stage_params(z2, 0)
    held2 = weight_bytes(z2, n) + grad_bytes(z2, n) - 10_000 * 6 + optimizer_bytes(z2, n)
    assert held2 / n == pytest.approx(2 + 4 / d + 12 / d)
    gathered = n - z3.layers_per_stage * layer_params(z3) + 2 * layer_params(z3)
    held3 = weight_bytes(z3, n) - 2 * gathered + grad_bytes(z3, n) - layer_params(z3) * 6 + optimizer_bytes(z3, n)
    assert held3 / n == pytest.approx(18 / d)
    keep = shape("optim_grads_params", fsdp_keep_params_across_microbatches=True)
    assert weight_bytes(keep, n) == pytest.approx((n / d + n) * 2)
    values, _ = split_argv(["--num-nodes", "1", "--gpus-per-node", str(d), "--gpu", "h100-sxm"])
    cl = cluster_from_values(values)
    assert dp_comm_s(opt, cl) < dp_comm_s(z2, cl) < dp_comm_s(z3, cl)


def test_plan_help_lists_every_flag_once():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, str(ROOT / "tools" / "plan.py"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("--peak-tflops PEAK_TFLOPS") == 1 and "--search" in out.stdout
