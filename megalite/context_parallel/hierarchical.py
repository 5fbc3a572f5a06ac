"""a2a+p2p attention (``--cp-comm-type a2a+p2p``, hierarchical context parallelism): an all-to-all inside
each group of a consecutive CP ranks, then ring attention over the other c / a ranks.

The all-to-all runs on ``Group.CP_A2A`` (``pg.cp_a2a_size`` = a, the first
--hierarchical-context-parallel-sizes; ``pg.cp_a2a_rank`` = CP rank % a) and trades the sequence split for a
head split inside the group; the ring runs on ``Group.CP_RING`` (``pg.cp_ring_size`` = c / a; ``pg.cp_ring_rank``
= CP rank // a; batches posted with ``pg.post_p2p(ops, kind=Group.CP_RING)``). Each TP rank's heads and
query groups are divisible by a (config/validate_cp.py refuses a layout where they are not).
"""

from __future__ import annotations

import torch

from megalite.parallel.groups import ProcessGroups


def hierarchical_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pg: ProcessGroups,
                           segment_ids: torch.Tensor | None, dropout_p: float) -> torch.Tensor:
    """The rows of full-sequence causal attention this CP rank holds, as the other comm types return them."""
    raise NotImplementedError("a2a+p2p attention: in progress")
