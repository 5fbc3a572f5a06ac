"""The layout planner's mixture-of-experts terms (megalite/planning/moe.py, docs/planning.md "Mixture of
experts") against measurement and published figures: an MoE layer's saved bytes, every rank's parameters,
gradients and optimizer state and its token-dispatch bytes after a real tiny MoE step (EP1, EP2 x expert-DP 2
with the distributed optimizer, TP2 x EP2 with SP, both dispatchers), the bench's dispatch formulas, the
FLOPs of active parameters against a hand count, published MoE parameter counts, and the command lines.
"""

from __future__ import annotations

import pytest

from megalite.config.arguments import MegaliteConfig, parse_args
from megalite.config.validate import fill_derived_defaults
from megalite.planning.cli import cluster_from_values, vocab_of
from megalite.planning.estimate import estimate
from megalite.planning.memory import chunk_activation_bytes, stage_memory
from megalite.planning.search import search
from megalite.planning.shape import RunShape
from tests.harness import run_ranks
from tests.plan_measure import rms_norm_overcount
from tests.planning_rows.published import PUBLISHED_MOE
from tests.test_planning import GPT, LLAMA, MICRO_BATCH, VOCAB, _run, _state_flags, planner_cfg

MOE = dict(num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01, disable_bias_linear=True, swiglu=True)
MOE_LAYER = dict(LLAMA, seq_length=64, **MOE)
# (name, model fields, tp, ep, etp, bf16): one MoE layer's saved bytes on 2 ranks (the mean of the ranks
# where the rows a rank's experts receive depend on the routing)
MOE_LAYER_ROWS = [
    ("MoE TP1 alltoall", dict(MOE_LAYER, moe_token_dispatcher_type="alltoall"), 1, 1, 1, True),
    ("MoE TP1 allgather, shared expert + gate", dict(MOE_LAYER, moe_shared_expert_intermediate_size=128,
                                                     moe_shared_expert_gate=True), 1, 1, 1, True),
    ("MoE TP1 GeLU, z-loss, LayerNorm, fp32", dict(GPT, seq_length=64, **dict(MOE, swiglu=False), hidden_dropout=0.0,
                                                  attention_dropout=0.0, moe_z_loss_coeff=1e-3), 1, 1, 1, False),
    ("MoE TP1 sigmoid + expert bias", dict(MOE_LAYER, moe_router_score_function="sigmoid",
                                           moe_router_enable_expert_bias=True), 1, 1, 1, True),
    ("MoE EP2 alltoall", dict(MOE_LAYER, moe_token_dispatcher_type="alltoall"), 1, 2, 1, True),
    ("MoE EP2 allgather", MOE_LAYER, 1, 2, 1, True),
    ("MoE TP2 SP expert-TP 2 alltoall", dict(MOE_LAYER, moe_token_dispatcher_type="alltoall"), 2, 1, 2, True),
    ("MoE TP2 SP EP2 expert-TP 1 allgather", MOE_LAYER, 2, 2, 1, True),
]
MOE_LAYER_TOLERANCE = 0.01


def _moe_layer_worker(rank: int, world: int) -> dict:
    import torch

    from megalite.config.model import ModelConfig
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from tests.plan_measure import layer_activation_bytes

    out = {}
    for name, model, tp, ep, etp, bf16 in MOE_LAYER_ROWS:
        if tp * ep * etp == 1 and rank > 0:
            continue
        cfg = ModelConfig(num_layers=1, attention_backend="unfused", **model)
        pg = ProcessGroups.single() if tp * ep * etp == 1 else \
            ProcessGroups.build(RankLayout(world, tp, ep=ep, etp=etp), rank)
        out[name] = layer_activation_bytes(cfg, pg, MICRO_BATCH, VOCAB, sequence_parallel=tp > 1,
                                           dtype=torch.bfloat16 if bf16 else torch.float32)
    return out


