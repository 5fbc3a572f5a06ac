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

Every collective, of any group, joins its communicator's queue too (a communicator is a group object:
kinds aliased to one share it) and is waited on here, so a rank blocked in a collective takes part in the
deadlock search like one blocked in a batch. On an idle communicator the posting thread issues it at once
(gloo's asynchronous form) and waits on gloo's handle itself, so the common case costs no thread hop; only
one thread ever waits on a handle (gloo copies a reduce-scatter's result out on each wait).

A rank that waits too long publishes what it waits for through the store (the queues its host waits on,
and each queue's head and contents); a cycle of hosts and queues each waiting for the next (a queue for
the peer queue or host that has not reached the matching operation), with none of their ranks moving
between two looks, is reported as a deadlock naming the ranks and the operations, so a wrong protocol
fails fast instead of after the group timeout. A rank blocked on one queue while another of its queues
waits for a slow peer is no cycle.

At each step end (``end_step``) a batch never waited on (nor seen completed) is reported, and the order
this rank issued the step's operations in is published; compared with each peer's (by whichever of the two
comes second), two operations of different communicators issued in opposite orders are reported, since
NCCL can deadlock on them when they run at once.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import itertools
import json
import threading
import time
import zlib
from collections import defaultdict, deque

import torch
import torch.distributed as dist

from megalite import compat
from megalite.parallel.nccl_check import IssueOrder, order_conflict, order_report

HEADER_BYTES = 256
CHECK_S = 1.0
WAIT_TIMEOUT = datetime.timedelta(seconds=CHECK_S)
REPORT_KEY = "megalite_nccl/deadlock"
ORDER_KEY = "megalite_nccl/order"
ORDER_STEPS_KEPT = 8  # step orders a rank keeps published (and checks against late peers)
_INSTANCES = itertools.count()  # emulations built in the same order on every rank name their step orders


class NcclSemanticsError(RuntimeError):
    """A message sequence that would deadlock, or deliver the wrong tensor, under NCCL."""


@functools.cache
def _takes_async_op(fn) -> bool:
    """Whether collective ``fn`` has an asynchronous form (all but the object collectives)."""
    return "async_op" in inspect.signature(fn).parameters


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
        self.collective = run_collective is not None
        self.pending = set(range(len(ops)))
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.settled = False  # waited on, or seen completed: nothing of it is left for the step end
        self.started = False  # taken to run (a collective on an idle queue is, at once, by the posting thread)
        self.direct = False  # a collective that gloo runs asynchronously (so it may be issued at once)
        self.work: dist.Work | None = None  # gloo's handle of a collective, once issued
        self.issued = False  # issued (or failed to be): its queue's worker sees it complete
        self.finished = False  # taken off its queue (by whichever of its waiters saw it complete first)
        self.waiter: int | None = None  # the one thread that waits on ``work`` (see NcclEmulation._claim)

    def describe(self) -> list[list]:
        return [[self.ops[i][0], self.ops[i][2], self.keys[i][3], self.ops[i][3]] for i in sorted(self.pending)]

    # the handle API the callers use
    def wait(self) -> None:
        self.owner.wait_for(self)

    def is_completed(self) -> bool:
        if not self.done.is_set() and self.work is not None and self.work.is_completed():
            self.owner._poll(self)  # completed in gloo: the wait (at once) hands over its result
        done = self.done.is_set()
        self.settled = self.settled or done  # seen completed: the caller may drop the handle
        return done


class NcclEmulation:
    """This rank's NCCL-like communicators: one ordered queue each, run by a worker thread."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.queues: dict[str, deque[_Item]] = {}
        self.cond = threading.Condition(threading.RLock())  # guards the queues; a completion may run inline
        self.wakeups: dict[str, threading.Condition] = {}  # per queue: wakes only that queue's worker
        self.counts: dict[tuple, int] = defaultdict(int)
        self.version = 0
        self.last_seen: dict | None = None
        self.store = compat.default_store()
        self.instance, self.step = next(_INSTANCES), 0
        self.issued: IssueOrder = []  # this step's batches and collectives, in issue order
        self.peers: set[int] = set()  # the ranks they involve
        self.unsettled: list[_Item] = []  # batches not yet waited on
        self.unchecked: dict[tuple[int, int], IssueOrder] = {}  # (step, peer) -> this rank's order then

    # ---- posting --------------------------------------------------------------------------------
    def _enqueue(self, item: _Item, ident: list[tuple[str, str]], peers: list[int]) -> _Item:
        self.issued.append((item.comm, ident))
        self.peers.update(peers)
        with self.cond:
            if item.comm not in self.queues:
                self.queues[item.comm] = deque()
                self.wakeups[item.comm] = threading.Condition(self.cond)
                threading.Thread(target=self._worker, args=(item.comm,), daemon=True).start()
            queue = self.queues[item.comm]
            now = item.started = item.direct and not queue  # an idle communicator starts it here: no thread hop
            queue.append(item)
            if not now:
                self.wakeups[item.comm].notify()
        if now:  # (not item.started: the worker may have started it meanwhile)
            self._start_collective(item)
        return item

    def p2p(self, comm: str, ops, peers: list[int], group) -> _Item:
        """Queue one batch of sends/receives (``ops``: P2POp, ``peers``: global ranks) on ``comm``."""
        entries, keys, ident = [], [], []
        for op, peer in zip(ops, peers):
            src, dst = (self.rank, peer) if op.kind == "send" else (peer, self.rank)
            key = (comm, src, dst, op.kind)
            keys.append((comm, src, dst, self.counts[key]))
            ident.append((f"{comm} {src}>{dst} #{self.counts[key]}", f"{op.kind} {op.label or 'message'} "
                          f"{'to' if op.kind == 'send' else 'from'} rank {peer} on {comm}"))
            self.counts[key] += 1
            entries.append((op.kind, op.tensor, peer, op.label or "message", group))
        item = self._enqueue(_Item(self, comm, entries, keys), ident, peers)
        if len(self.unsettled) >= 64:  # without step ends (a bare ring test), keep only what may be left
            self.unsettled = [it for it in self.unsettled if not it.settled]
        self.unsettled.append(item)
        return item

    def collective(self, comm: str, ranks: list[int], fn, args: tuple, kwargs: dict, group) -> _Item:
        """Queue a collective on its group's communicator ``comm``, behind what was posted there before
        (batches too, on the groups that carry them), as NCCL runs it."""
        key = (comm, "collective")
        seq = self.counts[key]
        self.counts[key] += 1
        others = [r for r in ranks if r != self.rank]
        ops = [("collective", None, r, fn.__name__, None) for r in others]
        keys = [(comm, min(self.rank, r), max(self.rank, r), seq) for r in others]
        modes, direct = (torch.is_grad_enabled(), torch.is_inference_mode_enabled()), _takes_async_op(fn)

        def issue() -> dist.Work | None:  # in the caller's autograd modes: it writes its output in place
            with torch.inference_mode(modes[1]), torch.set_grad_enabled(modes[0]):
                return fn(*args, group=group, async_op=True, **kwargs) if direct else fn(*args, group=group, **kwargs)
        item = _Item(self, comm, ops, keys, run_collective=issue)
        item.direct = direct
        return self._enqueue(item, [(f"{comm} #{seq}", f"{fn.__name__} #{seq} on {comm}")], others)

    def _start_collective(self, item: _Item) -> None:
        """Issue a queue's head collective (asynchronously when it can be). Whoever needs it complete
        first waits on it and takes it off the queue: the host (``_poll``), or the queue's worker once
        another item waits behind it."""
        issue, item.run_collective = item.run_collective, None  # the group is let go here, not in gloo's thread
        error = None
        try:
            work = issue()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            work, error = None, e
        with self.cond:
            item.work, item.issued = work, True
            if len(self.queues[item.comm]) > 1:
                self.wakeups[item.comm].notify()
        if work is None:  # failed, or ran synchronously (a collective without an asynchronous form)
            self._finish(item, error)

    def _claim(self, item: _Item) -> bool:
        """Whether this thread is (or now becomes) the one that waits on ``item``'s gloo handle: waiting on
        it twice would copy a reduce-scatter's result into its output again, after the caller used it."""
        with self.cond:
            if item.waiter is None:
                item.waiter = threading.get_ident()
            return item.waiter == threading.get_ident()

    def _await(self, item: _Item) -> None:
        """The worker's wait for an issued collective, unless the host waits on it (``_poll``)."""
        if item.work is None:  # finished at issue
            return
        if not self._claim(item):  # the host's to finish: the queue moves on after that
            item.done.wait()
            return
        error = None
        try:
            item.work.wait()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            error = e
        self._finish(item, error)

    def _finish(self, item: _Item, error: BaseException | None) -> None:
        """The head of ``item``'s queue completed: take it off and let the queue's next item start."""
        with self.cond:
            if item.finished:
                return
            item.finished, item.error = True, error
            item.pending.clear()
            queue = self.queues[item.comm]
            queue.popleft()
            self.version += 1
            if queue:
                self.wakeups[item.comm].notify()
        item.done.set()

    # ---- the worker: one item at a time, in order -----------------------------------------------
    def _worker(self, comm: str) -> None:
        tag = 2 * (zlib.crc32(comm.encode()) % (1 << 20))  # data; tag + 1: acknowledgements
        queue, wakeup = self.queues[comm], self.wakeups[comm]
        while True:
            with self.cond:
                while not queue or queue[0].started and (len(queue) == 1 or not queue[0].issued):
                    wakeup.wait()  # (a head the host started is the host's until another item waits behind it)
                item, start = queue[0], not queue[0].started
                item.started = True
            if item.collective:
                if start:
                    self._start_collective(item)
                self._await(item)
                continue
            error = None
            try:
                self._run_batch(item, tag)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
                error = e
            self._finish(item, error)

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
        self._block(f"waits for {self._label(item)}", lambda: self._poll(item), [item.comm])
        item.settled = True
        if item.error is not None:
            report = self._report()  # a peer that found the deadlock and left closes its connections
            if report:
                raise NcclSemanticsError(report) from item.error
            raise item.error

    def _poll(self, item: _Item) -> bool:
        """Wait up to CHECK_S for ``item``; on an issued collective, on gloo's handle itself (no thread hop)."""
        work = item.work
        if work is None or item.finished or not self._claim(item):
            return item.done.wait(CHECK_S)
        try:
            work.wait(timeout=WAIT_TIMEOUT)
        except RuntimeError as e:
            if not work.is_completed():  # not yet
                return False
            self._finish(item, e)
            return True
        self._finish(item, None)
        return True

    def drain(self) -> None:
        """A host synchronisation of the device: every posted item must complete."""
        def all_done() -> bool:
            with self.cond:
                items = [it for q in self.queues.values() for it in q]
            return all(self._poll(it) for it in items)
        self._block("waits in a device synchronisation", all_done)
        for it in self.unsettled:  # everything posted so far has completed
            it.settled = True

    # ---- the step end -----------------------------------------------------------------------------
    def end_step(self, where: str) -> None:
        """Report a batch posted and never waited on (nor seen completed); then publish this step's order
        of issue and compare it with the peers' that are published already."""
        try:
            report = self._report()
        except RuntimeError:  # the store is gone: its host finished the run
            report = None
        if report:
            raise NcclSemanticsError(report)
        left = [it for it in self.unsettled if not it.settled]
        self.unsettled = []
        if left:
            raise NcclSemanticsError(
                f"NCCL-semantics: rank {self.rank} reaches the step end ({where}) without waiting for "
                + " and ".join(self._label(it) for it in left) + " (never waited on: NCCL leaves it pending)")
        step, order, peers = self.step, self.issued, self.peers
        self.step, self.issued, self.peers = step + 1, [], set()
        try:
            published = self._exchange_order(step, order, peers)
        except RuntimeError:  # the store is gone (its host finished the run first): nothing to compare
            return
        for mine, peer, theirs in published:
            self._compare_order(mine, peer, theirs)

    def _order_key(self, step: int, rank: int) -> str:
        return f"{ORDER_KEY}/{self.instance}/{step}/{rank}"

    def _exchange_order(self, step: int, order: IssueOrder, peers: set[int]) -> list[tuple]:
        """Publish this step's order; return (this rank's order, peer, the peer's) for every step order
        of a peer published by now that this rank has not compared with yet."""
        self.store.set(self._order_key(step, self.rank), json.dumps(order))
        if step >= ORDER_STEPS_KEPT:
            self.store.delete_key(self._order_key(step - ORDER_STEPS_KEPT, self.rank))
        for peer in peers:
            self.unchecked[(step, peer)] = order
        out = []
        for (s, peer), mine in list(self.unchecked.items()):
            key = self._order_key(s, peer)
            if self.store.check([key]):
                del self.unchecked[(s, peer)]
                out.append((mine, peer, json.loads(self.store.get(key))))
            elif s <= step - ORDER_STEPS_KEPT:  # the peer is that far behind: its order is gone by now
                del self.unchecked[(s, peer)]
        return out

    def _compare_order(self, mine: IssueOrder, peer: int, theirs: IssueOrder) -> None:
        pair = order_conflict(mine, theirs)
        if pair is not None:
            report = "NCCL-semantics " + order_report(self.rank, mine, peer, theirs, pair)
            self.store.set(REPORT_KEY, report)  # the peer, past its step end already, hears of it when it waits
            raise NcclSemanticsError(report)

    def _label(self, item: _Item) -> str:
        ops = [f"{label} with rank {p}" if k == "collective" else f"{k} {label} {'to' if k == 'send' else 'from'} "
               f"rank {p}" for k, _, p, label, _ in item.ops]
        return f"[{'; '.join(ops)}] on {item.comm}"

    def _block(self, what: str, step, waits: list[str] | None = None) -> None:
        """Run ``step`` (a wait of at most CHECK_S) until it returns True; between tries, publish what
        this rank waits for (the queues of ``waits``, all when None) and look for a deadlock."""
        self.last_seen = None
        published = False
        while not step():
            self._publish(what, waits)
            published = True
            self._check_cycle()
        if published:  # a wait that ended at once never told anyone
            self.store.set(f"megalite_nccl/{self.rank}", json.dumps({"v": -1}))

    def _publish(self, what: str, waits: list[str] | None) -> None:
        """What this rank's host waits for (the queues of ``waits``: all when None) and, per queue, the
        head's pending operations and every operation queued."""
        with self.cond:
            queues = {c: q for c, q in self.queues.items() if q}
            heads = [{"comm": c, "item": self._label(q[0]), "pending": q[0].describe()} for c, q in queues.items()]
            queued = {c: [op for it in q for op in it.describe()] for c, q in queues.items()}
            state = {"v": self.version, "blocked": what, "waits": list(queues) if waits is None else waits,
                     "heads": heads, "queued": queued}
        self.store.set(f"megalite_nccl/{self.rank}", json.dumps(state))

    def _states(self) -> dict[int, dict]:
        world = dist.get_world_size()
        keys = [f"megalite_nccl/{r}" for r in range(world)]
        return {r: json.loads(self.store.get(k)) for r, k in enumerate(keys) if self.store.check([k])}

    def _report(self) -> str | None:
        return self.store.get(REPORT_KEY).decode() if self.store.check([REPORT_KEY]) else None

    def _check_cycle(self) -> None:
        """Raise when this rank's wait reaches a cycle of blocked hosts and queues, each waiting for the
        next, and none of their ranks moved since the previous look (or a peer found one)."""
        report = self._report()
        if report:
            raise NcclSemanticsError(report)
        states = {r: s for r, s in self._states().items() if s.get("v", -1) >= 0}
        cycle = _find_cycle(("host", self.rank), states) if self.rank in states else None
        ranks = list(dict.fromkeys(node[1] for node in cycle)) if cycle else []
        seen = {r: states[r]["v"] for r in {self.rank, *ranks}} if cycle else None
        if cycle and seen == self.last_seen:
            lines = [f"  rank {r} {states[r]['blocked']}; its queue heads: " +
                     " | ".join(h["item"] for h in states[r]["heads"]) for r in dict.fromkeys([*ranks, self.rank])]
            report = ("NCCL-semantics deadlock: ranks " + " -> ".join(map(str, ranks)) +
                      " each wait for the next\n" + "\n".join(lines))
            self.store.set(REPORT_KEY, report)
            time.sleep(2 * CHECK_S)  # the peers read the report before this rank leaves
            raise NcclSemanticsError(report)
        self.last_seen = seen


# The wait-for graph of blocked ranks: ("host", r) waits for the queues it waits on; ("queue", r, comm) for
# what its head's pending operations need: nothing when the peer's matching operation heads the peer's
# queue too, the peer's queue when the operation is queued there behind others, else the peer's host
# (which has not posted it). A rank not blocked publishes nothing and ends every path (it may yet move).
Node = tuple


def _matches(ops: list, kind: str, rank: int, seq: int) -> bool:
    want = {"send": "recv", "recv": "send", "collective": "collective"}[kind]
    return any(k == want and p == rank and s == seq for k, p, s, _ in ops)


def _edges(node: Node, states: dict[int, dict]) -> list[Node]:
    if node[0] == "host":
        return [("queue", node[1], c) for c in states[node[1]]["waits"]]
    _, rank, comm = node
    out: set[Node] = set()
    for head in (h for h in states[rank]["heads"] if h["comm"] == comm):
        for kind, peer, seq, _ in head["pending"]:
            other = states.get(peer)
            if other is None or any(h["comm"] == comm and _matches(h["pending"], kind, rank, seq)
                                    for h in other["heads"]):
                continue
            queued = _matches(other["queued"].get(comm, []), kind, rank, seq)
            out.add(("queue", peer, comm) if queued else ("host", peer))
    return sorted(out)


def _find_cycle(start: Node, states: dict[int, dict]) -> list[Node] | None:
    """A cycle of the wait-for graph reachable from ``start`` (this rank's host), as its nodes, or None."""
    path: list[Node] = []
    on_path: dict[Node, int] = {}
    finished: set[Node] = set()

    def visit(node: Node) -> list[Node] | None:
        on_path[node] = len(path)
        path.append(node)
        for n in _edges(node, states):
            if n in on_path:
                return path[on_path[n]:]
            if n not in finished and n[1] in states:
                found = visit(n)
                if found:
                    return found
        path.pop()
        del on_path[node]
        finished.add(node)
        return None
    return visit(start)
