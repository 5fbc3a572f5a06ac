"""ProcessGroups: the torch.distributed groups of one rank, passed explicitly to whatever communicates.

There are no module-level groups: a layer holds the ProcessGroups it was built with, so the wrong group
cannot be picked up by accident and tests can hold several layouts. Every collective and every
point-to-point message of megalite goes through the methods here, which skip size-1 groups, use the flat
tensor collectives (``megalite.compat`` picks this torch's names for them: one path on NCCL and gloo) and count
the bytes each axis moves (checked against docs/design.md's formulas). Pipeline and context-parallel
ring messages are posted as batches (``post_p2p``), recorded on request for the NCCL replay checker (with the
collectives of their communicators), and, with ``MEGALITE_NCCL_SEMANTICS=1``, run with every collective under
NCCL's ordering rules on gloo (``nccl_emulation``); ``end_step`` marks where every batch must have been waited.
"""

from __future__ import annotations

import datetime
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple

import torch
import torch.distributed as dist

from megalite import compat, device
from megalite.parallel.layout import RankLayout
from megalite.parallel.nccl_check import Collective, EndStep, Op, Post, Sync, Wait


class Group(StrEnum):
    """The kinds of process group a rank belongs to (equal to their plain names: ``Group.TP == "tp"``)."""

    TP = "tp"  # tensor parallel
    DP = "dp"  # data parallel
    PP = "pp"  # pipeline stages (p2p and the last stage's broadcasts)
    MP = "mp"  # model parallel: tp x pp (found-inf and grad-norm reductions)
    CP = "cp"  # context parallel
    DP_CP = "dp_cp"  # data x context parallel
    TP_CP = "tp_cp"  # tensor x context parallel: the ranks holding parts of the same sequences
    CP_A2A = "cp_a2a"  # a2a+p2p: this rank's all-to-all group, consecutive CP ranks (--hierarchical-context-...)
    CP_RING = "cp_ring"  # a2a+p2p: its ring, the CP ranks with the same index in their all-to-all group
    EP = "ep"  # expert parallel: ranks holding different experts of a layer (tokens dispatched among them)
    ETP = "etp"  # expert tensor parallel: ranks splitting the same experts' hidden size
    EMP = "emp"  # expert model parallel: expert-TP x EP, the ranks one token's experts may live on
    EDP = "edp"  # expert data parallel: ranks holding the same expert shard (expert gradients reduced over it)
    EMBD = "embd"  # first and last pipeline stage: tied embedding gradients
    DP_INTRA = "dp_intra"  # this rank's DP group, the ranks on its node (--hierarchical-dp-reduce)
    DP_INTER = "dp_inter"  # this rank's DP group, one rank per node
    WORLD = "world"  # every rank (start-up checks, timers, exit agreement)


# Group kinds and the layout axes each varies over.
GROUP_AXES = {Group.TP: "tp", Group.DP: "dp", Group.PP: "pp", Group.MP: "tp-pp", Group.CP: "cp",
              Group.DP_CP: "cp-dp"}
# The expert layout's kinds (RankLayout.expert_groups) and, for layouts without expert parallelism (EP 1,
# expert-TP = TP), the plain kind each equals.
EXPERT_AXES = {Group.EP: "ep", Group.ETP: "etp", Group.EMP: "etp-ep", Group.EDP: "edp"}
EXPERT_ALIASES = {Group.EP: None, Group.ETP: Group.TP, Group.EMP: Group.TP, Group.EDP: Group.DP_CP}
NCCL_SEMANTICS_ENV = "MEGALITE_NCCL_SEMANTICS"


