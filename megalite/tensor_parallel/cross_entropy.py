"""Cross-entropy over a vocabulary split across TP ranks, in fp32, without gathering the logits.

Three reductions over TP: MAX of the local maxima (stability), SUM of the target logit (only its
owner contributes), SUM of the exp-sums. loss = log(sum exp) - target; grad = softmax - onehot.
Padded vocabulary entries (ids >= vocab_size) are excluded, so the loss does not depend on the
padding and therefore not on the TP size.

Soft-capping (--final-logit-softcapping C): the logits become z = C * tanh(logits / C) in place before the
softmax, and the gradient wrt the logits is (softmax - onehot) * (1 - (z / C)^2). Nothing more is kept for
it: z = log(exp) + max is read back from the saved exp (|z| <= C, so exp(z - max) >= e^-2C does not
underflow for the caps models use), and the target's z from the all-reduced target logit.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.groups import Group, ProcessGroups

# Elements of one block of the soft-capped backward's temporary (the derivative of the cap, fp32).
CAP_BLOCK_ELEMENTS = 1 << 22


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """C * tanh(logits / C), in transformers' order of operations (the logits generation and evaluation see)."""
    return torch.tanh(logits / cap) * cap


def softcap_(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """``softcap`` in place (the loss's own fp32 buffer)."""
    return logits.div_(cap).tanh_().mul_(cap)


def softcap_derivative_(z: torch.Tensor, cap: float) -> torch.Tensor:
    """1 - (z / C)^2 in place on the capped logits z (0 where z is -inf: padded columns)."""
    return z.div_(cap).square_().neg_().add_(1.0).clamp_(min=0.0)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, pg: ProcessGroups, vocab_start: int,
                vocab_size: int, cap: float | None = None) -> torch.Tensor:
        # logits [s, b, v/tp] (any float dtype), target [s, b] global ids
        # Every pass over [s, b, v/tp] below is in place on the fp32 logits (consumed, as in
        # Megatron-core): a fresh buffer of that size costs more than the pass that fills it.
        logits = logits.float()
        if cap is not None:
            softcap_(logits, cap)
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
        ctx.cap = cap
        ctx.save_for_backward(exp, sum_exp, local_target, outside, *(() if cap is None else (local_max, target_logit)))
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        exp, sum_exp, local_target, outside, *capped = ctx.saved_tensors
        # grad = (softmax - onehot) * grad_loss = exp * (grad_loss / sum_exp) - onehot * grad_loss,
        # one pass over [s, b, v/tp] in place on the saved buffer (owned by this graph).
        scale = (grad_loss / sum_exp).unsqueeze(-1)
        if ctx.cap is None:
            grad = exp.mul_(scale)
        else:
            grad, onehot_factor = _capped_softmax_grad_(exp, scale, ctx.cap, *capped)
            grad_loss = grad_loss * onehot_factor
        onehot_grad = grad_loss.masked_fill(outside, 0.0).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -onehot_grad.unsqueeze(-1))
        return grad, None, None, None, None, None


def _capped_softmax_grad_(exp: torch.Tensor, scale: torch.Tensor, cap: float, global_max: torch.Tensor,
                          target_logit: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp * scale * (1 - (z / C)^2) in place, z = log(exp) + max read back from the saved exp (blocks of
    rows bound the temporary), and the target's own factor 1 - (z_t / C)^2 from its all-reduced logit."""
    rows = max(1, CAP_BLOCK_ELEMENTS // max(exp[0].numel(), 1))
    for lo in range(0, exp.shape[0], rows):
        e = exp[lo:lo + rows]
        factor = softcap_derivative_(e.log().add_(global_max[lo:lo + rows].unsqueeze(-1)), cap)
        e.mul_(scale[lo:lo + rows]).mul_(factor)
    return exp, softcap_derivative_(target_logit + global_max, cap)


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, pg: ProcessGroups,
                                 vocab_size: int, softcap: float | None = None) -> torch.Tensor:
    """Per-token loss [s, b] from this rank's logit columns [s, b, v_pad/tp] and global targets [s, b];
    ``softcap``: the logits capped to C * tanh(logits / C) first (--final-logit-softcapping).

    fp32 logits are overwritten (their buffer becomes the gradient); pass a clone to keep them."""
    vocab_start = pg.tp_rank * logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits, target, pg, vocab_start, vocab_size, softcap)
