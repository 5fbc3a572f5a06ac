"""Promise: group-limited routing (--moe-router-num-groups, --moe-router-group-topk) chooses as DeepSeek-V3
and Megatron-LM do: the experts form equal groups, each token keeps its best groups (a group scored by the
sum of its top topk // group-topk scores), and its top-k experts come from those groups only.

- sigmoid scores, with and without the expert bias (which moves the choice, never the weights) and with
  --moe-router-topk-scaling-factor: the router's weights and experts equal transformers' own
  DeepseekV3TopkRouter run on the same router weight and bias (it scores a group by its top 2, so the cases
  have topk // group-topk = 2);
- softmax scores (top-k of the logits, and --moe-router-pre-softmax) and a per-group k other than 2: equal
  megatron-core's own ``topk_routing_with_score_function``;
- the choice never leaves the chosen groups; backward gets plain top-k's gradient and keeps its bytes;
- EP 2 training runs (sigmoid, expert bias moving, group-limited; the alltoall and the allgather
  dispatcher) equal the single-process run under NCCL's point-to-point rules (MEGALITE_NCCL_SEMANTICS=1);
- each rule of the flags is a one-line error naming them; to-megatron writes both flags and the Megatron
  import reads them back (the groups alone, which Megatron ignores, are dropped; the deprecated
  moe_router_topk_limited_devices is refused by name).
"""

from __future__ import annotations

import pytest
import torch

from megalite.config import ConfigError, parse_args, validate
from megalite.config.model import ModelConfig
from megalite.moe.router import Router, group_limited_topk
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker
from tests.layouts import assert_matches_serial, layout_curves, p2p_mode, serial_curve
from tests.tp_utils import LLAMA_GQA, layout_flat

H, T = 8, 24


def megalite_router(E: int, k: int, groups: int, group_topk: int, **flags) -> Router:
    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_experts=E, moe_router_topk=k,
                      moe_router_num_groups=groups, moe_router_group_topk=group_topk, disable_bias_linear=True,
                      **flags)
    r = Router(cfg, BuildContext(ProcessGroups.single(), RNGTracker()))
    gen = torch.Generator().manual_seed(E * 100 + k)
    with torch.no_grad():
        r.weight.copy_(torch.randn(E, H, generator=gen))
    return r


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randn(T, 1, H, generator=torch.Generator().manual_seed(seed))


def by_expert(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """[T, E] weights (0 where not chosen): the choice without its order."""
    return torch.zeros(probs.shape[0], int(experts.max()) + 1 if experts.numel() else 0).scatter(1, experts, probs)


# (experts, topk, groups, group_topk, bias, scaling factor); topk // group_topk = 2 as transformers scores groups
HF_CASES = {"8e_4g_top2g_k4": (8, 4, 4, 2, False, None),
            "8e_4g_top2g_k4_bias_scaled": (8, 4, 4, 2, True, 2.5),
            "4e_2g_top1g_k2_bias": (4, 2, 2, 1, True, None),
            "16e_8g_top3g_k6_scaled": (16, 6, 8, 3, False, 1.5)}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_sigmoid_group_routing_equals_transformers_deepseek_v3_router(case):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    E, k, groups, group_topk, bias, scaling = HF_CASES[case]
    r = megalite_router(E, k, groups, group_topk, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=bias, moe_router_topk_scaling_factor=scaling)
    if bias:  # large enough to change the choice of some tokens
        with torch.no_grad():
            r.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(7)))
    hf = DeepseekV3TopkRouter(DeepseekV3Config(
        hidden_size=H, n_routed_experts=E, num_experts_per_tok=k, n_group=groups, topk_group=group_topk,
        norm_topk_prob=True, routed_scaling_factor=scaling or 1.0))
    with torch.no_grad():
        hf.weight.copy_(r.weight)
        hf.e_score_correction_bias.copy_(r.expert_bias if bias else torch.zeros(E))
    x = tokens()
    out = r(x)
    _, hf_probs, hf_experts = hf(x)
    torch.testing.assert_close(by_expert(out.probs, out.experts), by_expert(hf_probs, hf_experts),
                               rtol=1e-6, atol=0)
    if bias:  # the bias changed some choices, yet the weights are the unbiased scores'
        unbiased = megalite_router(E, k, groups, group_topk, moe_router_score_function="sigmoid",
                                   moe_router_topk_scaling_factor=scaling)(x)
        assert not torch.equal(unbiased.experts.sort(-1).values, out.experts.sort(-1).values)


# (score function flags, experts, topk, groups, group_topk): softmax paths and per-group k 1 and 3
MCORE_CASES = {"softmax_topk_of_logits": ({}, 8, 4, 4, 2),
               "pre_softmax_per_group_k1": ({"moe_router_pre_softmax": True}, 8, 2, 4, 2),
               "sigmoid_per_group_k3_scaled": ({"moe_router_score_function": "sigmoid",
                                               "moe_router_topk_scaling_factor": 2.0}, 12, 6, 3, 2)}


@pytest.mark.parametrize("case", list(MCORE_CASES))
def test_group_routing_equals_megatron_core(case):
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    flags, E, k, groups, group_topk = MCORE_CASES[case]
    r = megalite_router(E, k, groups, group_topk, **flags)
    x = tokens(1)
    out = r(x)
    logits = x.reshape(T, H) @ r.weight.detach().t()
    probs, routing_map = topk_routing_with_score_function(
        logits, k, use_pre_softmax=r.cfg.moe_router_pre_softmax, num_groups=groups, group_topk=group_topk,
        scaling_factor=r.cfg.moe_router_topk_scaling_factor, score_function=r.cfg.moe_router_score_function)
    got = by_expert(out.probs, out.experts)
    assert torch.equal(got > 0, routing_map)
    torch.testing.assert_close(got, probs, rtol=1e-6, atol=0)


