"""Output layer fused with the vocab-parallel cross-entropy, in chunks of tokens (--cross-entropy-loss-fusion).

The unfused path builds this rank's logits [s, b, v/tp] in fp32 and keeps them (as the softmax) until
backward: with a large vocabulary that one tensor is the step's peak. Here the tokens (s*b, flattened)
are processed in chunks, and a chunk's logits exist only while that chunk is processed.

The gradient wrt token n's logits is g_n * D_n with D_n = softmax_n - onehot_n, where g_n (the upstream
gradient of that token's loss) is known only in backward. Forward therefore computes, per chunk,
D_c @ W (the hidden-state gradient up to g, [c, h]) and accumulates P = sum_n D_n^T x_n (the weight
gradient if every g_n were 1, [v/tp, h]): the same three GEMMs the unfused step runs. Backward scales:
grad_x = g * (D @ W) exactly, and grad_W = g0 * P + sum over the tokens whose g_n differs from the most
common value g0 of (g_n - g0) D_n^T x_n, recomputing the logits of those tokens only. A loss averaged over
tokens has one g0 for all tokens; a loss mask adds its masked tokens; arbitrary per-token weights
recompute every token (correct, one more GEMM).

Same rules as megalite/tensor_parallel/cross_entropy.py: padded vocabulary entries (ids >= vocab_size)
never take part, so the loss depends neither on the padding nor on the TP size. Soft-capping
(--final-logit-softcapping C) caps each chunk's logits to z = C * tanh(logits / C) and multiplies D by the
cap's derivative 1 - (z / C)^2 (a chunk-sized temporary), in forward and where backward recomputes a chunk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megalite.parallel.groups import Group, ProcessGroups
from megalite.tensor_parallel.cross_entropy import softcap_, softcap_derivative_
from megalite.tensor_parallel.weight_grad import weight_grad

# A chunk holds about CHUNK_ELEMENTS fp32 logits (64 MiB), and at least MIN_CHUNK_TOKENS tokens: below that
# the per-chunk accumulation of the [v/tp, h] weight gradient costs more than the chunk's GEMMs gain
# (bench/bench_fused_cross_entropy.py measures the step against the unfused one).
CHUNK_ELEMENTS = 1 << 24
MIN_CHUNK_TOKENS = 512


def chunk_rows(local_vocab: int) -> int:
    """Tokens per chunk for this rank's ``local_vocab`` logit columns."""
    return max(MIN_CHUNK_TOKENS, CHUNK_ELEMENTS // max(local_vocab, 1), 1)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, n_real: int, buf: torch.Tensor, cap: float | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits [c, v/tp] of one chunk (GEMM in the compute dtype), soft-capped when ``cap`` is set,
    padded columns at -inf, written into the reused fp32 buffer ``buf`` (a fresh large buffer per chunk
    costs its page faults each time); and the cap's derivative (None without a cap)."""
    logits = buf[: x.shape[0]]
    if weight.dtype == torch.float32:
        torch.matmul(x, weight.t(), out=logits)
    else:
        logits.copy_(x.matmul(weight.t()))
    derivative = None
    if cap is not None:
        softcap_(logits, cap)
        derivative = softcap_derivative_(logits.clone(), cap)
    if n_real < logits.shape[-1]:
        logits[:, n_real:] = float("-inf")
        if derivative is not None:
            derivative[:, n_real:] = 0.0
    return logits, derivative


def _softmax_minus_onehot(exp: torch.Tensor, sum_exp: torch.Tensor, local_target: torch.Tensor,
                          outside: torch.Tensor) -> torch.Tensor:
    """D = softmax - onehot of one chunk, in place on its exp(logits - global max) (onehot only where
    this rank owns the target)."""
    d = exp.mul_(sum_exp.reciprocal().unsqueeze(-1))
    minus_one = torch.full_like(sum_exp, -1.0).masked_fill_(outside, 0.0)
    return d.scatter_add_(-1, local_target.unsqueeze(-1), minus_one.unsqueeze(-1))


def _accumulate(out: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> None:
    """out (fp32) += d^T x, the GEMM in the compute dtype."""
    if out.dtype == d.dtype:
        out.addmm_(d.t(), x)
    else:
        out += d.t().matmul(x).float()


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, pg: ProcessGroups,
                vocab_size: int, sequence_parallel: bool, rows: int, with_grad: bool, cap: float | None
                ) -> torch.Tensor:
        # x [s, b, h] ([s/tp, b, h] with sequence parallelism), weight [v/tp, h], target [s, b] global ids.
        sp = sequence_parallel and pg.tp_size > 1
        flat = (pg.all_gather(x, Group.TP, dim=0) if sp else x).reshape(-1, x.shape[-1])
        local_v, n = weight.shape[0], flat.shape[0]
        n_real = min(max(vocab_size - pg.tp_rank * local_v, 0), local_v)
        local_target = target.reshape(-1) - pg.tp_rank * local_v
        outside = (local_target < 0) | (local_target >= local_v)
        local_target = local_target.masked_fill(outside, 0)
        global_max, sum_exp, loss = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3))
        grad_x_unit = torch.empty_like(flat) if with_grad else None  # D @ W
        grad_w_unit = torch.zeros(weight.shape, dtype=torch.float32, device=x.device) if with_grad else None
        buf = torch.empty(min(rows, n), local_v, dtype=torch.float32, device=x.device)
        for lo in range(0, n, rows):
            r = slice(lo, min(lo + rows, n))
            logits, derivative = _chunk_logits(flat[r], weight, n_real, buf, cap)
            m = logits.amax(dim=-1)  # -inf on a rank holding only padding; the MAX over TP is finite
            pg.all_reduce(m, Group.TP, op=dist.ReduceOp.MAX)
            target_logit = logits.gather(-1, local_target[r].unsqueeze(-1)).squeeze(-1).sub_(m)
            exp = logits.sub_(m.unsqueeze(-1)).exp_()
            stats = torch.stack([exp.sum(dim=-1), target_logit.masked_fill_(outside[r], 0.0)])
            pg.all_reduce(stats, Group.TP)  # exp-sum, target logit (only its owner contributes)
            global_max[r], sum_exp[r] = m, stats[0]
            loss[r] = stats[0].log() - stats[1]
            if with_grad:
                d = _softmax_minus_onehot(exp, stats[0], local_target[r], outside[r])
                d = (d if derivative is None else d.mul_(derivative)).to(weight.dtype)
                torch.matmul(d, weight, out=grad_x_unit[r])
                _accumulate(grad_w_unit, d, flat[r])
        ctx.pg, ctx.vocab_size, ctx.sp, ctx.rows, ctx.cap = pg, vocab_size, sp, rows, cap
        if with_grad:
            ctx.save_for_backward(x, weight, global_max, sum_exp, local_target, outside, grad_x_unit, grad_w_unit)
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        x, weight, global_max, sum_exp, local_target, outside, grad_x_unit, grad_w_unit = ctx.saved_tensors
        pg = ctx.pg
        g = grad_loss.reshape(-1).float()
        if grad_x_unit.dtype == torch.float32:
            grad_x = grad_x_unit.mul_(g.unsqueeze(-1))
        else:  # scale in fp32: g carries the fp16 loss scale, which alone may exceed the 16-bit range
            grad_x = (grad_x_unit.float() * g.unsqueeze(-1)).to(grad_x_unit.dtype)
        grad_w = weight_grad(weight, lambda: _weight_grad(ctx, g, weight, x, global_max, sum_exp, local_target,
                                                          outside, grad_w_unit), g, grad_w_unit)
        grad_x = grad_x.view(-1, *x.shape[1:])  # [s, b, h], the gathered sequence with SP
        if ctx.sp:
            grad_x = pg.reduce_scatter(grad_x, Group.TP, dim=0)
        elif pg.tp_size > 1:
            pg.all_reduce(grad_x, Group.TP)  # every rank's vocab columns contributed to the replicated input
        return grad_x, grad_w, None, None, None, None, None, None, None


