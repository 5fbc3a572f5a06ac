"""NCCL's point-to-point semantics on gloo (``MEGALITE_NCCL_SEMANTICS=1``), so CPU runs prove what GPUs need.

NCCL differs from gloo in ways a gloo run never shows: it ignores tags (a pair's messages match in the
order they are posted), and a communicator runs its operations one after another unless they were posted
together as a batch. Here every communicator PyTorch would create for NCCL (a pair's for a single
send/receive, the group's for a batch, shared with that group's collectives) is one queue with a worker
thread that starts item k+1 only after item k completed; all messages of a communicator carry the same
gloo tag, so gloo matches them by order alone, as NCCL does. A send completes only when the receiver
has reached the matching receive (the receiver acknowledges each message), as NCCL's. Each message is
preceded by a small header (shape, dtype, label), which gloo would not check, so a receive that would
get another message is reported instead of reading wrong data.

A rank that waits too long publishes what it waits for through the store; a cycle of ranks each waiting
for the next to reach a message, with none of them moving between two looks, is reported as a deadlock
naming the ranks and the messages, so a wrong protocol fails fast instead of after the group timeout.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from megalite import compat

HEADER_BYTES = 256
CHECK_S = 1.0
REPORT_KEY = "megalite_nccl/deadlock"


class NcclSemanticsError(RuntimeError):
    """A message sequence that would deadlock, or deliver the wrong tensor, under NCCL."""


def _header(label: str, t: torch.Tensor) -> torch.Tensor:
    raw = json.dumps([label, list(t.shape), str(t.dtype)]).encode()[:HEADER_BYTES]
    return torch.tensor(list(raw.ljust(HEADER_BYTES, b" ")), dtype=torch.uint8)


def _read_header(h: torch.Tensor) -> tuple[str, list[int], str]:
    label, shape, dtype = json.loads(bytes(h.tolist()).decode().strip())
    return label, shape, dtype


class _Item:
    """One queue entry: a batch of p2p operations or a collective; ``done`` is set when it completed."""

    def __init__(self, owner: NcclEmulation, comm: str, ops: list, keys: list, run_collective=None) -> None:
        self.owner, self.comm, self.ops, self.keys, self.run_collective = owner, comm, ops, keys, run_collective
        self.pending = set(range(len(ops)))
        self.done = threading.Event()
        self.error: BaseException | None = None

    def describe(self) -> list[list]:
        return [[self.ops[i][0], self.ops[i][2], self.keys[i][3], self.ops[i][3]] for i in sorted(self.pending)]

    # the handle API the callers use
    def wait(self) -> None:
        self.owner.wait_for(self)

    def is_completed(self) -> bool:
        return self.done.is_set()


class NcclEmulation:
    """This rank's NCCL-like communicators: one ordered queue each, run by a worker thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.queues: dict[str, deque[_Item]] = {}
        self.cond = threading.Condition()
        self.counts: dict[tuple, int] = defaultdict(int)
        self.version = 0
        self.last_seen: dict | None = None
        self.store = compat.default_store()

    # ---- posting --------------------------------------------------------------------------------
    def _enqueue(self, item: _Item) -> _Item:
        with self.cond:
            if item.comm not in self.queues:
                self.queues[item.comm] = deque()
                threading.Thread(target=self._worker, args=(item.comm,), daemon=True).start()
            self.queues[item.comm].append(item)
            self.cond.notify_all()
        return item

    def p2p(self, comm: str, ops, peers: list[int], group) -> _Item:
        """Queue one batch of sends/receives (``ops``: P2POp, ``peers``: global ranks) on ``comm``."""
        entries, keys = [], []
        for op, peer in zip(ops, peers):
            src, dst = (self.rank, peer) if op.kind == "send" else (peer, self.rank)
            key = (comm, src, dst, op.kind)
            keys.append((comm, src, dst, self.counts[key]))
            self.counts[key] += 1
            entries.append((op.kind, op.tensor, peer, op.label or "message", group))
        return self._enqueue(_Item(self, comm, entries, keys))

    def collective(self, comm: str, ranks: list[int], fn, args: tuple, kwargs: dict, group) -> _Item:
        """Queue a collective of a group that also carries batches (PP, CP) behind those batches on the
        group's communicator ``comm``."""
        key = (comm, "collective")
        seq = self.counts[key]
        self.counts[key] += 1
        ops = [("collective", None, r, fn.__name__, group) for r in ranks if r != self.rank]
        keys = [(comm, min(self.rank, r), max(self.rank, r), seq) for r in ranks if r != self.rank]
        return self._enqueue(_Item(self, comm, ops, keys, run_collective=lambda: fn(*args, group=group, **kwargs)))

    # ---- the worker: one item at a time, in order -----------------------------------------------
    def _worker(self, comm: str) -> None:
        tag = 2 * (zlib.crc32(comm.encode()) % (1 << 20))  # data; tag + 1: acknowledgements
        while True:
            with self.cond:
                while not self.queues[comm]:
                    self.cond.wait()
                item = self.queues[comm][0]
            try:
                if item.run_collective is not None:
                    item.run_collective()
                    item.pending.clear()
                else:
                    self._run_batch(item, tag)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                item.error = e
            with self.cond:
                self.queues[comm].popleft()
                self.version += 1
            item.done.set()

    def _run_batch(self, item: _Item, tag: int) -> None:
        """Post every send at once; receive from each peer in its own thread, one message after another
        (header, then payload); return when every operation completed."""
        sends, chains = [], defaultdict(list)
        for i, (kind, tensor, peer, label, group) in enumerate(item.ops):
            if kind == "send":
                ack = torch.empty(1, dtype=torch.uint8)  # the receiver's word that it reached this receive
                sends.append((i, [dist.isend(_header(label, tensor), peer, group=group, tag=tag),
                                  dist.isend(tensor.contiguous(), peer, group=group, tag=tag),
                                  dist.irecv(ack, peer, group=group, tag=tag + 1)]))
            else:
                chains[peer].append(i)
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._recv_chain, args=(item, peer, ops, tag, errors), daemon=True)
                   for peer, ops in chains.items()]
        for t in threads:
            t.start()
        for i, works in sends:  # every send is posted: waiting on them in turn blocks no other
            for w in works:
                w.wait()
            self._complete(item, i)
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _recv_chain(self, item: _Item, peer: int, ops: list[int], tag: int, errors: list) -> None:
        try:
            for i in ops:
                _, buf, _, label, group = item.ops[i]
                header = torch.empty(HEADER_BYTES, dtype=torch.uint8)
                dist.irecv(header, peer, group=group, tag=tag).wait()
                got_label, shape, dtype = _read_header(header)
                if (got_label, shape, dtype) != (label, list(buf.shape), str(buf.dtype)):
                    scratch = torch.empty(shape, dtype=compat.dtype_named(dtype))
                    dist.irecv(scratch, peer, group=group, tag=tag).wait()  # let the sender finish, then fail
                    dist.isend(torch.ones(1, dtype=torch.uint8), peer, group=group, tag=tag + 1).wait()
                    raise NcclSemanticsError(
                        f"NCCL-semantics mismatch on {item.comm}: rank {self.rank} expects {label} "
                        f"{list(buf.shape)} {buf.dtype} as message {item.keys[i][3]} from rank {peer}, but rank "
                        f"{peer} sent {got_label} {shape} {dtype} there (NCCL matches messages by order, not tag)")
                dist.irecv(buf, peer, group=group, tag=tag).wait()
                dist.isend(torch.ones(1, dtype=torch.uint8), peer, group=group, tag=tag + 1).wait()
                self._complete(item, i)
        except BaseException as e:  # noqa: BLE001 - raised by the batch's worker
            errors.append(e)

    def _complete(self, item: _Item, i: int) -> None:
        with self.cond:
            item.pending.discard(i)
            self.version += 1

    # ---- waiting, with deadlock detection -------------------------------------------------------
    def wait_for(self, item: _Item) -> None:
        self._block(f"waits for {self._label(item)}", lambda: item.done.wait(CHECK_S))
        if item.error is not None:
            report = self._report()  # a peer that found the deadlock and left closes its connections
            if report:
                raise NcclSemanticsError(report) from item.error
            raise item.error

    def drain(self) -> None:
        """A host synchronisation of the device: every posted item must complete."""
        def all_done() -> bool:
            with self.cond:
                items = [it for q in self.queues.values() for it in q]
            return all(it.done.wait(CHECK_S) for it in items)
        self._block("waits in a device synchronisation", all_done)

    def _label(self, item: _Item) -> str:
        ops = [f"{k} {label} {'to' if k == 'send' else 'from'} rank {p}" for k, _, p, label, _ in item.ops]
        return f"[{'; '.join(ops)}] on {item.comm}"

    def _block(self, what: str, step) -> None:
        self.last_seen = None
        while not step():
            self._publish(what)
            self._check_cycle()
        self.store.set(f"megalite_nccl/{self.rank}", json.dumps({"v": -1}))

    def _publish(self, what: str) -> None:
        with self.cond:
            heads = [{"comm": c, "item": self._label(q[0]), "pending": q[0].describe()}
                     for c, q in self.queues.items() if q]
            state = {"v": self.version, "blocked": what, "heads": heads}
        self.store.set(f"megalite_nccl/{self.rank}", json.dumps(state))

    def _states(self) -> dict[int, dict]:
        world = dist.get_world_size()
        keys = [f"megalite_nccl/{r}" for r in range(world)]
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}

    def _report(self) -> str | None:
        return self.store.get(REPORT_KEY).decode() if self.store.check([REPORT_KEY]) else None

    def _check_cycle(self) -> None:
        """Raise when this rank is on a cycle of blocked ranks, each waiting for the next to reach a
        message it has not reached, and none moved since the previous look (or a peer found one)."""
        report = self._report()
        if report:
            raise NcclSemanticsError(report)
        states = {r: s for r, s in self._states().items() if s.get("v", -1) >= 0}
        edges = {r: _waits_on(r, s, states) for r, s in states.items()}
        cycle = _find_cycle(self.rank, edges)
        seen = {r: states[r]["v"] for r in cycle} if cycle else None
        if cycle and seen == self.last_seen:
            lines = [f"  rank {r} {states[r]['blocked']}; its queue heads: " +
                     " | ".join(h["item"] for h in states[r]["heads"]) for r in cycle]
            report = ("NCCL-semantics deadlock: ranks " + " -> ".join(map(str, cycle)) +
                      " each wait for the next\n" + "\n".join(lines))
            self.store.set(REPORT_KEY, report)
            time.sleep(2 * CHECK_S)  # the peers read the report before this rank leaves
            raise NcclSemanticsError(report)
        self.last_seen = seen


def _waits_on(rank: int, state: dict, states: dict[int, dict]) -> set[int]:
    """Ranks that ``rank`` waits for: peers of its pending head operations whose matching operation is
    not at the head of the peer's queue on the same communicator."""
    out = set()
    for head in state["heads"]:
        for kind, peer, seq, _ in head["pending"]:
            other = states.get(peer)
            if other is None:
                continue
            want = {"send": "recv", "recv": "send", "collective": "collective"}[kind]
            ready = any(h["comm"] == head["comm"] and any(k == want and p == rank and s == seq
                                                          for k, p, s, _ in h["pending"]) for h in other["heads"])
            if not ready:
                out.add(peer)
    return out


def _find_cycle(start: int, edges: dict[int, set[int]]) -> list[int] | None:
    """A cycle through ``start`` in the wait-for graph, as a list of ranks, or None."""
    path, seen = [start], {start}

    def visit(r: int) -> list[int] | None:
        for n in sorted(edges.get(r, ())):
            if n == start:
                return list(path)
            if n not in seen and n in edges:
                seen.add(n)
                path.append(n)
                found = visit(n)
                if found:
                    return found
                path.pop()
        return None
    return visit(start)
