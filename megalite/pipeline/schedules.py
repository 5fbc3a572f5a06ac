"""Forward/backward schedules. Without pipelining: micro-batches run one after another and their
gradients accumulate (each loss scaled by 1 / num_microbatches)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

# A step function runs one micro-batch forward on a model chunk and returns its mean loss.
ForwardStep = Callable[[nn.Module, dict], torch.Tensor]


def forward_backward_no_pipelining(model: nn.Module, microbatches: Sequence[dict], forward_step: ForwardStep,
                                   forward_only: bool = False) -> list[torch.Tensor]:
    """Returns the detached loss of every micro-batch."""
    losses = []
    m = len(microbatches)
    for mb in microbatches:
        with torch.set_grad_enabled(not forward_only):
            loss = forward_step(model, mb)
            if not forward_only:
                (loss / m).backward()
        losses.append(loss.detach())
    return losses