def _derived_groups(layout: RankLayout) -> dict[str, list[list[int]]]:
    """Every group of the kinds beyond GROUP_AXES that ``layout`` needs communicators for: TP x CP (when
    both are > 1), the expert layout (when it differs from the dense one) and, given hierarchical CP sizes,
    the all-to-all and ring sub-groups of CP that differ from CP itself (a size-1 one has no communicator)."""
    kinds: dict[str, list[list[int]]] = {}
    if layout.tp > 1 and layout.cp > 1:
        kinds[Group.TP_CP] = layout.groups("tp-cp")
    if layout.hierarchical_cp:
        a2a, ring = layout.cp_hierarchical_groups()
        if layout.cp_a2a < layout.cp:
            kinds[Group.CP_A2A] = a2a
        if layout.cp_ring < layout.cp:
            kinds[Group.CP_RING] = ring
    if layout.ep > 1 or layout.etp != layout.tp:
        kinds.update({k: layout.expert_groups(axes) for k, axes in EXPERT_AXES.items()})
    return kinds


def _alias_missing(pg: "ProcessGroups") -> None:
    """Fill the kinds ``_derived_groups`` left out with the plain group each equals in this layout: the
    same group object, so the same communicator (``comms``: NCCL orders their operations as one)."""
    if Group.TP_CP not in pg.ranks:
        same = Group.CP if pg.size(Group.TP) == 1 else Group.TP
        pg.ranks[Group.TP_CP], pg.groups[Group.TP_CP] = pg.ranks[same], pg.groups[same]
        pg.comms[Group.TP_CP] = pg.comms[same]
    for kind in (Group.CP_A2A, Group.CP_RING):  # the sub-group that is the whole CP group: CP's communicator
        if pg.layout.hierarchical_cp and kind not in pg.ranks:
            pg.ranks[kind], pg.groups[kind] = pg.ranks[Group.CP], pg.groups[Group.CP]
            pg.comms[kind] = pg.comms[Group.CP]
    for kind, same in EXPERT_ALIASES.items():
        if kind not in pg.ranks:
            pg.ranks[kind] = pg.ranks[same] if same else [pg.rank]
            pg.groups[kind] = pg.groups[same] if same else None
            pg.comms[kind] = pg.comms[same] if same else _comm_name(kind, [pg.rank])