def test_moe_layer_activation_bytes_match_measured():
    """An MoE layer's saved bytes (router, dispatch, experts' rows, shared expert) within 1%: exact for
    the default router, within 0.2% for the sigmoid router and the z-loss, whose small tensors are
    counted roughly."""
    results = run_ranks(_moe_layer_worker, 2)
    for name, model, tp, ep, etp, bf16 in MOE_LAYER_ROWS:
        ranks = [r[name] for r in results if name in r]
        measured = sum(ranks) / len(ranks)
        cfg = planner_cfg(model, tp * ep * etp, num_layers=1, attention_backend="unfused", bf16=bf16,
                          tensor_model_parallel_size=tp, sequence_parallel=tp > 1, micro_batch_size=MICRO_BATCH,
                          expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        shape = RunShape.of(cfg, tp * ep * etp, vocab_of(cfg))
        predicted = chunk_activation_bytes(shape) - rms_norm_overcount(shape)
        assert predicted == pytest.approx(measured, rel=MOE_LAYER_TOLERANCE), (name, predicted, measured)


# (name, flat flags) on 4 ranks: every rank's weights + gradients + optimizer state after one real step, and the
# bytes it handed to the token-dispatch collectives.
MOE_STATE_ROWS = [
    ("MoE EP1 x DP4, bf16", dict()),
    ("MoE EP2 x expert-DP 2, distributed optimizer, bf16", dict(expert_model_parallel_size=2,
                                                               use_distributed_optimizer=True,
                                                               moe_token_dispatcher_type="alltoall")),
    ("MoE TP2 x EP2, SP, alltoall, bf16", dict(tensor_model_parallel_size=2, sequence_parallel=True,
                                               expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall")),
    ("MoE TP2 x EP2, SP, expert-TP 1, allgather, shared expert, expert bias, distributed optimizer, fp32",
     dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2,
          expert_tensor_parallel_size=1, use_distributed_optimizer=True, bf16=False,
          moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True, moe_router_score_function="sigmoid",
          moe_router_enable_expert_bias=True)),
]
MOE_STATE_MODEL = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                       ffn_hidden_size=128, hidden_dropout=0.0, attention_dropout=0.0, moe_layer_freq="([0]+[1]*3)",
                       bf16=True, **MOE)


def _moe_state_worker(rank: int, world: int) -> dict:
    from megalite.config import validate
    from megalite.parallel.groups import ProcessGroups
    from megalite.parallel.layout import RankLayout
    from megalite.training.loop import pretrain
    from tests.plan_measure import dispatch_comm_bytes
    from tests.run_counts import storage_by_kind

    out = {}
    for name, flat in MOE_STATE_ROWS:
        cfg = MegaliteConfig.from_flat({**_state_flags({**MOE_STATE_MODEL, **flat}), "mock_data": True,
                                        "vocab_size": VOCAB})
        validate(cfg, world)
        p = cfg.parallel
        layout = RankLayout(world, p.tensor_model_parallel_size, ep=p.expert_model_parallel_size,
                            etp=p.expert_tensor_parallel_size)
        pg = ProcessGroups.build(layout, rank)
        mem = storage_by_kind(pretrain(cfg, pg, log=lambda s: None))
        state = mem["params"] + mem["grads"] + mem["main params"] + mem["adam moments"]
        out[name] = (mem["numel"], state, dispatch_comm_bytes(pg))
    return out


def test_moe_state_and_dispatch_bytes_match_measured():
    """Per rank, exactly: the parameters (dense over TP, E/ep experts each cut over expert-TP, the fp32
    expert bias), and their weights + gradients + optimizer state (experts sharded over expert-DP by the
    distributed optimizer). The bytes handed to each token-dispatch collective per step: exactly per rank
    where they do not depend on the routing (counts, allgather), and on average over the ranks for the
    rows an all-to-all sends back (a rank's received rows vary; over a group they sum to the sent ones)."""
    from megalite.planning.timing import moe_step_comm_bytes

    results = run_ranks(_moe_state_worker, 4, timeout=600)
    for name, flat in MOE_STATE_ROWS:
        cfg = planner_cfg(MOE_STATE_MODEL, 4, **_state_flags({**MOE_STATE_MODEL, **flat}))
        sh = RunShape.of(cfg, 4, vocab_of(cfg))
        mem = stage_memory(sh, 0)
        state = sum(v for k, v in mem.terms.items() if k.endswith(("weights", "gradients", "optimizer state")))
        for numel, measured, _ in (r[name] for r in results):
            assert (mem.params, state) == (numel, measured), (name, mem.params, numel, state, measured)
        predicted = moe_step_comm_bytes(sh)
        assert predicted or (sh.ep, sh.etp) == (1, 1), name
        measured_keys = set().union(*(r[name][2] for r in results))
        assert measured_keys == set(predicted), (name, measured_keys, set(predicted))
        for key, value in predicted.items():
            mean = sum(r[name][2][key] for r in results) / len(results)
            assert mean == value, (name, key, mean, value)
            if key[1] != "moe_all_to_all":
                assert all(r[name][2][key] == value for r in results), (name, key)


@pytest.mark.parametrize("ep,etp,tp,pad", [(2, 1, 1, False), (4, 1, 1, False), (2, 2, 2, False), (2, 1, 2, False),
                                            (4, 1, 1, True)])
def test_moe_dispatch_bytes_agree_with_the_bench_formulas(ep, etp, tp, pad):
    """The planner's per-rank dispatch bytes x the world = tests/moe_formulas.py's world totals (which
    bench/bench_moe.py holds to real runs); allgather per rank."""
    from megalite.planning.moe import dispatch_comm_bytes, routed_tokens, sent_rows
    from tests.moe_formulas import allgather_bytes, alltoall_bytes

    world = 8
    for kind in ("alltoall",) if pad else ("alltoall", "allgather"):  # only alltoall pads
        extra = dict(moe_expert_capacity_factor=1.5, moe_pad_expert_input_to_capacity=True) if pad else {}
        cfg = planner_cfg(MOE_LAYER, world, num_layers=2, bf16=True, micro_batch_size=2, global_batch_size=16,
                          tensor_model_parallel_size=tp, sequence_parallel=tp > 1, expert_model_parallel_size=ep,
                          expert_tensor_parallel_size=etp, moe_token_dispatcher_type=kind, **extra)
        sh = RunShape.of(cfg, world, VOCAB)
        T, h, k = routed_tokens(sh), sh.h, sh.cfg.model.moe_router_topk
        planner = {key: fwd + bwd for key, (fwd, bwd) in dispatch_comm_bytes(sh).items()}
        if kind == "alltoall":
            bench = alltoall_bytes(T, h, k, 4, ep, etp, world, 2, int(sent_rows(sh)) if pad else None)
            assert {key: v * world for key, v in planner.items()} == dict(bench), kind
        else:
            assert planner == dict(allgather_bytes(T, h, k, ep, etp, 2)), kind


def test_moe_flops_count_the_active_parameters():
    """planning/flops.py against a hand count: h 64, 4 heads of 16, s 32, vocab 1000, SwiGLU; layer 0 dense
    (ffn 128), layers 1-3 MoE (4 experts of 96, top-2, a shared expert of 32 with its gate)."""
    from megalite.config.model import ModelConfig
    from megalite.planning.flops import flops_per_token, training_flops

    cfg = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, ffn_hidden_size=128,
                      swiglu=True, disable_bias_linear=True, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=96,
                      moe_layer_freq="([0]+[1]*3)", moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True)
    qkv, proj, attn = 64 * 192, 64 * 64, 2 * 32 * 64  # multiply-adds per token
    dense_mlp = 3 * 64 * 128
    moe_mlp = 64 * 4 + 2 * (3 * 64 * 96) + 3 * 64 * 32 + 64  # router, 2 experts, shared expert, gate
    per_token = 2 * (qkv + proj + attn + dense_mlp) + 3 * 2 * (qkv + proj + attn + moe_mlp) + 2 * 64 * 1000
    assert (dense_mlp, moe_mlp, per_token) == (24576, 43328, 600960)
    assert flops_per_token(cfg, 1000, 32) == per_token
    assert training_flops(cfg, 1000, 32, 10) == 3 * per_token * 10
    dense = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, ffn_hidden_size=128,
                        swiglu=True)
    assert flops_per_token(dense, 1000, 32) == 4 * 2 * (qkv + proj + attn + dense_mlp) + 2 * 64 * 1000


