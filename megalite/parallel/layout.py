"""Which global ranks form which group: pure arithmetic, no torch.distributed.

A layout is an order string such as "tp-cp-dp-pp": rank = sum(coord[axis] * stride[axis]) with the
leftmost axis varying fastest (stride 1). With ranks filled node by node, TP ranks are neighbours
(same node, NVLink) and PP is outermost (across nodes).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

AXES = ("tp", "cp", "dp", "pp")


def split_cp_group(cp_ranks: list[int], a2a: int) -> tuple[list[list[int]], list[list[int]]]:
    """(all-to-all groups, ring groups) of one CP group (its ranks in CP order) for a2a+p2p: the a2a
    groups are ``a2a`` consecutive CP ranks (inside a node: CP is next to TP in the rank order), a ring
    group holds the CP ranks with the same index inside their a2a group (c / a2a of them). CP rank i is
    member i % a2a of a2a group i // a2a and member i // a2a of ring group i % a2a."""
    c = len(cp_ranks)
    if a2a <= 0 or c % a2a:
        raise ValueError(f"an all-to-all group of {a2a} ranks does not divide a context-parallel group of {c}")
    a2a_groups = [cp_ranks[i:i + a2a] for i in range(0, c, a2a)]
    return a2a_groups, [cp_ranks[j::a2a] for j in range(a2a)]