@dataclass
class ProcessGroups:
    layout: RankLayout
    rank: int
    groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict)
    ranks: dict[str, list[int]] = field(default_factory=dict)
    # kind -> its communicator's name: one per group object, shared by the kinds aliased to it.
    comms: dict[str, str] = field(default_factory=dict)
    comm_bytes: Counter = field(default_factory=Counter)  # (axis, op) -> bytes handed to collectives
    # With hierarchical DP reduction: also "dp_intra" / "dp_inter" (this rank's DP group split by node).
    hierarchical_dp: bool = False
    # Set to a list to record every p2p batch, collective on a communicator that carries batches, wait, host
    # sync and step end (megalite.parallel.nccl_check replays it).
    p2p_log: list | None = None
    # MEGALITE_NCCL_SEMANTICS=1: all traffic under NCCL's ordering rules on gloo (nccl_emulation).
    emulation: object | None = None
    dry_run: bool = False  # no communicators (see ``unconnected``)

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def single(cls) -> "ProcessGroups":
        """A one-rank layout with no communication (tests, tools, the single-process run)."""
        layout = RankLayout(1)
        pg = cls(layout, 0)
        for kind in [*GROUP_AXES, Group.EMBD, Group.WORLD, Group.TP_CP, Group.CP_A2A, Group.CP_RING, *EXPERT_AXES]:
            pg._join(kind, [0], None)
        return pg

    @classmethod
    def unconnected(cls, layout: RankLayout, rank: int, record: bool = False) -> "ProcessGroups":
        """``rank``'s groups of ``layout`` without any communicator: enough to build a model on the meta
        device (layers read only the sizes). With ``record``, ``post_p2p`` records the batches (for the NCCL
        replay checker) and completes them at once, leaving receive buffers as they are; other
        communication raises."""
        pg = cls(layout, rank, p2p_log=[] if record else None, dry_run=True)
        for kind, axes in GROUP_AXES.items():
            pg._join(kind, layout.group_of(rank, axes), None)
        for ranks in layout.embedding_groups():  # middle pipeline stages belong to none
            if rank in ranks:
                pg._join(Group.EMBD, ranks, None)
        for kind, groups in _derived_groups(layout).items():
            pg._join(kind, next(g for g in groups if rank in g), None)
        pg._join(Group.WORLD, list(range(layout.world_size)), None)
        _alias_missing(pg)
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
        kinds[Group.EMBD] = layout.embedding_groups()
        if hierarchical_dp:  # pure arithmetic first: an uneven split raises on every rank before any new_group
            kinds[Group.DP_INTRA], kinds[Group.DP_INTER] = layout.dp_node_groups()
        kinds.update(_derived_groups(layout))
        for kind, all_groups in kinds.items():  # same order on every rank: new_group is collective
            for ranks in all_groups:
                group = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None
                if rank in ranks:
                    pg._join(kind, ranks, group)
        pg._join(Group.WORLD, list(range(layout.world_size)), dist.group.WORLD)
        _alias_missing(pg)
        if os.environ.get(NCCL_SEMANTICS_ENV, "0") == "1":
            from megalite.parallel.nccl_emulation import NcclEmulation

            pg.emulation = NcclEmulation(rank)
        return pg

    def _join(self, kind: str, ranks: list[int], group: dist.ProcessGroup | None) -> None:
        """This rank's group of ``kind``: its ranks, its group object and that object's communicator."""
        self.ranks[kind], self.groups[kind], self.comms[kind] = ranks, group, _comm_name(kind, ranks)

    # ---- coordinates --------------------------------------------------------------------------
    def size(self, kind: str) -> int:
        return len(self.ranks[kind])

    def index(self, kind: str) -> int:
        return self.ranks[kind].index(self.rank)

    tp_size = property(lambda self: self.size(Group.TP), doc="Ranks in this rank's tensor-parallel group.")
    tp_rank = property(lambda self: self.index(Group.TP), doc="This rank's position in its tensor-parallel group.")
    dp_size = property(lambda self: self.size(Group.DP), doc="Ranks in this rank's data-parallel group.")
    dp_rank = property(lambda self: self.index(Group.DP), doc="This rank's position in its data-parallel group.")
    pp_size = property(lambda self: self.size(Group.PP), doc="Pipeline stages.")
    pp_rank = property(lambda self: self.index(Group.PP), doc="This rank's pipeline stage.")
    cp_size = property(lambda self: self.size(Group.CP), doc="Ranks that split each sequence.")
    cp_rank = property(lambda self: self.index(Group.CP), doc="This rank's position in its context-parallel group.")
    ep_size = property(lambda self: self.size(Group.EP), doc="Ranks that split each MoE layer's experts.")
    ep_rank = property(lambda self: self.index(Group.EP), doc="This rank's position in its expert-parallel group.")
    etp_size = property(lambda self: self.size(Group.ETP), doc="Ranks that split each expert's hidden size.")
    etp_rank = property(lambda self: self.index(Group.ETP), doc="This rank's position in its expert-TP group.")

    def _hierarchical(self, kind: Group) -> Group:
        if kind not in self.ranks:
            raise RuntimeError(f"no {kind} group: these ProcessGroups were built without hierarchical "
                               "context-parallel sizes (--hierarchical-context-parallel-sizes)")
        return kind

    cp_a2a_size = property(lambda self: self.size(self._hierarchical(Group.CP_A2A)),
                           doc="a2a+p2p: ranks of this rank's all-to-all group (the first hierarchical size).")
    cp_a2a_rank = property(lambda self: self.index(self._hierarchical(Group.CP_A2A)),
                           doc="a2a+p2p: this rank's position in its all-to-all group (CP rank % a2a size).")
    cp_ring_size = property(lambda self: self.size(self._hierarchical(Group.CP_RING)),
                            doc="a2a+p2p: ranks of this rank's ring (the product of the other hierarchical sizes).")
    cp_ring_rank = property(lambda self: self.index(self._hierarchical(Group.CP_RING)),
                            doc="a2a+p2p: this rank's position in its ring (CP rank // a2a size).")

    @property
    def grad_kind(self) -> Group:
        """The group gradients are averaged (and the distributed optimizer's state sharded) over: DP, or
        DP x CP with context parallelism, where each CP rank's gradients come from its own tokens."""
        return Group.DP_CP if self.size(Group.CP) > 1 else Group.DP

    grad_size = property(lambda self: self.size(self.grad_kind), doc="Ranks of the gradient-reduction group.")
    grad_rank = property(lambda self: self.index(self.grad_kind), doc="This rank's index in it.")

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # ---- collectives: the only place megalite calls torch.distributed's communication -----------
    def _count(self, kind: str, op: str, tensor: torch.Tensor) -> None:
        self.comm_bytes[(str(kind), op)] += tensor.numel() * tensor.element_size()

    def _run(self, kind: str, fn, *args, async_op: bool = False, **kwargs) -> dist.Work | P2PWork | None:
        """Call a torch.distributed collective on group ``kind``. In NCCL-semantics mode every collective
        joins its communicator's ordered queue (behind that communicator's batches, as NCCL runs them);
        a collective on a communicator that carries batches is recorded for the replay checker."""
        index = self._record_collective(kind, fn)
        if self.dry_run:
            if index is None:
                raise RuntimeError(f"{fn.__name__} on the {kind} group of ProcessGroups built without communicators")
            work = P2PWork([], self.p2p_log, index, [])  # recorded only: completes at once
        elif self.emulation is not None:
            item = self.emulation.collective(self.comms[kind], self.ranks[kind], fn, args, kwargs, self.groups[kind])
            work = P2PWork([item], self.p2p_log, index, []) if index is not None else item
        else:
            if async_op:
                kwargs["async_op"] = True
            out = fn(*args, group=self.groups[kind], **kwargs)
            if index is None:
                return out
            work = P2PWork([out] if async_op else [], self.p2p_log, index, [])  # recorded on a real run
        return work if async_op else work.wait()

    def _record_collective(self, kind: str, fn) -> int | None:
        """Record a collective on a communicator that also carries batches (PP, CP and their aliases: the
        replay checker orders it among them); the index of its record, or None."""
        if self.p2p_log is None or self.comms[kind] not in {self.comms.get(k) for k in P2P_KINDS}:
            return None
        self.p2p_log.append(Collective(self.comms[kind], tuple(self.ranks[kind]), fn.__name__))
        return len(self.p2p_log) - 1

    def all_reduce(self, tensor: torch.Tensor, kind: str, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
                   async_op: bool = False, label: str = "all_reduce") -> torch.Tensor | dist.Work | None:
        """In-place all-reduce over group ``kind`` (a no-op on a one-rank group). With ``async_op`` the
        work handle is returned (None on a one-rank group) instead of the tensor."""
        if self.size(kind) == 1:
            return None if async_op else tensor
        self._count(kind, label, tensor)
        work = self._run(kind, dist.all_reduce, tensor, op=op, async_op=async_op)
        return work if async_op else tensor

    def all_gather_flat(self, out: torch.Tensor, shard: torch.Tensor, kind: str, async_op: bool = False,
                        label: str = "all_gather") -> dist.Work | None:
        """Every rank's ``shard`` into the flat ``out`` (n x its size, in group order); counts the bytes
        of ``out``."""
        return self._flat(compat.all_gather_into_tensor, out, shard, kind, out, async_op, label)

    def reduce_scatter_flat(self, out: torch.Tensor, data: torch.Tensor, kind: str, async_op: bool = False,
                            label: str = "reduce_scatter") -> dist.Work | None:
        """Sum the flat ``data`` over the group and keep this rank's 1/n part in ``out``; counts the bytes
        of ``data``."""
        return self._flat(compat.reduce_scatter_tensor, out, data, kind, data, async_op, label)

    def all_to_all_flat(self, out: torch.Tensor, data: torch.Tensor, kind: str, async_op: bool = False,
                        label: str = "all_to_all") -> dist.Work | None:
        """Rank j's i-th of n equal parts of the flat ``data`` lands as the j-th part of rank i's ``out``;
        counts the bytes of ``data`` (compressed gradient reduction)."""
        return self._flat(dist.all_to_all_single, out, data, kind, data, async_op, label)

    def _flat(self, fn, out: torch.Tensor, inp: torch.Tensor, kind: str, counted: torch.Tensor, async_op: bool,
              label: str) -> dist.Work | None:
        if self.size(kind) == 1:  # the one rank's part is the whole
            out.copy_(inp.reshape(out.shape))
            return None
        self._count(kind, label, counted)
        return self._run(kind, fn, out, inp.contiguous(), async_op=async_op)

    def all_gather(self, tensor: torch.Tensor, kind: str, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along ``dim``, in group order (counts the input's bytes)."""
        n = self.size(kind)
        if n == 1:
            return tensor
        tensor = tensor.contiguous()
        self._count(kind, "all_gather", tensor)
        out = torch.empty((n * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        self._run(kind, compat.all_gather_into_tensor, out, tensor)
        if dim % tensor.dim() == 0:
            return out
        return torch.cat(out.chunk(n, dim=0), dim=dim)

    def reduce_scatter(self, tensor: torch.Tensor, kind: str, dim: int = 0) -> torch.Tensor:
        """Sum over the group, then keep this rank's 1/n slice along ``dim`` (counts the input's bytes)."""
        n = self.size(kind)
        if n == 1:
            return tensor
        self._count(kind, "reduce_scatter", tensor)
        # along another dim, the chunks are stacked along dim 0 first: this rank's part keeps their layout
        data = tensor.contiguous() if dim % tensor.dim() == 0 else torch.cat(tensor.chunk(n, dim=dim), dim=0)
        out = torch.empty((data.shape[0] // n, *data.shape[1:]), dtype=data.dtype, device=data.device)
        self._run(kind, compat.reduce_scatter_tensor, out, data)
        return out

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, kind: str, label: str = "all_to_all") -> None:
        """Flat all-to-all: ``inp``'s i-th of n equal parts (dim 0) goes to the group's rank i, and ``out``'s
        j-th part comes from rank j; counts the bytes of ``inp`` (its own part included, like the other
        flat collectives)."""
        if self.size(kind) == 1:
            out.copy_(inp.reshape(out.shape))
            return
        self._count(kind, label, inp)
        self._run(kind, dist.all_to_all_single, out, inp.contiguous())

    def all_to_all_v(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     kind: str, label: str = "all_to_all") -> None:
        """All-to-all with uneven parts along dim 0: rows [sum(in_splits[:i]), +in_splits[i]) of ``inp`` go to
        the group's rank i; ``out`` receives out_splits[j] rows from rank j (MoE token dispatch). Counts the
        bytes of ``inp``."""
        if self.size(kind) == 1:
            out.copy_(inp)
            return
        self._count(kind, label, inp)
        self._run(kind, dist.all_to_all_single, out, inp.contiguous(), output_split_sizes=list(out_splits),
                  input_split_sizes=list(in_splits))

    def broadcast(self, tensor: torch.Tensor, kind: str, src_index: int = 0) -> torch.Tensor:
        if self.size(kind) > 1:
            self._count(kind, "broadcast", tensor)
            self._run(kind, dist.broadcast, tensor, src=self.ranks[kind][src_index])
        return tensor

    def barrier(self) -> None:
        if self.layout.world_size > 1:
            self._run(Group.WORLD, dist.barrier)

    def all_gather_object(self, obj: object, kind: str = Group.WORLD) -> list:
        """Every rank's picklable ``obj``, in group order (start-up checks only: it syncs the host)."""
        if self.size(kind) == 1:
            return [obj]
        out: list = [None] * self.size(kind)
        self._run(kind, dist.all_gather_object, out, obj)
        return out

    # ---- point to point (pipeline, context-parallel ring): docs/parallelism.md, "Pipeline messages" --
    def post_p2p(self, ops: Sequence[P2POp], where: str = "", batched: bool = True,
                 kind: str = Group.PP) -> P2PWork:
        """Post ``ops`` (toward ranks of group ``kind``, by index there: the pipeline, or a CP ring)
        together as one batch on that group's communicator, or (``batched=False``, one op only) alone on
        the pair's communicator. Sends are counted under (kind, "send")."""
        if kind not in P2P_KINDS:
            names = ", ".join(P2P_KINDS[:-1]) + f" or {P2P_KINDS[-1]}"
            raise ValueError(f"point-to-point messages travel on the {names} group, not {kind}")
        peers = [self.ranks[kind][op.peer] for op in ops]
        for op in ops:
            if op.kind == "send":
                self._count(kind, "send", op.tensor)
        comm = self.comms[kind] if batched else \
            "pair:" + ",".join(map(str, sorted((self.rank, peers[0]))))
        index = None
        if self.p2p_log is not None:
            index = len(self.p2p_log)
            self.p2p_log.append(Post(comm, tuple(Op(o.kind, g, o.label, tuple(o.tensor.shape))
                                                 for o, g in zip(ops, peers)), where))
        if self.dry_run:
            works = []
        elif self.emulation is not None:
            works = [self.emulation.p2p(comm, ops, peers, self.groups[kind])]
        elif batched:
            works = dist.batch_isend_irecv([compat.p2p_op(o.kind == "send", o.tensor, g, self.groups[kind])
                                            for o, g in zip(ops, peers)])
        else:
            assert len(ops) == 1, "an unbatched post carries one operation"
            fn = dist.isend if ops[0].kind == "send" else dist.irecv
            works = [fn(ops[0].tensor, peers[0], group=self.groups[kind])]
        return P2PWork(works, self.p2p_log, index, [o.tensor for o in ops])

    def host_sync(self, where: str = "") -> None:
        """Synchronise the host with the device (and, emulating NCCL, with every posted p2p batch)."""
        if self.p2p_log is not None:
            self.p2p_log.append(Sync(where))
        if self.emulation is not None:
            self.emulation.drain()
        device.synchronize()

    def end_step(self, where: str = "step") -> None:
        """The end of a step (the pipeline's pass, a training iteration): every batch posted so far must
        have been waited on (or seen completed). Emulating NCCL, a batch left pending is reported, and the
        order this rank issued the step's operations in is compared with its peers' (operations of two
        communicators issued in different orders on two ranks can deadlock NCCL)."""
        if self.p2p_log is not None:
            self.p2p_log.append(EndStep(where))
        if self.emulation is not None:
            self.emulation.end_step(where)


# Groups whose ranks exchange point-to-point batches: the pipeline stages and the context-parallel ring (the
# whole CP group's, or a2a+p2p's ring over CP_RING).
P2P_KINDS = (Group.PP, Group.CP, Group.CP_RING)


def _comm_name(kind: str, ranks: Sequence[int]) -> str:
    """The name of group ``kind``'s communicator (batches and collectives share it under NCCL)."""
    return f"{kind}:" + ",".join(map(str, ranks))


class P2POp(NamedTuple):
    """One point-to-point message: ``kind`` "send" or "recv", the tensor (the receive buffer), the peer's
    index in the group the batch is posted on (PP, CP or CP_RING), and what the message is (for the checkers'
    reports; NCCL itself sees no label)."""

    kind: str
    tensor: torch.Tensor
    peer: int
    label: str = ""


class P2PWork:
    """The handle of one posted batch (or recorded collective). ``wait`` waits for the whole batch (NCCL
    completes a batch as one) and keeps the send buffers alive until then."""

    def __init__(self, works: list, log: list | None, index: int | None, tensors: list[torch.Tensor]) -> None:
        self.works, self.log, self.index, self.tensors = works, log, index, tensors
        self.waited = False

    def wait(self) -> None:
        if self.waited:
            return
        if self.log is not None:
            self.log.append(Wait(self.index))
        for w in self.works:
            w.wait()
        self.waited = True

    def is_completed(self) -> bool:
        """Whether the batch is known complete (a recorded-only batch is so once waited on)."""
        return self.waited or (bool(self.works) and all(w.is_completed() for w in self.works))