def saved_bytes(fn, scores: torch.Tensor) -> int:
    """Bytes autograd keeps for backward of ``fn(scores)`` (each storage once)."""
    seen = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(scores)
    return sum(seen.values())


def test_choice_stays_in_the_best_groups_and_backward_is_top_ks():
    """Group-limited: the experts of the best groups only; the gradient and the saved bytes of plain top-k
    (the planner's router bytes hold)."""
    scores = torch.randn(64, 12, generator=torch.Generator().manual_seed(3), requires_grad=True)
    assert saved_bytes(lambda x: group_limited_topk(x, 4, 4, 2), scores) == saved_bytes(lambda x: x.topk(4), scores)
    values, experts = group_limited_topk(scores, 4, num_groups=4, group_topk=2)
    best = scores.detach().view(64, 4, 3).topk(2, -1).values.sum(-1).topk(2, -1).indices  # [T, 2] groups kept
    assert (experts.div(3, rounding_mode="floor")[:, :, None] == best[:, None, :]).any(-1).all()
    assert not torch.equal(experts, scores.topk(4, -1).indices)  # the groups changed some tokens' choice
    torch.testing.assert_close(values, scores.gather(1, experts), rtol=0, atol=0)
    w = torch.randn(64, 4, generator=torch.Generator().manual_seed(4))
    (values * w).sum().backward()
    assert torch.equal(scores.grad, torch.zeros(64, 12).scatter(1, experts, w))


MODEL = {**LLAMA_GQA, "num_layers": 2, "hidden_size": 32, "num_experts": 8, "moe_router_topk": 4,
         "moe_ffn_hidden_size": 16, "moe_router_num_groups": 4, "moe_router_group_topk": 2,
         "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
         "moe_router_bias_update_rate": 0.05, "moe_router_topk_scaling_factor": 2.0,
         "moe_token_dispatcher_type": "alltoall"}
ITERS = 4


def test_ep2_group_routing_trains_as_one_process_under_nccl_semantics():
    """Both dispatchers at EP 2 against one single-process run (the dispatcher is idle in one process)."""
    flat = layout_flat(MODEL, vocab=128, iters=ITERS, log_interval=1)
    runs = {kind: {**flat, "expert_model_parallel_size": 2, "moe_token_dispatcher_type": kind}
            for kind in ("alltoall", "allgather")}
    with p2p_mode("nccl_semantics"):
        curves = layout_curves(2, runs)
    for kind in runs:
        assert_matches_serial(curves, kind, serial_curve(flat), ITERS)


BASE = ["--mock-data", "--vocab-size", "128", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
        "4", "--seq-length", "16", "--micro-batch-size", "1", "--num-experts", "8", "--disable-bias-linear"]


@pytest.mark.parametrize("extra,message", [
    (["--moe-router-group-topk", "2"], "--moe-router-group-topk (2) needs --moe-router-num-groups"),
    (["--moe-router-num-groups", "4"], "--moe-router-num-groups (4) needs --moe-router-group-topk"),
    (["--moe-router-num-groups", "3", "--moe-router-group-topk", "1"],
     "--moe-router-num-groups (3) must divide --num-experts (8)"),
    (["--moe-router-num-groups", "2", "--moe-router-group-topk", "3"],
     "--moe-router-group-topk (3) must be at most --moe-router-num-groups (2)"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "3", "--moe-router-topk", "2"],
     "--moe-router-topk (2) must be at least --moe-router-group-topk (3)"),
    (["--moe-router-num-groups", "4", "--moe-router-group-topk", "1", "--moe-router-topk", "3"],
     "--moe-router-topk (3) must fit in the chosen groups: at most --moe-router-group-topk (1) x experts per "
     "group (2)"),
])
def test_bad_group_routing_flags_are_named(extra, message):
    with pytest.raises(ConfigError) as e:
        validate(parse_args(BASE + extra), 1)
    assert message in str(e.value)
    assert len([line for line in str(e.value).splitlines() if "--moe-router" in line]) == 1


def test_megatron_args_carry_the_groups_both_ways():

    from megalite.checkpointing.errors import CheckpointError
    from megalite.checkpointing.megatron.args import config_from_args
    from megalite.checkpointing.megatron.export import megatron_args
    from megalite.checkpointing.metadata import config_dict

    cfg = ModelConfig(num_layers=1, hidden_size=H, num_attention_heads=1, num_experts=8, moe_router_topk=4,
                      moe_router_num_groups=4, moe_router_group_topk=2, disable_bias_linear=True)
    args = megatron_args(config_dict(cfg, 128), 128)
    assert (args.moe_router_num_groups, args.moe_router_group_topk) == (4, 2)
    back = config_from_args(args, 128, "ckpt")
    assert (back["moe_router_num_groups"], back["moe_router_group_topk"]) == (4, 2)
    args.moe_router_group_topk = None  # Megatron ignores the groups alone: so does the import
    assert config_from_args(args, 128, "ckpt")["moe_router_num_groups"] is None
    args.moe_router_topk_limited_devices = 2
    with pytest.raises(CheckpointError, match="moe_router_topk_limited_devices=2 .device-limited routing"):
        config_from_args(args, 128, "ckpt")