def cfg_flags(run) -> list[str]:
    return [*run.flags, "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1"]


@pytest.mark.parametrize("run", PUBLISHED_MOE, ids=[r.name for r in PUBLISHED_MOE])
def test_published_moe_parameter_counts(run):
    """The planner's total and active parameters of released MoE models, to the published precision (0.1 B;
    DeepSeek-V3's whole billions: the planner's 671.03 B and 37.55 B)."""
    cfg = parse_args(cfg_flags(run))
    plan = estimate(cfg, cluster_from_values({}), vocab_of(cfg))
    assert run.agrees(plan.total_params, run.total_b), plan.total_params
    assert run.agrees(plan.active_params, run.active_b), plan.active_params
    if run.name == "DeepSeek-V3":  # its multi-token prediction module is published apart: counted apart
        with_mtp = estimate(parse_args([*cfg_flags(run), "--mtp-num-layers", "1"]), cluster_from_values({}),
                            vocab_of(cfg))
        assert (with_mtp.total_params, with_mtp.active_params) == (plan.total_params, plan.active_params)
        assert round(with_mtp.mtp_params / 1e9, 2) == 11.61 and plan.mtp_params == 0


MIXTRAL = [*PUBLISHED_MOE[0].flags, "--seq-length", "4096", "--max-position-embeddings", "4096", "--bf16",
           "--micro-batch-size", "1", "--global-batch-size", "256", "--moe-token-dispatcher-type", "alltoall"]


