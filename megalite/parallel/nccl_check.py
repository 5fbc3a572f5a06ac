"""Replay recorded point-to-point traffic under NCCL's rules, without processes.

Every rank that records (``ProcessGroups.p2p_log``) writes what it posted, in program order:

- ``Post(comm, ops, where)``: a batch (or a single send/receive) on a communicator. PyTorch drives NCCL
  with one communicator per pair for single sends/receives and the group's communicator for batches;
- ``Collective(comm, ranks, name)``: a collective on a communicator that also carries batches (PP, CP): it
  runs in that communicator's order, and completes once every rank of the group has reached it;
- ``Wait(post)``: the rank needs that batch (or collective) complete before it goes on;
- ``Sync()``: a host synchronisation of the whole device (everything posted must complete);
- ``EndStep()``: the end of a step: every batch posted so far must have been waited on (or synchronised).

NCCL's rules as played here: tags do not exist; on each communicator a rank's operations run one after
another (an operation starts only once the previous one completed) unless posted together as one batch,
which progresses as one; a send completes only when the peer's matching receive has started, and the
k-th send from a to b on a communicator matches the k-th receive on b from a there, with equal shapes.
``replay`` reports the first mismatch, or the deadlock (each stuck rank, what it waits for and why); then a
batch nobody waited for by the end of a step (or of the log), and two ranks that issue operations of two
communicators they share in different orders (NCCL can deadlock when they run at once: ``order_conflict``,
which the emulation uses too).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


class Op(NamedTuple):
    kind: str  # "send" or "recv"
    peer: int  # global rank
    label: str  # what the message is (for reports only: NCCL does not see it)
    shape: tuple[int, ...]


class Post(NamedTuple):
    comm: str
    ops: tuple[Op, ...]
    where: str = ""


class Collective(NamedTuple):
    comm: str
    ranks: tuple[int, ...]  # the group's global ranks
    name: str  # all_reduce, broadcast, ... (equal on every rank, or NCCL mixes them up)
    where: str = ""


class Wait(NamedTuple):
    post: int  # index of the Post (or Collective) among this rank's events


class Sync(NamedTuple):
    where: str = ""


class EndStep(NamedTuple):
    where: str = ""


Event = Post | Collective | Wait | Sync | EndStep


class NcclCheckError(RuntimeError):
    """A recorded sequence that would deadlock or deliver the wrong message under NCCL."""


@dataclass
class _Item:
    rank: int
    post: Post  # a Collective is played as a Post of "collective" operations, one per other rank
    keys: list[tuple] = field(default_factory=list)  # (comm, src, dst, seq) per op; (comm, me, peer, seq)
    matched: set = field(default_factory=set)
    done: bool = False


def _op_text(o: Op) -> str:
    if o.kind == "collective":
        return f"{o.label} with rank {o.peer}"
    return f"{o.kind} {o.label} {'to' if o.kind == 'send' else 'from'} rank {o.peer} {list(o.shape)}"


def _describe(item: _Item, pending_only: bool = True) -> str:
    ops = [_op_text(o) for o, k in zip(item.post.ops, item.keys) if not pending_only or k not in item.matched]
    return f"[{'; '.join(ops)}] on {item.post.comm}" + (f" ({item.post.where})" if item.post.where else "")


def _as_post(rank: int, ev: Post | Collective) -> Post:
    if isinstance(ev, Post):
        return ev
    return Post(ev.comm, tuple(Op("collective", r, ev.name, ()) for r in ev.ranks if r != rank), ev.where)


def _partner(key: tuple, kind: str) -> tuple[tuple, str]:
    """The key under which the peer's side of an operation is filed."""
    if kind == "collective":
        comm, me, peer, seq = key
        return (comm, peer, me, seq), kind
    return key, "recv" if kind == "send" else "send"


