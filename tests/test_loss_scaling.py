"""Promise (docs/design.md §3.9): LossScaling's factors are the loss-scaling rule, computed in the order
the step always applied them (so the losses stay bitwise the same), from the layout's group sizes."""

from __future__ import annotations

import pytest
import torch

from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout
from megalite.parallel.loss_scaling import LossScaling


@pytest.mark.parametrize("loss_scale", [1.0, 4096.0, 2.0**15 / 3])
@pytest.mark.parametrize("m,cp,grad_size", [(1, 1, 1), (3, 2, 4), (7, 4, 8)])
def test_factors_are_the_rule(loss_scale, m, cp, grad_size):
    s = LossScaling(m, loss_scale, cp, grad_size, moe_shares=2 * cp)
    assert s.backward_factor == loss_scale / m
    assert s.aux_grad_scale == loss_scale / m * cp
    assert s.grad_factor == 1.0 / grad_size
    assert s.moe_microbatches(12.0) == 12.0 / (2 * cp)
    share = torch.tensor(0.7312, dtype=torch.float32)
    loss = s.microbatch_loss(share)
    assert torch.equal(loss, share * cp)
    assert torch.equal(s.backward_loss(loss), loss * (loss_scale / m))
    summed = torch.tensor([5.123], dtype=torch.float32)
    assert torch.equal(s.reported(summed.clone()), summed / grad_size)


def test_one_process_leaves_the_output_alone():
    """Without CP the micro-batch loss is the forward step's output itself (inference's logits are not copied)."""
    out = torch.randn(2, 3)
    assert LossScaling(4).microbatch_loss(out) is out
    assert LossScaling(4).backward_factor == 1.0 / 4


def test_layout_sizes():
    """TP 2 x CP 2 x DP 2: the loss shares are CP's, gradients averaged over DP x CP, MoE terms shared by TP x CP."""
    pg = ProcessGroups.unconnected(RankLayout(8, 2, 1, 2), 5)
    s = LossScaling.of(pg, 4, 8.0)
    assert (s.microbatches, s.loss_scale, s.cp, s.grad_size, s.moe_shares) == (4, 8.0, 2, 4, 4)
