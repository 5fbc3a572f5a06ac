"""Output layer fused with the vocab-parallel cross-entropy, in chunks of tokens (--cross-entropy-loss-fusion).

The unfused path builds this rank's logits [s, b, v/tp] in fp32 and keeps them (as the softmax) until
backward: with a large vocabulary that one tensor is the step's peak. Here the tokens (s*b, flattened)
are processed in chunks: each chunk's logits exist only while that chunk is processed, in the compute
dtype and then fp32. Forward keeps per token only the local max, the local exp-sum (rescaled to the global
max afterwards: two TP all-reduces in all, whatever the chunk count) and the target logit; backward
recomputes each chunk's logits from the saved input and weight (one more GEMM of the output layer)
and turns them into that chunk's share of the gradients wrt the hidden states and the weight.

Same rules as megalite/tensor_parallel/cross_entropy.py: padded vocabulary entries (ids >= vocab_size)
never take part, so the loss depends neither on the padding nor on the TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.groups import ProcessGroups

# fp32 logit elements per chunk (16 MiB): large enough that the GEMMs stay efficient, small enough that a
# chunk's logits are a small share of the activations. Measured in bench/bench_fused_cross_entropy.py.
CHUNK_ELEMENTS = 1 << 22


def chunk_rows(local_vocab: int, chunk_elements: int | None = None) -> int:
    """Tokens per chunk so that one chunk's fp32 logits hold about ``chunk_elements`` (default
    CHUNK_ELEMENTS) elements."""
    return max(1, (chunk_elements or CHUNK_ELEMENTS) // max(local_vocab, 1))


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, n_real: int) -> torch.Tensor:
    """fp32 logits [c, v/tp] of one chunk (GEMM in the compute dtype), padded columns at -inf."""
    logits = x.matmul(weight.t()).float()
    if n_real < logits.shape[-1]:
        logits[:, n_real:] = float("-inf")
    return logits


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, pg: ProcessGroups,
                vocab_size: int, sequence_parallel: bool, rows: int) -> torch.Tensor:
        # x [s, b, h] ([s/tp, b, h] with sequence parallelism), weight [v/tp, h], target [s, b] global ids.
        full = pg.all_gather(x, "tp", dim=0) if sequence_parallel and pg.tp_size > 1 else x
        local_v = weight.shape[0]
        vocab_start = pg.tp_rank * local_v
        n_real = min(max(vocab_size - vocab_start, 0), local_v)
        flat, tgt = full.reshape(-1, full.shape[-1]), target.reshape(-1)
        local_target = tgt - vocab_start
        outside = (local_target < 0) | (local_target >= local_v)
        local_target = local_target.masked_fill(outside, 0)
        n = flat.shape[0]
        local_max = torch.empty(n, dtype=torch.float32, device=x.device)
        sums = torch.empty(2, n, dtype=torch.float32, device=x.device)  # exp-sum (local max), target logit
        for lo in range(0, n, rows):
            hi = min(lo + rows, n)
            logits = _chunk_logits(flat[lo:hi], weight, n_real)
            m = logits.amax(dim=-1)
            m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a rank holding only padding
            local_max[lo:hi] = m if n_real > 0 else float("-inf")
            sums[1, lo:hi] = logits.gather(-1, local_target[lo:hi].unsqueeze(-1)).squeeze(-1)
            sums[0, lo:hi] = logits.sub_(m.unsqueeze(-1)).exp_().sum(dim=-1)
        global_max = local_max.clone()
        pg.all_reduce(global_max, "tp", op=dist.ReduceOp.MAX)
        sums[0].mul_((local_max - global_max).exp_())
        sums[1].sub_(global_max).masked_fill_(outside, 0.0)  # target logit shifted by the global max
        pg.all_reduce(sums, "tp")
        loss = sums[0].log() - sums[1]
        ctx.pg, ctx.vocab_size, ctx.sequence_parallel, ctx.rows = pg, vocab_size, sequence_parallel, rows
        ctx.save_for_backward(x, weight, global_max, sums[0], local_target, outside)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        x, weight, global_max, sum_exp, local_target, outside = ctx.saved_tensors
        pg, sp = ctx.pg, ctx.sequence_parallel and ctx.pg.tp_size > 1
        full = pg.all_gather(x, "tp", dim=0) if sp else x
        flat = full.reshape(-1, full.shape[-1])
        n_real = min(max(ctx.vocab_size - pg.tp_rank * weight.shape[0], 0), weight.shape[0])
        g = grad_loss.reshape(-1).float()
        scale = g / sum_exp
        onehot = g.masked_fill(outside, 0.0).neg_().unsqueeze(-1)
        grad_x = torch.empty_like(flat)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for lo in range(0, flat.shape[0], ctx.rows):
            hi = min(lo + ctx.rows, flat.shape[0])
            # (softmax - onehot) * grad_loss, as the unfused backward computes it
            grad = _chunk_logits(flat[lo:hi], weight, n_real).sub_(global_max[lo:hi].unsqueeze(-1)).exp_()
            grad.mul_(scale[lo:hi].unsqueeze(-1)).scatter_add_(-1, local_target[lo:hi].unsqueeze(-1), onehot[lo:hi])
            grad = grad.to(weight.dtype)
            torch.matmul(grad, weight, out=grad_x[lo:hi])
            if grad_w.dtype == grad.dtype:
                grad_w.addmm_(grad.t(), flat[lo:hi])
            else:
                grad_w += grad.t().matmul(flat[lo:hi]).float()
        grad_x = grad_x.view(full.shape)
        if sp:
            grad_x = pg.reduce_scatter(grad_x, "tp", dim=0)
        elif pg.tp_size > 1:
            pg.all_reduce(grad_x, "tp")  # every rank's columns contributed to the replicated input
        return grad_x, grad_w.to(weight.dtype), None, None, None, None, None


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               pg: ProcessGroups, vocab_size: int, sequence_parallel: bool = False,
                               rows: int | None = None) -> torch.Tensor:
    """Per-token loss [s, b] of the output layer ``weight`` [v_pad/tp, h] applied to the final hidden
    states ``hidden`` [s, b, h] (or this rank's [s/tp, b, h] with sequence parallelism), against global
    target ids [s, b]; ``rows``: tokens per chunk (default: about CHUNK_ELEMENTS fp32 logits)."""
    rows = rows or chunk_rows(weight.shape[0])
    return _FusedLinearCrossEntropy.apply(hidden, weight, target, pg, vocab_size, sequence_parallel, rows)
