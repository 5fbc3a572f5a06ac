"""Promise: the router computes Megatron-LM's routing and load-balancing terms (docs/moe.md, megalite/moe/
router.py), checked against numbers worked out by hand here, single process.

The case: 4 tokens, 4 experts, top-2, hidden size 4 and an identity router weight, so the logits are the
tokens themselves. The logits are log(p) + c_t: the softmax over the experts is the table P below, and
logsumexp(logits) of token t is c_t.

    P (softmax)        top-2      counts c_e = [2, 2, 3, 1]
    t0 .4  .3  .2  .1  e0 e1      P_e = sum_t P_te = [1.15, .95, 1.2, .7]
    t1 .1  .2  .3  .4  e3 e2      sum_e P_e c_e = 2.3 + 1.9 + 3.6 + .7 = 8.5
    t2 .5  .1  .3  .1  e0 e2      aux = coeff * E / (k T^2) * 8.5 = coeff * 4 / 32 * 8.5 = 1.0625 coeff
    t3 .15 .35 .4  .1  e2 e1

seq_aux_loss with the tokens as [s=2, b=2] (token t = s_i * b + b_i): sequence 0 is t0, t2 (counts
[2, 1, 1, 0], P [.9, .4, .5, .2]: 2.7), sequence 1 is t1, t3 (counts [0, 1, 2, 1], P [.25, .55, .7, .5]:
2.45); each coeff * E / (k s^2) = coeff / 2 times its sum, mean over sequences: coeff * (1.35 + 1.225) / 2
= 1.2875 coeff. z-loss: coeff * mean_t c_t^2 = coeff * (1 + 4 + .25 + 9) / 4 = 3.5625 coeff.
"""

from __future__ import annotations

import math

import pytest
import torch

from megalite.config.model import ModelConfig
from megalite.config.moe import moe_layer_pattern
from megalite.moe.balance import update_expert_bias, window_metrics
from megalite.moe.layer import MoELayer
from megalite.moe.router import Router, capacity, load_balancing_loss
from megalite.parallel.groups import ProcessGroups
from megalite.tensor_parallel.context import BuildContext
from megalite.tensor_parallel.random import RNGTracker

P = torch.tensor([[.4, .3, .2, .1], [.1, .2, .3, .4], [.5, .1, .3, .1], [.15, .35, .4, .1]], dtype=torch.float64)
SHIFT = torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64)
LOGITS = (P.log() + SHIFT[:, None]).float()
TOP2 = [[0, 1], [3, 2], [0, 2], [2, 1]]
COEFF = 0.01


def single_ctx() -> BuildContext:
    return BuildContext(ProcessGroups.single(), RNGTracker())


def router(s: int = 4, b: int = 1, **flags) -> tuple[Router, torch.Tensor]:
    """A router whose logits are LOGITS, and its input [s, b, 4] (tokens in LOGITS' order)."""
    cfg = ModelConfig(num_layers=1, hidden_size=4, num_attention_heads=1, num_experts=4, moe_router_topk=2,
                      disable_bias_linear=True, **flags)
    r = Router(cfg, single_ctx())
    with torch.no_grad():
        r.weight.copy_(torch.eye(4))
    return r, LOGITS.reshape(s, b, 4)


def test_load_balancing_loss_by_hand():
    r, x = router(moe_aux_loss_coeff=COEFF)
    out = r(x)
    assert out.experts.tolist() == TOP2
    assert out.counts.tolist() == [2, 2, 3, 1]
    assert out.lb_loss.item() == pytest.approx(1.0625 * COEFF, rel=1e-6)
    assert out.z_loss is None and out.aux_loss.item() == pytest.approx(1.0625 * COEFF, rel=1e-6)
    # the formula itself: a uniform router gives exactly coeff
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([4.0, 4, 4, 4]), 8, 2, COEFF).item() == pytest.approx(COEFF)
    # the loss carries the gradient of sum_t P_te c_e toward the router weight
    out.aux_loss.backward()
    assert r.weight.grad is not None and r.weight.grad.abs().sum() > 0


def test_seq_aux_loss_by_hand():
    r, x = router(s=2, b=2, moe_aux_loss_coeff=COEFF, moe_router_load_balancing_type="seq_aux_loss")
    assert r(x).lb_loss.item() == pytest.approx(1.2875 * COEFF, rel=1e-6)


