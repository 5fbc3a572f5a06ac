"""Start-up report of the rank layout: the --print-layout table and the topology warnings (rank 0).

The layout assumes launchers fill nodes with consecutive ranks (rank // LOCAL_WORLD_SIZE is the node).
That is what torchrun and Slurm's default block distribution do; ``srun --distribution=cyclic`` does
not, and then a "node-local" TP group would silently span hosts. So the ranks also compare where they
really run (torchrun's GROUP_RANK, Slurm's SLURM_NODEID, else the host name) with the layout.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable

import torch.distributed as dist

from megalite.parallel.groups import ProcessGroups
from megalite.parallel.layout import RankLayout


def node_id() -> str:
    """Where this process really runs: the launcher's node index, else the host name."""
    for var in ("GROUP_RANK", "SLURM_NODEID"):
        if var in os.environ:
            return f"{var}={os.environ[var]}"
    return socket.gethostname()


def placement_warnings(layout: RankLayout, node_ids: list[str]) -> list[str]:
    """Ranks the layout puts on one node that actually run on different nodes (pure)."""
    out = []
    for node in range(layout.num_nodes):
        ranks = [r for r in range(layout.world_size) if layout.node_of(r) == node]
        seen = {node_ids[r] for r in ranks}
        if len(seen) > 1:
            where = ", ".join(f"rank {r} on {node_ids[r]}" for r in ranks[:8])
            out.append(f"ranks {ranks[0]}-{ranks[-1]} form layout node {node} (rank // {layout.ranks_per_node}) "
                       f"but run on {len(seen)} different nodes ({where}): the launcher did not fill nodes with "
                       f"consecutive ranks (Slurm: use --distribution=block), so TP groups may cross nodes")
    return out


def announce_layout(pg: ProcessGroups, print_layout: bool = False,
                    say: Callable[[str], None] | None = None) -> list[str]:
    """Rank 0 prints the layout (with ``print_layout``) and every topology warning; returns the warnings.

    Collective over the default group when there is more than one rank (one small all-gather)."""
    say = say or (lambda s: print(s, flush=True))
    layout = pg.layout
    placement: list[str] = []
    if layout.world_size > 1 and dist.is_initialized():
        placement = placement_warnings(layout, pg.all_gather_object(node_id()))
    if pg.rank == 0:
        if print_layout:  # the table ends with the layout's own warnings
            say(layout.describe(hierarchical_dp=pg.hierarchical_dp))
            say("  ranks per node checked against where each rank runs: " + ("MISMATCH" if placement else "ok"))
        for w in (placement if print_layout else layout.warnings() + placement):
            say(f" WARNING: {w}")
    return layout.warnings() + placement
