"""One clear error per failed run, however many ranks it has, and no rank left waiting.

The ranks of a run share a board in the rendezvous store. A rank that fails claims it before anything
else (before its connections close): the first claimant prints its error, named by rank; a later one
stays silent, so an error every rank meets (a NaN, a bad flag) is printed once. Every rank also
watches the board from a thread: when a peer has failed it leaves at once (non-zero status, no
traceback), even from inside a collective that would otherwise wait for the full timeout. An
exception the entry point did not expect keeps its traceback (it is a bug report), unless a peer
failed first, in which case it is that failure's echo (e.g. a connection the peer closed).

Two more endings are one line, not a traceback: Ctrl-C (exit status 130), and a peer that vanished
without reporting (killed, out of memory), which the backend reports as a closed or reset connection:
each rank records its host and pid on the board, so the rank that meets the closed connection names the
peer ranks of its host whose processes are gone (ranks on other hosts cannot be checked from here). A
collective that timed out (a peer hung: stopped, stuck) is one line too, naming the peers of its host
that are stopped or blocked (``hang.py``), and ends the job so that its launcher can restart it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

import torch.distributed as dist

from megalite.launch import rendezvous
from megalite.launch.hang import hang_message, timed_out
from megalite.launch.rendezvous import Rendezvous, RendezvousError

WHO = "failure/rank"  # the first failing rank, set once
COUNT = "failure/count"
LEFT = "left"
WATCH_S = 0.2  # how often each rank looks at the board
LINGER_S = 30.0  # the longest the store's host waits for the others to leave
REPORT_CONNECT_S = 30.0  # the longest a failure before the rendezvous waits to reach the store
AFTER_FIRST_S = 5.0  # the longest a rank that did not fail first waits for the one that did to leave
PID = "pid"  # PID/<rank>: "<host> <pid>" of each rank, to name a peer that vanished
INTERRUPTED = 130  # the shell's status for a process ended by Ctrl-C (128 + SIGINT)
# What gloo / torch.distributed say when the process at the other end of a connection is gone.
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused")
MAX_LOOKUP = 256  # peers whose pids are looked up after a lost connection (one store read each)


def peer_lost(e: BaseException) -> bool:
    """Whether ``e`` is a collective's report that a peer process went away."""
    if isinstance(e, dist.DistNetworkError):
        return True
    return isinstance(e, RuntimeError) and any(p in str(e) for p in PEER_LOST)