def test_no_load_balancing_and_z_loss_by_hand():
    r, x = router(moe_aux_loss_coeff=COEFF, moe_router_load_balancing_type="none", moe_z_loss_coeff=COEFF)
    out = r(x)
    assert out.lb_loss is None
    assert out.z_loss.item() == pytest.approx(3.5625 * COEFF, rel=1e-6)
    assert out.aux_loss.item() == pytest.approx(3.5625 * COEFF, rel=1e-6)


def test_default_top_k_is_softmax_over_the_chosen_logits():
    out = router()[0](router()[1])
    want = [[.4 / .7, .3 / .7], [.4 / .7, .3 / .7], [.5 / .8, .3 / .8], [.4 / .75, .35 / .75]]
    assert torch.allclose(out.probs, torch.tensor(want), atol=1e-6)


def test_pre_softmax_keeps_the_full_softmax_and_scaling_multiplies():
    r, x = router(moe_router_pre_softmax=True)
    out = r(x)
    assert out.experts.tolist() == TOP2
    want = torch.tensor([[.4, .3], [.4, .3], [.5, .3], [.4, .35]])
    assert torch.allclose(out.probs, want, atol=1e-6)  # not renormalised over the two
    r, x = router(moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5)
    assert torch.allclose(r(x).probs, want * 2.5, atol=1e-6)


def test_sigmoid_scores_renormalised_and_expert_bias_moves_only_the_choice():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    sig = torch.sigmoid(logits)[0]
    r, _ = router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    out = r(logits.view(1, 1, 4))
    assert out.experts.tolist() == [[2, 1]]
    assert torch.allclose(out.probs, torch.stack([sig[2], sig[1]]) / (sig[2] + sig[1]))
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))  # expert 3 now chosen first
    out = r(logits.view(1, 1, 4))
    assert out.experts.tolist() == [[3, 2]]
    # the weights are the sigmoid scores of the chosen experts, renormalised: no bias in them
    assert torch.allclose(out.probs, torch.stack([sig[3], sig[2]]) / (sig[3] + sig[2]))


@pytest.mark.parametrize("policy,kept", [
    ("probs", [[False, False], [True, False], [True, False], [True, True]]),
    ("position", [[True, True], [True, True], [False, False], [False, False]]),
])
def test_capacity_drop_policies_by_hand(policy, kept):
    """Pre-softmax weights = P; capacity ceil(4 x 2 / 4 x 0.5) = 1 per expert. e0 has t0 (.4), t2 (.5);
    e1 t0 (.3), t3 (.35); e2 t1 (.3), t2 (.3), t3 (.4); e3 t1 only. By probability each expert keeps its
    heaviest token (t2, t3, t3, t1); by position its first (t0, t0, t1, t1)."""
    assert capacity(4, 2, 4, 0.5) == 1
    r, x = router(moe_router_pre_softmax=True, moe_expert_capacity_factor=0.5, moe_token_drop_policy=policy)
    out = r(x)
    assert out.experts.tolist() == TOP2
    assert out.kept.tolist() == kept
    assert out.counts.tolist() == [2, 2, 3, 1]  # counted before the drop


def test_capacity_formula():
    assert capacity(10, 2, 4, 1.0) == 5 and capacity(10, 2, 4, 1.1) == math.ceil(5.5) == 6


@pytest.mark.parametrize("freq,layers,want", [
    ("1", 4, [True] * 4),
    ("2", 4, [True, False, True, False]),
    ("3", 5, [True, False, False, True, False]),
    ("([0]*1+[1]*3)", 4, [False, True, True, True]),
    ("[1, 0] * 2", 4, [True, False, True, False]),
])
def test_moe_layer_freq(freq, layers, want):
    assert moe_layer_pattern(freq, layers) == want


@pytest.mark.parametrize("freq,named", [
    ("0", "positive integer"),
    ("-2", "positive integer"),
    ("[1, 1]", "each of the 4 layers"),
    ("[0, 2, 1, 1]", "0 or 1"),
    ("abc", "neither an integer nor a list"),
    ("__import__('os').getcwd()", "neither an integer nor a list"),
    ("[1] * n", "neither an integer nor a list"),
])
def test_bad_moe_layer_freq_named(freq, named):
    with pytest.raises(ValueError, match="--moe-layer-freq") as e:
        moe_layer_pattern(freq, 4)
    assert named in str(e.value)


