"""``context_parallel_attention``: causal attention of this rank's zigzag rows over the whole sequence.

The one entry point the model calls; it checks the shapes and dispatches on the layer's ``--cp-comm-type``:
``p2p`` (ring, ``ring.py``), ``a2a`` (all-to-all, ``ulysses.py``), ``allgather`` (``all_gather.py``) or
``a2a+p2p`` (``hierarchical.py``). Every variant returns the rows of full-sequence causal attention this
rank holds, in its local order; with packed ``Documents`` attention stops at their boundaries.
"""

from __future__ import annotations

import torch

from megalite.attention import Documents
from megalite.context_parallel.all_gather import all_gather_attention
from megalite.context_parallel.hierarchical import hierarchical_attention
from megalite.context_parallel.ring import ring_attention
from megalite.context_parallel.ulysses import a2a_attention
from megalite.context_parallel.zigzag import check_divisible
from megalite.parallel.groups import Group, ProcessGroups

COMM_TYPES = {"p2p": ring_attention, "a2a": a2a_attention, "allgather": all_gather_attention,
              "a2a+p2p": hierarchical_attention}  # --cp-comm-type


def a2a_size(comm_type: str, pg: ProcessGroups) -> int:
    """The ranks an all-to-all splits the heads over: all of CP for a2a, the first level for a2a+p2p."""
    if comm_type == "a2a":
        return pg.size(Group.CP)
    return pg.size(Group.CP_A2A) if comm_type == "a2a+p2p" else 1


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm_type: str, pg: ProcessGroups,
           documents: Documents | None) -> None:
    cp = pg.size(Group.CP)
    if comm_type not in COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(COMM_TYPES)}")
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4 or q.shape[::2] != k.shape[::2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"q [b, nq, s, d] and k, v [b, nkv, s, d] expected, got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} query groups")
    check_divisible(q.shape[2] * cp, cp)
    if documents is not None and (documents.batch, documents.seq_length) != (q.shape[0], q.shape[2] * cp):
        raise ValueError(f"documents must cover [b, seq] = [{q.shape[0]}, {q.shape[2] * cp}] (the full sequence), "
                         f"got [{documents.batch}, {documents.seq_length}]")
    a = a2a_size(comm_type, pg)
    if q.shape[1] % a or k.shape[1] % a:  # validate() refuses these layouts before any group exists
        over = f"--context-parallel-size {a}" if comm_type == "a2a" else f"the a2a size {a}"
        raise ValueError(
            f"--cp-comm-type {comm_type} needs the attention heads ({q.shape[1]}) and query groups ({k.shape[1]}) "
            f"of each tensor-parallel rank divisible by {over}; change --num-attention-heads / "
            f"--num-query-groups (or --tensor-model-parallel-size), or use --cp-comm-type p2p")


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                               comm_type: str = "p2p", *, dropout_p: float = 0.0,
                               documents: Documents | None = None) -> torch.Tensor:
    """Causal attention over global positions for this CP rank's rows.

    q [b, nq, s_local, d]; k, v [b, nkv, s_local, d] (nq a multiple of nkv), s_local = seq / c, the rank's
    two zigzag chunks (``zigzag_split``). ``documents``: the packed documents of the full sequences, the same
    on every CP rank; attention does not cross them (None: one document per sample).
    Returns [b, nq, s_local, d], the rows of full-sequence attention this rank holds."""
    cp = pg.size(Group.CP)
    _check(q, k, v, comm_type, pg, documents)
    if documents is None:
        documents = Documents.whole(q.shape[0], q.shape[2] * cp)
    return COMM_TYPES[comm_type](q, k, v, pg, documents, dropout_p)