def pid_gone(pid: int) -> bool:
    """Whether process ``pid`` of this host has exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


class FailureBoard:
    """This rank's view of the run's failure board. ``prog`` prefixes printed errors."""

    def __init__(self, prog: str, rank: int, world: int, timeout: datetime.timedelta) -> None:
        self.prog, self.rank, self.world, self.timeout = prog, rank, world, timeout
        self.rv: Rendezvous | None = None
        self.first: bool | None = None  # set by claim(): whether this rank failed first
        self.exit_code = 0
        self.may_connect = world > 1  # a failure before the rendezvous reaches the store to report
        self.expected_ranks = world  # ranks the host waits for when leaving
        self._claiming = False
        self._counted = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, rv: Rendezvous) -> None:
        """Use ``rv``'s store and start watching it for a peer's failure."""
        self.rv, self.may_connect = rv, False
        with contextlib.suppress(RuntimeError, OSError):
            rv.store.set(f"{PID}/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
        if self.world > 1 and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="megalite-failure-watch", daemon=True)
            self._thread.start()

    def detach(self) -> None:
        """Stop watching (the run succeeded; teardown must not read a departing peer as a failure)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                failed = self.rv.store.check([WHO])
            except (RuntimeError, OSError):  # the store's host is gone without a word: nothing to wait for
                failed = None
            if self._claiming or self._stop.is_set():
                return
            if failed is None:
                self._say(f"lost the rendezvous store at {self.rv.address}: its host stopped without reporting "
                          "an error")
            if failed or failed is None:
                self._after_first()
                self._count_out()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)  # a peer failed (and said why): this rank may be blocked in a collective

    def claim(self) -> bool:
        """Record this rank's failure on the board (once); whether it is the run's first."""
        if self.first is not None:
            return self.first
        self._claiming = True
        self._stop.set()
        self.first = True
        if self.rv is None and self.may_connect:
            self.may_connect = False
            with contextlib.suppress(RendezvousError):
                reach = min(self.timeout, datetime.timedelta(seconds=REPORT_CONNECT_S))
                self.rv = rendezvous.connect(self.rank, self.world, reach)
        if self.rv is not None:
            try:
                self.first = self.rv.store.add(COUNT, 1) == 1
                if self.first:
                    self.rv.store.set(WHO, str(self.rank))
            except (RuntimeError, OSError):  # no board: better said twice than not at all
                self.first = True
        return self.first

    def _say(self, message: str) -> None:
        named = message if self.world == 1 or message.startswith(f"rank {self.rank}:") else \
            f"rank {self.rank}: {message}"
        print(f"{self.prog}: error: {named}", file=sys.stderr, flush=True)

    def _count_out(self) -> int:
        with self._lock:  # once per rank, whichever thread gets here first
            if self.rv is None or self._counted:
                return 0
            self._counted = True
        try:
            self.rv.store.set(f"{LEFT}/{self.rank}", "1")
            return self.rv.store.add(LEFT, 1)
        except (RuntimeError, OSError):
            return 0

    def _after_first(self) -> None:
        """Wait (bounded) until the rank that failed first has left. A launcher names the first rank to
        exit as the root cause, so it must be that one; under torchrun the launcher then stops this rank
        itself (SIGTERM)."""
        if self.rv is None:
            return
        deadline = time.monotonic() + AFTER_FIRST_S
        with contextlib.suppress(RuntimeError, OSError):
            while time.monotonic() < deadline:
                if self.rv.store.check([WHO]):
                    who = self.rv.store.get(WHO).decode()
                    if self.rv.store.check([f"{LEFT}/{who}"]):
                        break
                time.sleep(rendezvous.POLL_S)
            if "TORCHELASTIC_RESTART_COUNT" in os.environ:
                time.sleep(max(0.0, deadline - time.monotonic()))

    def leave(self) -> None:
        """Count this rank out; the store's host then waits (bounded) until the others have, so that none
        of them loses the store while it still reads the board or tears down."""
        left = self._count_out()
        if self.rv is None or not self.rv.hosting:
            return
        deadline = time.monotonic() + min(LINGER_S, self.timeout.total_seconds())
        with contextlib.suppress(RuntimeError, OSError):
            while left < self.expected_ranks and time.monotonic() < deadline:
                time.sleep(rendezvous.POLL_S)
                left = self.rv.store.add(LEFT, 0)

    def host_peers(self) -> list[tuple[int, int]]:
        """(rank, pid) of each peer on this host, as recorded on the board."""
        if self.rv is None or self.world > MAX_LOOKUP:
            return []
        host, peers = socket.gethostname(), []
        with contextlib.suppress(RuntimeError, OSError, ValueError):
            for r in range(self.world):
                key = f"{PID}/{r}"
                if r == self.rank or not self.rv.store.check([key]):
                    continue
                their_host, pid = self.rv.store.get(key).decode().rsplit(" ", 1)
                if their_host == host:
                    peers.append((r, int(pid)))
        return peers

    def dead_peers(self) -> list[str]:
        """'rank R (pid P)' of each peer on this host whose process is gone, as recorded on the board."""
        return [f"rank {r} (pid {pid})" for r, pid in self.host_peers() if pid_gone(pid)]

    def _peer_lost_message(self, e: BaseException) -> str:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        words = first.split("] ", 1)[-1].split(". ", 1)[0][:200]  # gloo's first sentence, without [source:line]
        dead = self.dead_peers()
        who = (", ".join(dead) if dead else  # a peer on another host, or one not yet seen gone from here
               "a peer rank of this run's groups (not named: it is on another host or not yet seen gone)")
        return (f"{who} exited without reporting an error (killed, or out of memory?); this rank's collective "
                f"failed with: {words}")

    @contextlib.contextmanager
    def reporting(self, expected: tuple[type[BaseException], ...]) -> Iterator[None]:
        """Run the body; an ``expected`` error is printed once per run (exit_code 2), an unexpected one
        re-raised on the rank that failed first and silenced (exit_code 1) on the others."""
        try:
            yield
        except expected as e:
            if self.claim():
                self._say(str(e))
            else:
                self._after_first()
            self.exit_code = 2
            self.leave()
        except KeyboardInterrupt:
            if self.claim():
                self._say("interrupted (Ctrl-C); checkpoints already committed are intact, a save in progress "
                          "was removed")
            else:
                self._after_first()
            self.exit_code = INTERRUPTED
            self.leave()
        except Exception as e:
            if self.claim():
                if timed_out(e):  # a peer hung (stopped, stuck): name it, end the job for the launcher to restart
                    self._say(hang_message(e, self.host_peers(), self.timeout))
                    self.exit_code = 2
                    self.leave()
                    return
                if peer_lost(e):  # a peer vanished without a word: name it instead of the backend's traceback
                    self._say(self._peer_lost_message(e))
                    self.exit_code = 2
                    self.leave()
                    return
                self.leave()
                raise
            self._after_first()
            self.leave()
            self.exit_code = 1
