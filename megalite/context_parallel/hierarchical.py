"""Hierarchical context parallelism (``--cp-comm-type a2a+p2p``): all-to-all inside a group, a ring across.

``--hierarchical-context-parallel-sizes a n``: the CP group of c = a x n ranks is cut into n all-to-all
groups of a consecutive CP ranks (inside a node) and a ring over the n members that share an index inside
their group. One all-to-all gives each rank its group's 2a zigzag chunks with 1/a of the heads
(``ulysses.scatter_heads``); the ring (``ring.py``) then passes those K/V around the n groups' ranks of the
same head part, each block cut into the pieces its chunks allow (causal, and per document); a second
all-to-all returns the output to the sequence split. The heads and query groups of each TP rank need only
divide by a, not by c: a GQA model with fewer query groups than CP ranks runs.
"""

from __future__ import annotations

import torch

from megalite.attention import Chunk, Documents
from megalite.context_parallel.ring import Ring, ring_over
from megalite.context_parallel.ulysses import gather_heads, scatter_heads
from megalite.context_parallel.zigzag import zigzag_chunks
from megalite.parallel.groups import Group, ProcessGroups


def group_chunks(g: int, a: int, c: int, s_local: int) -> list[Chunk]:
    """The chunks all-to-all group g holds after the exchange: its members' zigzag chunks, member order."""
    out: list[Chunk] = []
    for i in range(a):
        out += zigzag_chunks(g * a + i, c, s_local, local=i * s_local)
    return out


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                           documents: Documents, dropout_p: float, softcap: float = 0.0) -> torch.Tensor:
    """``softcap``: the logit cap the ring's blocks apply (--attn-logit-softcapping; 0: none)."""
    c, a, s_local = pg.size(Group.CP), pg.size(Group.CP_A2A), q.shape[2]
    qh, kh, vh = scatter_heads(q, k, v, pg, Group.CP_A2A)
    ring = Ring(pg, Group.CP_RING, lambda g: group_chunks(g, a, c, s_local))
    out = ring_over(qh, kh, vh, ring, documents, dropout_p, softcap)
    return gather_heads(out, pg, Group.CP_A2A)
