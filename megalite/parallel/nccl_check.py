"""Replay recorded point-to-point traffic under NCCL's rules, without processes.

Every rank that records (``ProcessGroups.p2p_log``) writes what it posted, in program order:

- ``Post(comm, ops, where)``: a batch (or a single send/receive) on a communicator. PyTorch drives NCCL
  with one communicator per pair for single sends/receives and the group's communicator for batches;
- ``Wait(post)``: the rank needs that batch complete before it goes on;
- ``Sync()``: a host synchronisation of the whole device (everything posted must complete).

NCCL's rules as played here: tags do not exist; on each communicator a rank's operations run one after
another (an operation starts only once the previous one completed) unless posted together as one batch,
which progresses as one; a send completes only when the peer's matching receive has started, and the
k-th send from a to b on a communicator matches the k-th receive on b from a there, with equal shapes.
``replay`` reports the first mismatch, or the deadlock (each stuck rank, what it waits for and why).
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


class Wait(NamedTuple):
    post: int  # index of the Post among this rank's events


class Sync(NamedTuple):
    where: str = ""


Event = Post | Wait | Sync


class NcclCheckError(RuntimeError):
    """A recorded sequence that would deadlock or deliver the wrong message under NCCL."""


@dataclass
class _Item:
    rank: int
    post: Post
    keys: list[tuple] = field(default_factory=list)  # (comm, src, dst, seq) per op
    matched: set = field(default_factory=set)
    done: bool = False


def _describe(item: _Item, pending_only: bool = True) -> str:
    ops = [f"{o.kind} {o.label} {'to' if o.kind == 'send' else 'from'} rank {o.peer} {list(o.shape)}"
           for o, k in zip(item.post.ops, item.keys) if not pending_only or k not in item.matched]
    return f"[{'; '.join(ops)}] on {item.post.comm}" + (f" ({item.post.where})" if item.post.where else "")


class _Replay:
    def __init__(self, events: Sequence[Sequence[Event]]) -> None:
        self.events = events
        self.host = [0] * len(events)
        self.queues: dict[tuple[int, str], list[_Item]] = defaultdict(list)
        self.items: dict[tuple[int, int], _Item] = {}
        self.counts: dict[tuple, int] = defaultdict(int)
        self.by_key: dict[tuple, tuple[_Item, Op]] = {}

    def post(self, rank: int, index: int, ev: Post) -> None:
        item = _Item(rank, ev)
        for op in ev.ops:
            src, dst = (rank, op.peer) if op.kind == "send" else (op.peer, rank)
            seq_key = (ev.comm, src, dst, op.kind)
            key = (ev.comm, src, dst, self.counts[seq_key])
            self.counts[seq_key] += 1
            item.keys.append(key)
            self.by_key[(key, op.kind)] = (item, op)
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
            if isinstance(ev, Post):
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
                other = self.by_key.get((key, "recv" if op.kind == "send" else "send"))
                if other is None or id(other[0]) not in active:
                    continue
                send, recv = (op, other[1]) if op.kind == "send" else (other[1], op)
                if send.shape != recv.shape or send.label != recv.label:
                    raise NcclCheckError(
                        f"message mismatch on {key[0]}: message {key[3]} from rank {key[1]} to rank {key[2]} is sent "
                        f"as {send.label} {list(send.shape)} but received as {recv.label} {list(recv.shape)}")
                item.matched.add(key)
                other[0].matched.add(key)
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


def replay(events: Sequence[Sequence[Event]]) -> None:
    """Play every rank's recorded events under NCCL's rules; raise NcclCheckError on a deadlock, a
    mismatched message or a message never received."""
    _Replay(events).run()
