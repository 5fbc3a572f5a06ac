"""``context_parallel_attention``: causal attention of this rank's zigzag rows over the whole sequence.

The one entry point the model calls; it checks the shapes and dispatches on the layer's ``--cp-comm-type``:
``p2p`` (ring, ``ring.py``), ``a2a`` (all-to-all, ``ulysses.py``), ``allgather`` (``all_gather.py``) or
``a2a+p2p`` (all-to-all inside groups, ring across them, ``hierarchical.py``), by the internal names
config/parallel.py normalised every spelling to. Every variant returns the rows of full-sequence causal
attention this rank holds, in its local order; with packed ``Documents`` attention stops at their boundaries.
The a2a variant runs the one-rank attention core on its full sequences, so it takes --attention-backend; the
others compute blockwise with the log-sum-exp merge (``attention/blocks.py``), whose kernel follows the device.
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

# --cp-comm-type, by its internal name (config/parallel.py: CP_COMM_TYPES)
COMM_TYPES = {"p2p": ring_attention, "a2a": a2a_attention, "allgather": all_gather_attention,
              "a2a+p2p": hierarchical_attention}
# the group whose ranks split the heads, for the comm types that split them
HEAD_SPLIT = {"a2a": (Group.CP, "--context-parallel-size"),
              "a2a+p2p": (Group.CP_A2A, "the first --hierarchical-context-parallel-sizes")}


def check_heads(comm_type: str, heads: int, groups: int, ways: int) -> None:
    """The all-to-all splits the local heads (and their query groups) ``ways`` ways: c for a2a, the
    all-to-all group's size for a2a+p2p (config/validate_cp.py refuses such a layout before it runs)."""
    if comm_type in HEAD_SPLIT and (heads % ways or groups % ways):
        raise ValueError(
            f"--cp-comm-type {comm_type} needs the attention heads ({heads}) and query groups ({groups}) of each "
            f"tensor-parallel rank divisible by {HEAD_SPLIT[comm_type][1]} {ways}; change --num-attention-heads / "
            f"--num-query-groups (or --tensor-model-parallel-size), or use --cp-comm-type p2p")


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
    if comm_type in HEAD_SPLIT:
        check_heads(comm_type, q.shape[1], k.shape[1], pg.size(HEAD_SPLIT[comm_type][0]))


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                               comm_type: str = "p2p", *, dropout_p: float = 0.0,
                               documents: Documents | None = None, backend: str = "auto",
                               softcap: float = 0.0) -> torch.Tensor:
    """Causal attention over global positions for this CP rank's rows.

    q [b, nq, s_local, d]; k, v [b, nkv, s_local, d] (nq a multiple of nkv), s_local = seq / c, the rank's
    two zigzag chunks (``zigzag_split``). ``documents``: the packed documents of the full sequences, the same
    on every CP rank; attention does not cross them (None: one document per sample). ``comm_type``: this
    layer's --cp-comm-type, by its internal name (``ParallelConfig.cp_comm_type`` after normalisation).
    ``backend``: --attention-backend, the kernel of the a2a variant's full-sequence attention.
    ``softcap``: --attn-logit-softcapping C (scores C·tanh(s/C) before masks and softmax; 0: none), which
    every variant applies (the blockwise ones in each block, a2a in its one-rank core).
    Returns [b, nq, s_local, d], the rows of full-sequence attention this rank holds."""
    cp = pg.size(Group.CP)
    _check(q, k, v, comm_type, pg, documents)
    if documents is None:
        documents = Documents.whole(q.shape[0], q.shape[2] * cp)
    if comm_type == "a2a":
        return a2a_attention(q, k, v, pg, documents, dropout_p, backend, softcap)
    return COMM_TYPES[comm_type](q, k, v, pg, documents, dropout_p, softcap)
