"""All-to-all attention (``--cp-comm-type a2a``, the Ulysses scheme): trade the sequence split for a head split.

One all-to-all turns every rank's [b, heads, s/c, d] (its zigzag chunks, all heads) into [b, heads/c, s, d]
(all of the sequence, 1/c of the heads); ordinary causal attention runs on the full sequence, put back in
natural order (inside each packed document when given: ``attention.core_attention``, no mask); a second
all-to-all returns the output to the sequence split. The full-sequence attention is the model's own
one-rank core, so it runs the kernel --attention-backend names. Q, K and V travel as one packed all-to-all. The
backward of an all-to-all is the reverse all-to-all (``_SeqToHeads``). Needs the local attention heads and
query groups divisible by c: each rank gets whole K/V heads with their query heads (head h of c's i-th
part uses K/V head h // rep of the same part). The same exchange over a sub-group of CP is the first level
of hierarchical CP (``hierarchical.py``).
"""

from __future__ import annotations

import torch

from megalite.attention import Documents, core_attention
from megalite.context_parallel.zigzag import natural_order
from megalite.parallel.groups import Group, ProcessGroups


def seq_to_heads(x: torch.Tensor, pg: ProcessGroups, label: str, kind: str = Group.CP) -> torch.Tensor:
    """[b, h, s, d] (this rank's positions) -> [b, h/a, a*s, d] (the group's positions in member order) over
    the a ranks of group ``kind``."""
    a = pg.size(kind)
    b, h, s, d = x.shape
    send = x.reshape(b, a, h // a, s, d).transpose(0, 1).contiguous()  # part i: the heads member i gets
    recv = torch.empty_like(send)  # part j: member j's positions
    pg.all_to_all(recv, send, kind, label)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // a, a * s, d)


def heads_to_seq(y: torch.Tensor, pg: ProcessGroups, label: str, kind: str = Group.CP) -> torch.Tensor:
    """The inverse of ``seq_to_heads``: [b, h/a, a*s, d] -> [b, h, s, d]."""
    a = pg.size(kind)
    b, ha, s, d = y.shape
    send = y.reshape(b, ha, a, s // a, d).permute(2, 0, 1, 3, 4).contiguous()  # part i: member i's positions
    recv = torch.empty_like(send)  # part j: head part j
    pg.all_to_all(recv, send, kind, label)
    return recv.transpose(0, 1).reshape(b, a * ha, s // a, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, pg: ProcessGroups, label: str, inverse: bool, kind: str) -> torch.Tensor:
        ctx.pg, ctx.label, ctx.inverse, ctx.kind = pg, label, inverse, kind
        return (heads_to_seq if inverse else seq_to_heads)(x, pg, label, kind)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = seq_to_heads if ctx.inverse else heads_to_seq
        return back(grad.contiguous(), ctx.pg, ctx.label + " backward", ctx.kind), None, None, None, None


def scatter_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups, kind: str = Group.CP
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v of this rank's positions, all heads -> the group's positions (member order), 1/a of the heads;
    one packed all-to-all (rank i gets query-head part i, then K part i, then V part i)."""
    a = pg.size(kind)
    b, nq, s, d = q.shape
    nkv = k.shape[1]
    parts = [t.reshape(b, a, t.shape[1] // a, s, d) for t in (q, k, v)]
    qkv = torch.cat(parts, dim=2).reshape(b, nq + 2 * nkv, s, d)
    full = _SeqToHeads.apply(qkv, pg, "all_to_all qkv", False, kind)
    qh, kh, vh = full.split([nq // a, nkv // a, nkv // a], dim=1)
    return qh, kh, vh


def gather_heads(out: torch.Tensor, pg: ProcessGroups, kind: str = Group.CP) -> torch.Tensor:
    """The inverse of ``scatter_heads`` for the attention output."""
    return _SeqToHeads.apply(out.contiguous(), pg, "all_to_all out", True, kind)


def a2a_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                  documents: Documents, dropout_p: float, backend: str = "auto", softcap: float = 0.0
                  ) -> torch.Tensor:
    """``backend``: --attention-backend, the kernel of the full-sequence attention (``core_attention``, which
    applies the logit cap ``softcap`` on every backend)."""
    c, s_local = pg.size(Group.CP), q.shape[2]
    qh, kh, vh = scatter_heads(q, k, v, pg)
    order = natural_order(s_local, c, q.device)
    qh, kh, vh = (t.index_select(2, order) for t in (qh, kh, vh))  # the ranks' zigzag chunks in sequence order
    out = core_attention(qh, kh, vh, dropout_p, backend, documents, softcap=softcap)
    out = out.index_select(2, order.argsort())  # back to the ranks' chunks in rank order
    return gather_heads(out, pg)
