"""ProcessGroups: the torch.distributed groups of one rank, passed explicitly to whatever communicates.

There are no module-level groups: a layer holds the ProcessGroups it was built with, so the wrong group
cannot be picked up by accident and tests can hold several layouts. Collectives go through the methods
here, which skip size-1 groups and count the bytes each axis moves (checked against DESIGN.md's formulas).
"""

from __future__ import annotations

import datetime
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megalite.parallel.layout import RankLayout

# Group kinds and the layout axes each varies over.
GROUP_AXES = {"tp": "tp", "dp": "dp", "pp": "pp", "mp": "tp-pp", "cp": "cp", "dp_cp": "cp-dp"}


@dataclass
class ProcessGroups:
    layout: RankLayout
    rank: int
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    comm_bytes: Counter = field(default_factory=Counter)  # (axis, op) -> bytes handed to collectives
    # With hierarchical DP reduction: also "dp_intra" / "dp_inter" (this rank's DP group split by node).
    hierarchical_dp: bool = False

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def single(cls) -> "ProcessGroups":
        """A one-rank layout with no communication (tests, tools, the single-process run)."""
        layout = RankLayout(1)
        pg = cls(layout, 0)
        for kind in [*GROUP_AXES, "embd"]:
            pg.ranks[kind], pg.groups[kind] = [0], None
        return pg

    @classmethod
    def build(cls, layout: RankLayout, rank: int, timeout_minutes: float = 10.0,
              hierarchical_dp: bool = False) -> "ProcessGroups":
        """Create every group of ``layout``; all ranks must call this with the same layout.

        ``hierarchical_dp``: also build each DP group's intra-node and inter-node subgroups (from the
        layout's ranks per node) for GradBuffer's hierarchical reduction."""
        if layout.world_size == 1:
            return cls.single()
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before building ProcessGroups")
        timeout = datetime.timedelta(minutes=timeout_minutes)
        pg = cls(layout, rank, hierarchical_dp=hierarchical_dp)
        kinds = {k: layout.groups(axes) for k, axes in GROUP_AXES.items()}
        kinds["embd"] = layout.embedding_groups()
        if hierarchical_dp:  # pure arithmetic first: an uneven split raises on every rank before any new_group
            kinds["dp_intra"], kinds["dp_inter"] = layout.dp_node_groups()
        for kind, all_groups in kinds.items():  # same order on every rank: new_group is collective
            for ranks in all_groups:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    pg.ranks[kind], pg.groups[kind] = ranks, group
        return pg

    # ---- coordinates --------------------------------------------------------------------------
    def size(self, kind: str) -> int:
        return len(self.ranks[kind])

    def index(self, kind: str) -> int:
        return self.ranks[kind].index(self.rank)

    @property
    def tp_size(self) -> int:
        return self.size("tp")

    @property
    def tp_rank(self) -> int:
        return self.index("tp")

    @property
    def dp_size(self) -> int:
        return self.size("dp")

    @property
    def dp_rank(self) -> int:
        return self.index("dp")

    @property
    def pp_size(self) -> int:
        return self.size("pp")

    @property
    def pp_rank(self) -> int:
        return self.index("pp")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ---- collectives --------------------------------------------------------------------------
    def _count(self, kind: str, op: str, tensor: torch.Tensor) -> None:
        self.comm_bytes[(kind, op)] += tensor.numel() * tensor.element_size()

    def all_reduce(self, tensor: torch.Tensor, kind: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
                   ) -> torch.Tensor:
        """In-place all-reduce over group ``kind``; a no-op on a one-rank group."""
        if self.size(kind) > 1:
            self._count(kind, "all_reduce", tensor)
            dist.all_reduce(tensor, op=op, group=self.groups[kind])
        return tensor

    def all_gather(self, tensor: torch.Tensor, kind: str, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in group order."""
        n = self.size(kind)
        if n == 1:
            return tensor
        tensor = tensor.contiguous()
        self._count(kind, "all_gather", tensor)
        parts = [torch.empty_like(tensor) for _ in range(n)]
        dist.all_gather(parts, tensor, group=self.groups[kind])
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, kind: str, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then keep this rank's 1/n slice along ``dim``."""
        n = self.size(kind)
        if n == 1:
            return tensor
        self._count(kind, "reduce_scatter", tensor)
        parts = [p.contiguous() for p in tensor.chunk(n, dim=dim)]
        out = torch.empty_like(parts[0])
        dist.reduce_scatter(out, parts, group=self.groups[kind])
        return out

    def broadcast(self, tensor: torch.Tensor, kind: str, src_index: int = 0) -> torch.Tensor:
        if self.size(kind) > 1:
            self._count(kind, "broadcast", tensor)
            dist.broadcast(tensor, src=self.ranks[kind][src_index], group=self.groups[kind])
        return tensor

    def isend(self, tensor: torch.Tensor, dst_index: int, tag: int) -> dist.Work:
        """Non-blocking send to the pipeline rank ``dst_index`` (position in this rank's PP group)."""
        self._count("pp", "send", tensor)
        return dist.isend(tensor.contiguous(), dst=self.ranks["pp"][dst_index], tag=tag)

    def irecv(self, tensor: torch.Tensor, src_index: int, tag: int) -> dist.Work:
        return dist.irecv(tensor, src=self.ranks["pp"][src_index], tag=tag)

    def barrier(self) -> None:
        if self.layout.world_size > 1:
            dist.barrier()