def test_plan_tool_reports_the_moe_terms():
    proc = _run("tools/plan.py", [*MIXTRAL, "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "4",
                                  "--use-distributed-optimizer", "--recompute-granularity", "selective",
                                  "--num-nodes", "8", "--gpus-per-node", "8"])
    assert proc.returncode == 0, proc.stderr
    for text in ("46.70 B parameters (12.88 B active per token: 8 experts, top-2, 32 MoE layers)",
                 "experts: EP 4 (NVLink) x expert-TP 2 (NVLink) x expert-DP 2 (network), alltoall dispatch",
                 "expert weights", "expert gradients", "expert optimizer state", "MoE activations",
                 "MoE dispatch buffers", "MoE dispatch (EP)", "MoE expert-TP comm", "expert DP comm",
                 "--expert-model-parallel-size 4"):
        assert text in proc.stdout, (text, proc.stdout)


def test_moe_terms_follow_the_expert_layout():
    """EP divides the experts' bytes, expert-DP their optimizer state; the dispatch leaves the node
    only when EP x expert-TP spans nodes; the search tries EP and proposes only what pretrain accepts."""
    from megalite.config import validate
    from megalite.planning.hardware import ClusterConfig
    from megalite.planning.timing import ep_comm_s

    def plan(ep: int, nodes: int = 1, extra: tuple = ()):
        cfg = parse_args([*MIXTRAL, "--num-layers", "4", "--expert-model-parallel-size", str(ep),
                          "--use-distributed-optimizer", *extra])
        cluster = ClusterConfig(num_nodes=nodes, gpus_per_node=8)
        fill_derived_defaults(cfg, cluster.world_size)
        return estimate(cfg, cluster, vocab_of(cfg))

    one, two, eight = plan(1), plan(2), plan(8)
    for name in ("expert weights", "expert gradients"):
        assert one.memory.terms[name] == pytest.approx(2 * two.memory.terms[name])
        assert one.memory.terms[name] == pytest.approx(8 * eight.memory.terms[name])
    assert eight.memory.terms["expert optimizer state"] == pytest.approx(eight.memory.terms["expert weights"] * 6)
    assert one.memory.terms["expert optimizer state"] == pytest.approx(one.memory.terms["expert weights"] * 6 / 8)
    assert ep_comm_s(one.shape, one.cluster) == 0 < ep_comm_s(two.shape, two.cluster)
    # EP 8 on one node's ranks, or EP 8 x expert-TP 2 over two nodes' (the same rows per rank each way)
    inside = plan(8, nodes=2, extra=("--tensor-model-parallel-size", "2", "--sequence-parallel",
                                     "--expert-tensor-parallel-size", "1"))
    across = plan(8, nodes=2, extra=("--tensor-model-parallel-size", "2", "--sequence-parallel"))
    assert ep_comm_s(inside.shape, inside.cluster) < ep_comm_s(across.shape, across.cluster)

    cfg = parse_args([*MIXTRAL, "--num-layers", "4", "--global-batch-size", "16", "--mock-data"])
    cluster = ClusterConfig(num_nodes=1, gpus_per_node=8)
    result = search(cfg, cluster, vocab_of(cfg), context_parallel=False)
    assert {p.layout.ep for p in result.plans} >= {1, 2, 4, 8}
    assert {p.layout.etp for p in result.plans if p.layout.tp > 1} == {None, 1}
    for p in result.plans[:20]:
        validate(p.layout.apply(cfg), cluster.world_size, cluster.gpus_per_node)