class _Replay:
    def __init__(self, events: Sequence[Sequence[Event]]) -> None:
        self.events = events
        self.host = [0] * len(events)
        self.queues: dict[tuple[int, str], list[_Item]] = defaultdict(list)
        self.items: dict[tuple[int, int], _Item] = {}
        self.counts: dict[tuple, int] = defaultdict(int)
        self.by_key: dict[tuple, tuple[_Item, Op]] = {}

    def post(self, rank: int, index: int, ev: Post | Collective) -> None:
        item = _Item(rank, _as_post(rank, ev))
        seq = self.counts[(ev.comm, rank, "collective")]
        for op in item.post.ops:
            if op.kind == "collective":
                key = (ev.comm, rank, op.peer, seq)
            else:
                src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
                key = (ev.comm, src, dst, self.counts[(ev.comm, src, dst, op.kind)])
                self.counts[(ev.comm, src, dst, op.kind)] += 1
            item.keys.append(key)
            self.by_key[(key, op.kind)] = (item, op)
        if isinstance(ev, Collective):
            self.counts[(ev.comm, rank, "collective")] += 1
        self.items[(rank, index)] = item
        self.queues[(rank, ev.comm)].append(item)

    def host_step(self, rank: int) -> bool:
        """Advance ``rank``'s program as far as it can go; True if it moved."""
        moved = False
        evs = self.events[rank]
        while self.host[rank] < len(evs):
            ev = evs[self.host[rank]]
            if isinstance(ev, Wait) and not self.items[(rank, ev.post)].done:
                break
            if isinstance(ev, Sync) and any(not it.done for (r, _), q in self.queues.items() if r == rank for it in q):
                break
            if isinstance(ev, (Post, Collective)):
                self.post(rank, self.host[rank], ev)
            self.host[rank] += 1
            moved = True
        return moved

    def heads(self) -> list[_Item]:
        out = []
        for q in self.queues.values():
            head = next((it for it in q if not it.done), None)
            if head is not None:
                out.append(head)
        return out

    def match(self) -> bool:
        active = {id(it) for it in self.heads()}
        moved = False
        for item in self.heads():
            for op, key in zip(item.post.ops, item.keys):
                if key in item.matched:
                    continue
                other_key, other_kind = _partner(key, op.kind)
                other = self.by_key.get((other_key, other_kind))
                if other is None or id(other[0]) not in active:
                    continue
                _check_pair(key, op, other[1])
                item.matched.add(key)
                other[0].matched.add(other_key)
                moved = True
        for item in self.heads():
            if len(item.matched) == len(item.keys):
                item.done = True
                moved = True
        return moved

    def stuck_report(self) -> str:
        lines = []
        heads = {(it.rank, it.post.comm): it for it in self.heads()}
        for rank, evs in enumerate(self.events):
            if self.host[rank] == len(evs) and not any(r == rank for r, _ in heads):
                continue
            ev = evs[self.host[rank]] if self.host[rank] < len(evs) else None
            waits = ("waits for " + _describe(self.items[(rank, ev.post)], False)) if isinstance(ev, Wait) else \
                "waits in a device synchronisation" if isinstance(ev, Sync) else "has posted everything"
            blocked = [f"{c}: {_describe(it)}" for (r, c), it in heads.items() if r == rank]
            lines.append(f"  rank {rank} {waits}; its stream heads still need " + " | ".join(blocked))
        return "NCCL deadlock: no rank can progress\n" + "\n".join(lines)

    def run(self) -> None:
        while True:
            moved = any([self.host_step(r) for r in range(len(self.events))])
            while self.match():
                moved = True
            if not moved:
                break
        if any(not it.done for it in self.items.values()) or any(
                h < len(e) for h, e in zip(self.host, self.events)):
            raise NcclCheckError(self.stuck_report())


def _check_pair(key: tuple, op: Op, other: Op) -> None:
    """Raise when the two sides of a message (or of a collective) disagree on what it is."""
    if op.kind == "collective":
        if op.label != other.label:
            raise NcclCheckError(f"collective mismatch on {key[0]}: collective {key[3]} is {op.label} on rank "
                                 f"{key[1]} but {other.label} on rank {key[2]}")
        return
    send, recv = (op, other) if op.kind == "send" else (other, op)
    if send.shape != recv.shape or send.label != recv.label:
        raise NcclCheckError(
            f"message mismatch on {key[0]}: message {key[3]} from rank {key[1]} to rank {key[2]} is sent "
            f"as {send.label} {list(send.shape)} but received as {recv.label} {list(recv.shape)}")