@dataclass(frozen=True)
class RankLayout:
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    order: str = "tp-cp-dp-pp"
    local_world_size: int | None = None  # ranks per node; None = all on one node
    ep: int = 1  # expert parallel: the ranks of a stage cut again as expert-TP x EP x expert-DP
    etp: int | None = None  # expert tensor parallel; None: tp
    # --hierarchical-context-parallel-sizes: the all-to-all group's size, then the ring's levels (product cp;
    # any sequence, kept as a tuple); None: not given, no sub-groups of CP
    hierarchical_cp: tuple[int, ...] | None = None
    dp: int = field(init=False)

    def __post_init__(self) -> None:
        denom = self.tp * self.pp * self.cp
        if denom <= 0 or self.world_size % denom:
            raise ValueError(f"world size {self.world_size} is not divisible by tp {self.tp} x pp {self.pp} "
                             f"x cp {self.cp}")
        object.__setattr__(self, "dp", self.world_size // denom)
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        stage = self.world_size // self.pp
        if self.ep * self.etp <= 0 or stage % (self.ep * self.etp):
            raise ValueError(f"expert parallel {self.ep} x expert tensor parallel {self.etp} does not divide the "
                             f"{stage} ranks of a pipeline stage")
        axes = self.order.split("-")
        if sorted(axes) != sorted(AXES):
            raise ValueError(f"rank order '{self.order}' must be a permutation of {'-'.join(AXES)}")
        if self.hierarchical_cp is not None:
            sizes = tuple(self.hierarchical_cp)
            object.__setattr__(self, "hierarchical_cp", sizes)
            if not sizes or math.prod(sizes) != self.cp or min(sizes) <= 0:
                raise ValueError(f"hierarchical context-parallel sizes {list(sizes)} do not multiply to cp {self.cp}")

    @classmethod
    def from_config(cls, parallel: Any, world_size: int, local_world_size: int | None = None) -> RankLayout:
        """The layout a run's parallel flags name over ``world_size`` ranks (``local_world_size`` per node):
        the one place that maps ParallelConfig's fields to the layout's, by name. ``parallel`` is a
        config/parallel.py ParallelConfig, read by its fields (parallel/ sits below config/)."""
        p = parallel
        return cls(world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                   cp=p.context_parallel_size, order=p.layout_order, local_world_size=local_world_size,
                   ep=p.expert_model_parallel_size, etp=p.expert_tensor_parallel_size,
                   hierarchical_cp=p.hierarchical_context_parallel_sizes)

    @property
    def cp_a2a(self) -> int:
        """Ranks of an a2a+p2p all-to-all group (the first hierarchical size; cp without them)."""
        return self.hierarchical_cp[0] if self.hierarchical_cp else self.cp

    @property
    def cp_ring(self) -> int:
        """Ranks of an a2a+p2p ring: the product of the other hierarchical sizes (1 without them)."""
        return self.cp // self.cp_a2a

    def cp_hierarchical_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(every all-to-all group, every ring group) of every CP group (``split_cp_group``), sorted."""
        a2a, ring = [], []
        for g in self.groups("cp"):
            parts = split_cp_group(g, self.cp_a2a)
            a2a += parts[0]
            ring += parts[1]
        return sorted(a2a), sorted(ring)

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

    # ---- experts ---------------------------------------------------------------------------------
    def expert_coords(self, rank: int) -> dict[str, int]:
        """``rank``'s expert-TP, EP and expert-DP index: its position among its stage's ranks (ascending),
        split with expert-TP fastest, then EP, then expert-DP (Megatron's expert layout)."""
        stage = self.coords(rank)["pp"]
        return self._expert_split(self.stage_ranks(stage).index(rank))

    def _expert_split(self, i: int) -> dict[str, int]:
        """Expert coordinates of the i-th rank (ascending) of a stage."""
        return {"etp": i % self.etp, "ep": (i // self.etp) % self.ep, "edp": i // (self.etp * self.ep)}

    def stage_ranks(self, stage: int) -> list[int]:
        return sorted(r for r in range(self.world_size) if self.coords(r)["pp"] == stage)

    def expert_groups(self, axes: str) -> list[list[int]]:
        """All groups of the expert layout varying over ``axes`` (of "etp", "ep", "edp"), within a stage."""
        varying = axes.split("-")
        out: dict[tuple, list[int]] = {}
        for stage in range(self.pp):  # each stage's ranks listed once (per-rank lookups made this world^2)
            for i, r in enumerate(self.stage_ranks(stage)):
                c = self._expert_split(i)
                out.setdefault((stage, *(v for a, v in sorted(c.items()) if a not in varying)), []).append(r)
        return sorted(out.values())

    def embedding_groups(self) -> list[list[int]]:
        """First and last pipeline stage of every pipeline (one rank when pp == 1)."""
        return [sorted({g[0], g[-1]}) for g in self.groups("pp")]

    # ---- nodes ----------------------------------------------------------------------------------
    @property
    def ranks_per_node(self) -> int:
        return self.local_world_size or self.world_size

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def node_of(self, rank: int) -> int:
        """Launchers fill nodes in rank order: global rank = node * ranks per node + local rank."""
        return rank // self.ranks_per_node

    def nodes_of(self, ranks: list[int]) -> list[int]:
        return sorted({self.node_of(r) for r in ranks})

    def tp_crosses_nodes(self) -> bool:
        return any(len(self.nodes_of(g)) > 1 for g in self.groups("tp"))

    def dp_node_groups(self) -> tuple[list[list[int]], list[list[int]]]:
        """(intra-node, inter-node) subgroups of every DP group, for the hierarchical gradient reduction.

        A DP group with k members on each of n nodes splits into n intra-node groups of k ranks and k
        inter-node groups of n ranks (the ranks with the same position inside their node). DP index
        d = node position * k + position inside the node, because nodes hold consecutive ranks.
        Raises ValueError when the nodes hold unequal numbers of a DP group's ranks."""
        intra, inter = [], []
        for g in self.groups("dp"):
            per_node: dict[int, list[int]] = {}
            for r in g:
                per_node.setdefault(self.node_of(r), []).append(r)
            sizes = {len(v) for v in per_node.values()}
            if len(sizes) != 1:
                counts = ", ".join(f"{len(v)} on node {n}" for n, v in per_node.items())
                raise ValueError(f"data-parallel group {g} has {counts}: hierarchical reduction needs the same "
                                 f"number of its ranks on every node ({self.ranks_per_node} ranks per node)")
            parts = list(per_node.values())
            intra += parts
            inter += [list(col) for col in zip(*parts)]
        return sorted(intra), sorted(inter)

    def warnings(self) -> list[str]:
        """What is legal but slow about this layout on these nodes (printed by rank 0 at start-up)."""
        out = []
        if self.world_size % self.ranks_per_node:
            out.append(f"world size {self.world_size} is not a multiple of {self.ranks_per_node} ranks per node")
        if self.tp_crosses_nodes():
            bad = next(g for g in self.groups("tp") if len(self.nodes_of(g)) > 1)
            out.append(f"tensor-parallel group {bad} spans nodes {self.nodes_of(bad)}: TP all-reduces (4 per "
                       f"layer and micro-batch) will cross the network. Keep --tensor-model-parallel-size "
                       f"({self.tp}) a divisor of the ranks per node ({self.ranks_per_node}).")
        return out

    def describe(self, limit: int | None = 16, hierarchical_dp: bool = False) -> str:
        """Which ranks form which group, on which node, for --print-layout and tools/show_layout.py.

        ``limit``: nodes and groups listed per kind (None: all). Size-1 axes are left out."""
        n, per = self.num_nodes, self.ranks_per_node
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        lines = [f"rank layout: world {self.world_size} = tp {self.tp}{cp} x dp {self.dp} x pp {self.pp}, "
                 f"order {self.order} (leftmost varies fastest), {n} node(s) x {per} ranks",
                 "  rN[tT dD pP] = global rank N with tensor-, data- and pipeline-parallel index T, D, P"]
        for node in range(n if limit is None else min(n, limit)):
            ranks = range(node * per, min((node + 1) * per, self.world_size))
            lines.append(f"  node {node}: " + " ".join(self._cell(r) for r in ranks))
        if limit is not None and n > limit:
            lines.append(f"  ... ({n - limit} more nodes)")
        kinds = [("tp", self.groups("tp")), ("cp", self.groups("cp")), ("dp", self.groups("dp")),
                 ("pp", self.groups("pp")), ("model-parallel (tp x pp)", self.groups("tp-pp")),
                 ("embedding (first + last stage)", self.embedding_groups() if self.pp > 1 else [[0]])]
        if self.ep > 1 or self.etp != self.tp:
            kinds += [(f"expert-{name}", self.expert_groups(axes)) for name, axes in
                      (("parallel", "ep"), ("tensor-parallel", "etp"), ("data-parallel", "edp"))]
        if hierarchical_dp:
            intra, inter = self.dp_node_groups()
            kinds += [("dp intra-node", intra), ("dp inter-node", inter)]
        if self.hierarchical_cp:
            a2a, ring = self.cp_hierarchical_groups()
            kinds += [("cp all-to-all (a2a+p2p)", a2a), ("cp ring (a2a+p2p)", ring)]
        for name, groups in kinds:
            if len(groups[0]) == 1:
                continue
            lines.append(f"  {name} groups: {len(groups)} of {len(groups[0])} ranks")
            for g in groups[:limit]:
                nodes = self.nodes_of(g)
                where = f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes}"
                flag = "   <- crosses nodes" if name == "tp" and len(nodes) > 1 else ""
                lines.append(f"    ranks {g} on {where}{flag}")
            if limit is not None and len(groups) > limit:
                lines.append(f"    ... ({len(groups) - limit} more)")
        lines += [f"  WARNING: {w}" for w in self.warnings()]
        return "\n".join(lines)

    def _cell(self, rank: int) -> str:
        c = self.coords(rank)
        cp = f" c{c['cp']}" if self.cp > 1 else ""
        return f"r{rank}[t{c['tp']}{cp} d{c['dp']} p{c['pp']}]"
