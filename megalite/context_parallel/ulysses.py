"""All-to-all attention (``--cp-comm-type a2a``, the Ulysses scheme): trade the sequence split for a head split.

One all-to-all turns every rank's [b, heads, s/c, d] (its zigzag chunks, all heads) into [b, heads/c, s, d]
(all of the sequence, 1/c of the heads); ordinary causal attention runs on the full sequence, put back in
natural order; a second all-to-all returns the output to the sequence split. Q, K and V travel as one
packed all-to-all. The backward of an all-to-all is the reverse all-to-all (``_SeqToHeads``).
Needs the local attention heads and query groups divisible by c: each rank gets whole K/V heads with
their query heads (head h of c's i-th part uses K/V head h // rep of the same part).
"""

from __future__ import annotations

import torch

from megalite import compat
from megalite.context_parallel.zigzag import natural_order
from megalite.parallel.groups import Group, ProcessGroups


def seq_to_heads(x: torch.Tensor, pg: ProcessGroups, label: str) -> torch.Tensor:
    """[b, h, s/c, d] (this rank's chunks) -> [b, h/c, s, d] (the ranks' chunks in rank order)."""
    c = pg.size(Group.CP)
    b, h, s, d = x.shape
    send = x.reshape(b, c, h // c, s, d).transpose(0, 1).contiguous()  # part i: the heads rank i gets
    recv = torch.empty_like(send)  # part j: rank j's sequence chunks
    pg.all_to_all(recv, send, Group.CP, label)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def heads_to_seq(y: torch.Tensor, pg: ProcessGroups, label: str) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: [b, h/c, s, d] -> [b, h, s/c, d]."""
    c = pg.size(Group.CP)
    b, hc, s, d = y.shape
    send = y.reshape(b, hc, c, s // c, d).permute(2, 0, 1, 3, 4).contiguous()  # part i: rank i's chunks
    recv = torch.empty_like(send)  # part j: head part j
    pg.all_to_all(recv, send, Group.CP, label)
    return recv.transpose(0, 1).reshape(b, c * hc, s // c, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: ProcessGroups, label: str, inverse: bool) -> torch.Tensor:
        ctx.pg, ctx.label, ctx.inverse = pg, label, inverse
        return (heads_to_seq if inverse else seq_to_heads)(x, pg, label)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = seq_to_heads if ctx.inverse else heads_to_seq
        return back(grad.contiguous(), ctx.pg, ctx.label + " backward"), None, None, None


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                  segment_ids: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    c = pg.size(Group.CP)
    b, nq, s_local, d = q.shape
    nkv = k.shape[1]
    # pack per destination: rank i gets query heads part i, then K part i, then V part i
    parts = [t.reshape(b, c, t.shape[1] // c, s_local, d) for t in (q, k, v)]
    qkv = torch.cat(parts, dim=2).reshape(b, nq + 2 * nkv, s_local, d)
    full = _SeqToHeads.apply(qkv, pg, "all_to_all qkv", False)
    order = natural_order(s_local, c, q.device)
    full = full.index_select(2, order)  # the ranks' zigzag chunks back in sequence order
    qh, kh, vh = full.split([nq // c, nkv // c, nkv // c], dim=1)
    mask = None
    if segment_ids is not None:
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        mask = (same & torch.ones_like(same[0]).tril())[:, None]
    out = compat.sdpa(qh, kh, vh, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None)
    out = out.index_select(2, order.argsort())  # back to the ranks' chunks in rank order
    return _SeqToHeads.apply(out.contiguous(), pg, "all_to_all out", True)