def _weight_grad(ctx, g: torch.Tensor, weight: torch.Tensor, x: torch.Tensor, global_max: torch.Tensor,
                 sum_exp: torch.Tensor, local_target: torch.Tensor, outside: torch.Tensor,
                 grad_w_unit: torch.Tensor) -> torch.Tensor:
    """grad_W = g0 * P + the tokens whose upstream gradient differs from g0, their logits recomputed (W of a
    split backward, or the rest of an unsplit one)."""
    pg = ctx.pg
    g0 = g.mode().values if g.numel() else g.new_zeros(())
    grad_w = grad_w_unit.mul_(g0)
    redo = (g != g0).nonzero().squeeze(-1)  # the same on every TP rank (the loss is replicated there)
    if redo.numel():
        flat = (pg.all_gather(x, Group.TP, dim=0) if ctx.sp else x).reshape(-1, x.shape[-1])
        n_real = min(max(ctx.vocab_size - pg.tp_rank * weight.shape[0], 0), weight.shape[0])
        buf = torch.empty(min(ctx.rows, redo.numel()), weight.shape[0], dtype=torch.float32, device=x.device)
        for lo in range(0, redo.numel(), ctx.rows):
            idx = redo[lo:lo + ctx.rows]
            xs = flat[idx]
            logits, derivative = _chunk_logits(xs, weight, n_real, buf, ctx.cap)
            exp = logits.sub_(global_max[idx].unsqueeze(-1)).exp_()
            d = _softmax_minus_onehot(exp, sum_exp[idx], local_target[idx], outside[idx])
            if derivative is not None:
                d.mul_(derivative)
            _accumulate(grad_w, d.mul_((g[idx] - g0).unsqueeze(-1)).to(weight.dtype), xs)
    return grad_w.to(weight.dtype)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
                               pg: ProcessGroups, vocab_size: int, sequence_parallel: bool = False,
                               rows: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Per-token loss [s, b] of the output layer ``weight`` [v_pad/tp, h] applied to the final hidden
    states ``hidden`` [s, b, h] (or this rank's [s/tp, b, h] with sequence parallelism), against global
    target ids [s, b]; ``rows``: tokens per chunk (default: chunk_rows()); ``softcap``: the logits capped to
    C * tanh(logits / C) (--final-logit-softcapping)."""
    rows = rows or chunk_rows(weight.shape[0])
    with_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _FusedLinearCrossEntropy.apply(hidden, weight, target, pg, vocab_size, sequence_parallel, rows,
                                          with_grad, softcap)
