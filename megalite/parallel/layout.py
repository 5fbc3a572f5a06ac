"""Which global ranks form which group: pure arithmetic, no torch.distributed.

A layout is an order string such as "tp-cp-dp-pp": rank = sum(coord[axis] * stride[axis]) with the
leftmost axis varying fastest (stride 1). With ranks filled node by node, TP ranks are neighbours
(same node, NVLink) and PP is outermost (across nodes).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

AXES = ("tp", "cp", "dp", "pp")


@dataclass(frozen=True)
class RankLayout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: str = "tp-cp-dp-pp"
    local_world_size: int | None = None  # ranks per node; None = all on one node
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        denom = self.tp * self.pp * self.cp
        if denom <= 0 or self.world_size % denom:
            raise ValueError(f"world size {self.world_size} is not divisible by tp {self.tp} x pp {self.pp} "
                             f"x cp {self.cp}")
        object.__setattr__(self, "dp", self.world_size // denom)
        axes = self.order.split("-")
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"rank order '{self.order}' must be a permutation of {'-'.join(AXES)}")

    @property
    def axes(self) -> list[str]:
        return self.order.split("-")

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def strides(self) -> dict[str, int]:
        out, stride = {}, 1
        for axis in self.axes:
            out[axis] = stride
            stride *= self.size(axis)
        return out

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along every axis."""
        return {a: (rank // s) % self.size(a) for a, s in self.strides().items()}

    def rank_of(self, **coords: int) -> int:
        strides = self.strides()
        return sum(coords.get(a, 0) * strides[a] for a in self.axes)

    def groups(self, axes: str) -> list[list[int]]:
        """All groups that vary over ``axes`` (e.g. "tp", "dp", "tp-pp"), the others held fixed.

        Within a group, ranks are sorted by their position along the varying axes (leftmost fastest),
        which is also ascending rank order."""
        varying = [a for a in self.axes if a in axes.split("-")]
        fixed = [a for a in self.axes if a not in varying]
        out = []
        for fixed_coords in itertools.product(*(range(self.size(a)) for a in reversed(fixed))):
            base = dict(zip(reversed(fixed), fixed_coords))
            ranks = [self.rank_of(**base, **dict(zip(reversed(varying), v)))
                     for v in itertools.product(*(range(self.size(a)) for a in reversed(varying)))]
            out.append(sorted(ranks))
        return sorted(out)

    def group_of(self, rank: int, axes: str) -> list[int]:
        return next(g for g in self.groups(axes) if rank in g)

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of every pipeline (one rank when pp == 1)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    def node_of(self, rank: int) -> int:
        return rank // (self.local_world_size or self.world_size)

    def tp_crosses_nodes(self) -> bool:
        return any(len({self.node_of(r) for r in g}) > 1 for g in self.groups("tp"))

    def describe(self) -> str:
        """A table of groups per axis, with the node of each rank, for --print-layout."""
        lines = [f"world {self.world_size} = tp {self.tp} x cp {self.cp} x dp {self.dp} x pp {self.pp} "
                 f"(order {self.order}, {self.local_world_size or self.world_size} ranks per node)"]
        for name, axes in [("tp", "tp"), ("dp", "dp"), ("pp", "pp"), ("model-parallel", "tp-pp")]:
            for g in self.groups(axes):
                nodes = sorted({self.node_of(r) for r in g})
                lines.append(f"  {name:15s} ranks {g} on node(s) {nodes}")
        if self.tp_crosses_nodes():
            lines.append("  WARNING: a tensor-parallel group spans nodes; TP traffic will cross the network")
        return "\n".join(lines)
