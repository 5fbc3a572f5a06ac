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
             keep: torch.Tensor | None, lse: torch.Tensor, dout: torch.Tensor, delta: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block given the final ``lse`` and delta = rowsum(dout * out) of its rows;
    dk and dv summed over the query heads of each group: [b, g, 1, sk, d]."""
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