def _check_waited(rank: int, events: Sequence[Event]) -> None:
    """Raise when a batch is neither waited on nor synchronised by the next step end (or the log's end):
    NCCL leaves it pending on its stream, behind which the communicator's later operations queue."""
    pending: dict[int, Post] = {}
    for i, ev in enumerate([*events, EndStep("end of the log")]):
        if isinstance(ev, Post):
            pending[i] = ev
        elif isinstance(ev, Wait):
            pending.pop(ev.post, None)
        elif isinstance(ev, Sync):
            pending.clear()
        elif isinstance(ev, EndStep) and pending:
            post = next(iter(pending.values()))
            ops = "; ".join(_op_text(o) for o in post.ops)
            raise NcclCheckError(f"rank {rank} reaches the step end ({ev.where}) without waiting for [{ops}] on "
                                 f"{post.comm}" + (f" ({post.where})" if post.where else "") +
                                 " (never waited on: NCCL leaves it pending)")


# ---- the order of issue across communicators ------------------------------------------------------------
# One rank's operations in issue order: (communicator, [(identity, text), ...]) per batch or collective; an
# identity names the same operation on every rank taking part in it.
IssueOrder = list[tuple[str, list[tuple[str, str]]]]


def order_conflict(first: IssueOrder, second: IssueOrder) -> tuple[str, str] | None:
    """Two operations on different communicators, both involving the two ranks, that ``first`` issues as
    (x, y) and ``second`` as (y, x): the first such pair (x, y), or None."""
    where = {ident: j for j, (_, ops) in enumerate(second) for ident, _ in ops}
    latest: dict[str, tuple[int, str]] = {}  # comm -> the latest position in ``second`` of first's ops so far
    for comm, ops in first:
        common = [(where[ident], ident) for ident, _ in ops if ident in where]
        for j, ident in common:
            for c, (k, earlier) in latest.items():
                if c != comm and k > j:
                    return earlier, ident
        for j, ident in common:
            if j > latest.get(comm, (-1, ""))[0]:
                latest[comm] = (j, ident)
    return None


def order_report(a: int, order_a: IssueOrder, b: int, order_b: IssueOrder, pair: tuple[str, str]) -> str:
    """The words for an ``order_conflict`` between rank a and rank b ("issue-order mismatch ...")."""
    text_a = {i: t for _, ops in order_a for i, t in ops}
    text_b = {i: t for _, ops in order_b for i, t in ops}
    x, y = pair
    return (f"issue-order mismatch between rank {a} and rank {b}: rank {a} issues {text_a[x]} before "
            f"{text_a[y]}, but rank {b} issues {text_b[y]} before {text_b[x]} (operations of two communicators "
            f"issued in different orders can deadlock NCCL)")


def _issue_orders(events: Sequence[Sequence[Event]]) -> list[IssueOrder]:
    """Every rank's batches and collectives as an IssueOrder."""
    orders = []
    for rank, evs in enumerate(events):
        counts: dict[tuple, int] = defaultdict(int)
        order: IssueOrder = []
        for ev in evs:
            if isinstance(ev, Collective):
                ident = f"{ev.comm} #{counts[ev.comm]}"
                counts[ev.comm] += 1
                order.append((ev.comm, [(ident, f"{ev.name} on {ev.comm}")]))
            elif isinstance(ev, Post):
                ops = []
                for o in ev.ops:
                    src, dst = (rank, o.peer) if o.kind == "send" else (o.peer, rank)
                    ops.append((f"{ev.comm} {src}>{dst} #{counts[(ev.comm, src, dst)]}", f"{_op_text(o)} on {ev.comm}"))
                    counts[(ev.comm, src, dst)] += 1
                order.append((ev.comm, ops))
        orders.append(order)
    return orders


def check_order(events: Sequence[Sequence[Event]]) -> None:
    """Raise when two ranks issue the operations of two communicators they share in different orders."""
    orders = _issue_orders(events)
    for a in range(len(orders)):
        for b in range(a + 1, len(orders)):
            pair = order_conflict(orders[a], orders[b])
            if pair is not None:
                raise NcclCheckError("NCCL " + order_report(a, orders[a], b, orders[b], pair))


def replay(events: Sequence[Sequence[Event]]) -> None:
    """Play every rank's recorded events under NCCL's rules; raise NcclCheckError on a deadlock, a
    mismatched message or a message never received; then on a batch never waited on by a step end, and on
    operations of two communicators issued in different orders by two ranks."""
    _Replay(events).run()
    for rank, evs in enumerate(events):
        _check_waited(rank, evs)
    check_order(events)
