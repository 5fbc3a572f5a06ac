"""Attention over one block of keys, in fp32, for a softmax that spans several blocks.

A block's forward returns its output normalized within the block and the block's log-sum-exp; blocks
merge exactly by the log-sum-exp rule (``merge``). The backward recomputes a block's probabilities from
q, k and the final log-sum-exp (nothing of size s x s is kept between passes) and uses
delta = rowsum(dO * O), which holds with dropout too: dropout on normalized probabilities is linear.

Layout: q [b, g, rep, sq, d] (query heads grouped by their key/value head: GQA), k and v [b, g, 1, sk, d],
masks [b or 1, 1, 1, sq, sk] (True = may attend).
"""

from __future__ import annotations

import torch

from megalite import compat

# Blocks without dropout on the CPU run PyTorch's flash kernel for CPU (about 3x faster than the plain
# path, which stays the fallback and the reference; the tests run both). It returns the log-sum-exp the
# merge needs and its backward takes the final output and log-sum-exp, as the ring's backward does.
FUSED_CPU = True


def _fused(q: torch.Tensor, keep: torch.Tensor | None) -> bool:
    return FUSED_CPU and keep is None and q.device.type == "cpu" and compat.cpu_flash_attention() is not None


def _flat(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> tuple:
    """The kernel's layout: [b, heads, s, d] with K/V repeated per query head, the mask as an additive bias."""
    b, g, rep, sq, d = q.shape
    k, v = (t.expand(b, g, rep, t.shape[3], d).reshape(b, g * rep, t.shape[3], d) for t in (k, v))
    bias = None if mask is None else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(
        ~mask, float("-inf"))[:, :, 0]
    return q.reshape(b, g * rep, sq, d), k, v, bias


def allowed(qpos: torch.Tensor, kpos: torch.Tensor, segment_ids: torch.Tensor | None,
            causal: bool) -> torch.Tensor | None:
    """True where a query at global position qpos[i] may attend the key at kpos[j]: j not after i
    (``causal``) and the same document (``segment_ids`` [b, seq]); None when every pair may."""
    mask = (kpos[None, :] <= qpos[:, None])[None] if causal else None
    if segment_ids is not None:
        same = segment_ids[:, qpos, None] == segment_ids[:, None, kpos]
        mask = same if mask is None else mask & same
    return None if mask is None else mask[:, None, None]


def dropout_mask(shape: torch.Size, p: float, device: torch.device) -> torch.Tensor | None:
    """The keep-scale factor (0 or 1/(1-p)) of one block; drawn from the default generator, so the
    backward redraws the same masks by replaying the generator state the forward started from."""
    if p == 0.0:
        return None
    return (torch.rand(shape, device=device) >= p).float() / (1.0 - p)


def scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, g, rep, sq, d], lse [b, g, rep, sq]) of one block; a row with no allowed key gets out 0
    and lse -inf (it adds nothing when merged)."""
    if _fused(q, keep):
        qf, kf, vf, bias = _flat(q, k, v, mask)
        out, lse = compat.cpu_flash_attention()[0](qf, kf, vf, attn_mask=bias)
        lse = lse.reshape(q.shape[:4])
        if mask is not None:  # the kernel gives a row without allowed keys lse 0
            lse = lse.masked_fill(~mask.any(dim=-1), float("-inf"))
        return out.reshape(q.shape), lse
    s = scores(q, k, mask)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    total = p.sum(dim=-1, keepdim=True)
    lse = (m + torch.log(total)).squeeze(-1)
    p = p / total.clamp_min(torch.finfo(p.dtype).tiny)
    if keep is not None:
        p = p * keep
    return p @ v, lse


def merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """Fold one block into the running (out, lse) in place; ``lse`` must already be finite (the diagonal
    block, where every query sees itself, comes first)."""
    new = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(block_out * torch.exp(block_lse - new).unsqueeze(-1))
    lse.copy_(new)


def backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
             keep: torch.Tensor | None, lse: torch.Tensor, dout: torch.Tensor, out: torch.Tensor,
             delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the final ``out`` and ``lse`` of its rows and delta = rowsum(dout *
    out); dk and dv summed over the query heads of each group: [b, g, 1, sk, d]."""
    if _fused(q, keep):
        qf, kf, vf, bias = _flat(q, k, v, mask)
        dq, dk, dv = compat.cpu_flash_attention()[1](
            dout.reshape(qf.shape), qf, kf, vf, out.reshape(qf.shape), lse.reshape(qf.shape[:3]), 0.0, False,
            attn_mask=bias)
        b, g, rep, sk, d = *q.shape[:3], k.shape[3], q.shape[4]
        return dq.reshape(q.shape), *(t.reshape(b, g, rep, sk, d).sum(dim=2, keepdim=True) for t in (dk, dv))
    p = torch.exp(scores(q, k, mask) - lse.unsqueeze(-1))
    dp = dout @ v.transpose(-1, -2)
    if keep is not None:
        dv = (p * keep).transpose(-1, -2) @ dout
        dp = dp * keep
    else:
        dv = p.transpose(-1, -2) @ dout
    ds = p * (dp - delta.unsqueeze(-1)) * q.shape[-1] ** -0.5
    dq = ds @ k
    dk = ds.transpose(-1, -2) @ q
    return dq, dk.sum(dim=2, keepdim=True), dv.sum(dim=2, keepdim=True)
