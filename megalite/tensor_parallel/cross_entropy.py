"""Cross-entropy over a vocabulary split across TP ranks, in fp32, without gathering the logits.

Three reductions over TP: MAX of the local maxima (stability), SUM of the target logit (only its
owner contributes), SUM of the exp-sums. loss = log(sum exp) - target; grad = softmax - onehot.
Padded vocabulary entries (ids >= vocab_size) are excluded, so the loss does not depend on the
padding and therefore not on the TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.groups import Group, ProcessGroups


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, pg: ProcessGroups, vocab_start: int,
                vocab_size: int) -> torch.Tensor:
        # logits [s, b, v/tp] (any float dtype), target [s, b] global ids
        # Every pass over [s, b, v/tp] below is in place on the fp32 logits (consumed, as in
        # Megatron-core): a fresh buffer of that size costs more than the pass that fills it.
        logits = logits.float()
        local_v = logits.shape[-1]
        n_real = min(max(vocab_size - vocab_start, 0), local_v)
        if n_real < local_v:  # padded columns never win the softmax
            logits[..., n_real:] = float("-inf")
        local_max = logits.amax(dim=-1)
        if n_real == 0:
            local_max = torch.full_like(local_max, float("-inf"))
        pg.all_reduce(local_max, Group.TP, op=dist.ReduceOp.MAX)
        shifted = logits.sub_(local_max.unsqueeze(-1))

        local_target = target - vocab_start
        outside = (local_target < 0) | (local_target >= local_v)
        local_target = local_target.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        pg.all_reduce(target_logit, Group.TP)

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1)
        pg.all_reduce(sum_exp, Group.TP)
        loss = sum_exp.log() - target_logit
        # softmax = exp / sum_exp is left to the backward, where it folds into the grad_loss scaling.
        ctx.save_for_backward(exp, sum_exp, local_target, outside)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        exp, sum_exp, local_target, outside = ctx.saved_tensors
        # grad = (softmax - onehot) * grad_loss = exp * (grad_loss / sum_exp) - onehot * grad_loss,
        # one pass over [s, b, v/tp] in place on the saved buffer (owned by this graph).
        grad = exp.mul_((grad_loss / sum_exp).unsqueeze(-1))
        onehot_grad = grad_loss.masked_fill(outside, 0.0).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_grad.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pg: ProcessGroups,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logit columns [s, b, v_pad/tp] and global targets [s, b].

    fp32 logits are overwritten (their buffer becomes the gradient); pass a clone to keep them."""
    vocab_start = pg.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, pg, vocab_start, vocab_size)
