"""LossScaling: every factor between a micro-batch's loss and the gradients the optimizer sees.

The rule is stated once, in docs/design.md §3.9; each factor is a method here, called where it is
applied: the micro-batches (the token count each one's loss sum is divided by), the pipeline executor (a
micro-batch's loss and its backward seed), the MoE layers (the aux terms' gradient), the gradient buffers
(the average over the gradient group), the reported loss and the MoE metrics. One object is built per
step from the step's facts, so no part recomputes its piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from megalite.parallel.groups import Group, ProcessGroups


@dataclass(frozen=True)
class LossScaling:
    """The step's facts that scale its loss. ``microbatches``: m, the micro-batches of this rank's step;
    ``loss_scale``: S, the fp16 dynamic loss scale (1 otherwise); ``cp``: c, the context-parallel size
    (each CP rank's loss is its tokens' share of the sequences' mean); ``grad_size``: DP x CP, the ranks
    gradients are averaged over; ``moe_shares``: TP x CP, the ranks that each hold a share of one
    micro-batch's MoE load-balancing and z terms; ``global_tokens``: T, the unmasked tokens of the whole
    global batch (--calculate-per-token-loss), or None: each micro-batch is normalised by its own count.
    The defaults are one process without scaling."""

    microbatches: int
    loss_scale: float = 1.0
    cp: int = 1
    grad_size: int = 1
    moe_shares: int = 1
    global_tokens: torch.Tensor | None = None

    @classmethod
    def of(cls, pg: ProcessGroups, microbatches: int = 1, loss_scale: float = 1.0) -> LossScaling:
        """The scaling of a step of ``microbatches`` on ``pg``'s layout (the layout's factors need no m)."""
        return cls(microbatches, loss_scale, pg.cp_size, pg.grad_size, pg.size(Group.TP_CP))

    @classmethod
    def per_token(cls, pg: ProcessGroups, microbatches: Sequence[dict[str, Any]], loss_scale: float = 1.0
                  ) -> LossScaling:
        """The scaling of a --calculate-per-token-loss step: T is this rank's micro-batches' loss-mask sums,
        summed over DP x CP (each CP rank holds its part of the masks) in one all-reduce, in fp64 (exact)."""
        local = torch.stack([mb["loss_mask"].sum(dtype=torch.float64) for mb in microbatches]).sum().reshape(1)
        pg.all_reduce(local, pg.grad_kind, label="token count")
        return replace(cls.of(pg, len(microbatches), loss_scale), global_tokens=local)

    def normalised(self, microbatches: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """The micro-batches with ``num_tokens``, what the forward step divides each one's loss sum by: per
        micro-batch its own count (the whole sequences' with CP, already there; else the loss mask's), per
        token T / (m x DP), the global batch's mean count per micro-batch, so that the mean of the micro-batch
        losses over m and DP x CP is the sum of all token losses over T; ``per_token_loss`` marks the latter
        (with CP ``num_tokens`` is there either way)."""
        if self.global_tokens is None:
            return list(microbatches)
        dp = self.grad_size // self.cp
        n = (self.global_tokens / (self.microbatches * dp)).float().reshape(())
        return [{**mb, "num_tokens": n, "per_token_loss": True} for mb in microbatches]  # (MTP reads the flag)

    def microbatch_loss(self, share: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss from this rank's share of its sequences' mean: c x share, so that the
        average over DP x CP of the gradients (and of the reported loss) is the sequences' mean."""
        return share if self.cp == 1 else share * self.cp

    @property
    def backward_factor(self) -> float:
        """S / m: a micro-batch's loss is multiplied by it before backward (gradients accumulate over m)."""
        return self.loss_scale / self.microbatches

    def backward_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """What backward starts from on the last stage: the micro-batch loss times S / m."""
        return loss * self.backward_factor

    @property
    def aux_grad_scale(self) -> float:
        """The gradient each MoE layer's aux terms receive: S / m x c, as the lm loss's shares get."""
        return self.backward_factor * self.cp

    @property
    def grad_factor(self) -> float:
        """1 / (DP x CP): multiplies the gradient sums over the gradient group (expert-DP too) into a mean."""
        return 1.0 / self.grad_size

    def reported(self, summed: torch.Tensor) -> torch.Tensor:
        """The reported loss from the sum over DP x CP of the ranks' mean micro-batch loss (in place)."""
        return summed.div_(self.grad_size)

    def moe_microbatches(self, counted: float) -> float:
        """The micro-batches behind a window's MoE terms from the count summed over ranks: every TP x CP
        rank counted each micro-batch, and their shares of its terms sum to its value."""
        return counted / self.moe_shares