def test_dry_run_plans_the_moe_flags():
    args = ["--dry-run", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data",
            "--vocab-size", "1000", "--bf16", "--num-experts", "4", "--disable-bias-linear",
            "--expert-model-parallel-size", "2"]
    proc = _run("pretrain_gpt.py", args, env={"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"})
    assert proc.returncode == 0, proc.stderr
    assert "experts: EP 2 (NVLink) x expert-TP 1 x expert-DP 2 (NVLink)" in proc.stdout, proc.stdout
    assert "MoE dispatch buffers" in proc.stdout and "expert optimizer state" in proc.stdout, proc.stdout


def test_deepseek_v3_counts_are_transformers_own():
    """The planner's DeepSeek-V3 counts equal those of transformers' own DeepseekV3ForCausalLM at the released
    configuration, parameter for parameter (its 3 dense and 58 MoE layers counted from one of each, built on
    the meta device; the router's expert bias is a buffer there): 671,026,404,352 weights and 58 x 256 biases
    in all, and active per token the same less the 248 routed experts a token does not reach in each MoE
    layer (and the bias, which the router adds only to choose experts). So 37.55 B is the
    model's count, and the published "37B" is that count cut to whole billions (1.5 % below it)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    hf = DeepseekV3Config(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                          num_hidden_layers=4, first_k_dense_replace=3, num_attention_heads=128,
                          num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8,
                          n_group=8, topk_group=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                          qk_rope_head_dim=64, v_head_dim=128, tie_word_embeddings=False)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf)

    def count(module, buffers: bool = False) -> int:
        return sum(p.numel() for p in module.parameters()) + buffers * sum(b.numel() for b in module.buffers())

    dense, moe = count(model.model.layers[0]), count(model.model.layers[3], buffers=True)
    total = count(model.model.embed_tokens) + count(model.lm_head) + count(model.model.norm) + 3 * dense + 58 * moe
    expert = count(model.model.layers[3].mlp.experts) // 256
    run = next(r for r in PUBLISHED_MOE if r.name == "DeepSeek-V3")
    cfg = parse_args(cfg_flags(run))
    plan = estimate(cfg, cluster_from_values({}), vocab_of(cfg))
    assert plan.total_params == total == 671_026_404_352 + 58 * 256
    assert plan.active_params == total - 58 * ((256 - 8) * expert + 256)  # the expert bias is no weight a token uses