def test_expert_bias_update_direction():
    """An overloaded expert's bias goes down by the rate, an underloaded one's up, an average one's stays."""
    cfg = ModelConfig(num_layers=1, hidden_size=4, num_attention_heads=1, ffn_hidden_size=8, num_experts=4,
                      moe_router_topk=2, disable_bias_linear=True, moe_router_score_function="sigmoid",
                      moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.1)
    layer = MoELayer(cfg, single_ctx(), 0)
    layer.stats.step_counts.copy_(torch.tensor([10.0, 4.0, 1.0, 1.0]))  # mean 4
    update_expert_bias([layer], ProcessGroups.single())
    assert torch.allclose(layer.router.expert_bias, torch.tensor([-0.1, 0.0, 0.1, 0.1]))
    assert layer.stats.step_counts.sum() == 0  # cleared for the next step
    assert not layer.router.expert_bias.requires_grad


def test_training_forward_counts_for_the_bias():
    """The layer's training forward feeds the step counts the update reads."""
    cfg = ModelConfig(num_layers=1, hidden_size=4, num_attention_heads=1, ffn_hidden_size=8, num_experts=4,
                      moe_router_topk=2, disable_bias_linear=True, swiglu=True)
    layer = MoELayer(cfg, single_ctx(), 0)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
        for p in (layer.experts.fc1_weight, layer.experts.fc2_weight):
            p.normal_()
    layer(LOGITS.reshape(4, 1, 4))
    assert layer.stats.step_counts.tolist() == [2, 2, 3, 1]


def test_window_metrics_on_a_stage_without_moe_layers():
    """A pipeline stage with no MoE layer still joins the metrics' all-reduce; its table is on the compute
    device (NCCL refuses CPU tensors), not the default one. A different default device stands in for the
    difference."""
    with torch.device("meta"):
        out = window_metrics([torch.nn.Linear(2, 2, device="cpu")], ProcessGroups.single(), 4, 8)
    assert out["layers"] == {} and out["load_balancing_loss"] == 0.0


def test_window_metrics_log_line_and_per_layer_scalars():
    """Two training forwards: the window's metrics are the per-micro-batch mean of the load-balancing loss,
    max/mean of the counts (2, 2, 3, 1 twice: 3 / 2 = 1.5) and no drops; the log line and TensorBoard /
    W&B names carry them per layer, and reading the window clears it."""
    from megalite.training.log import IterationLine, format_iteration_line, moe_scalars

    cfg = ModelConfig(num_layers=2, hidden_size=4, num_attention_heads=1, ffn_hidden_size=8, num_experts=4,
                      moe_router_topk=2, disable_bias_linear=True, swiglu=True, moe_aux_loss_coeff=COEFF)
    layer = MoELayer(cfg, single_ctx(), 1)
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(4))
    for _ in range(2):
        layer(LOGITS.reshape(4, 1, 4))
    want_lb = float(load_balancing_loss(LOGITS.softmax(-1), torch.tensor([2.0, 2.0, 3.0, 1.0]), 4, 2, COEFF))
    out = window_metrics([layer], ProcessGroups.single(), 2, 4)
    row = out["layers"][1]
    assert list(out["layers"]) == [1] and math.isclose(row["load_balancing_loss"], want_lb, rel_tol=1e-6)
    assert row["imbalance"] == 1.5 and row["dropped_fraction"] == 0.0 and out["imbalance"] == 1.5
    line = format_iteration_line(IterationLine(iteration=3, train_iters=10, consumed=24, elapsed_ms=1.0, lr=1e-3,
                                               global_batch=8, loss=4.0, loss_scale=1.0, grad_norm=0.5, skipped=0,
                                               nan=0, moe=out))
    assert f"load balancing loss: {want_lb:.6E} | expert imbalance (max/mean): 1.500 | dropped tokens: 0.00% |" in line
    scalars = moe_scalars(out)
    assert scalars["moe/layer_1/imbalance"] == 1.5 and "moe/load_balancing_loss" in scalars
    assert window_metrics([layer], ProcessGroups.single(), 2, 4)["layers"] == {}  # the window was cleared
