"""A collective that timed out: say which peer hung, so that the failure board's one line names it.

A rank that stops making progress (stopped by a signal or a debugger, stuck in uninterruptible I/O, a
deadlock) leaves its peers waiting in their next collective; --distributed-timeout-minutes bounds that
wait, the backend raises, and the job ends so that its launcher (torchrun --max-restarts, a scheduler)
can restart it. The backend's error names no peer, so the rank that met it looks up the peers of its own
host on the failure board (their pids) and names those whose process is stopped or blocked; a peer on
another host cannot be looked at from here and is not named.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

# What gloo / NCCL / the store say when a collective or a store wait ran past its timeout.
TIMED_OUT = ("Timed out waiting", "timed out", "Timeout waiting", "Watchdog caught collective operation timeout")
STATES = {"T": "is stopped (SIGSTOP, or a debugger)", "t": "is stopped by a debugger",
          "D": "is blocked in the kernel (uninterruptible I/O)"}


def timed_out(e: BaseException) -> bool:
    """Whether ``e`` is a collective's (or the store's) report that its timeout passed."""
    if isinstance(e, TimeoutError | dist.DistStoreError) and "timeout" in str(e).lower():
        return True
    return isinstance(e, RuntimeError) and any(w in str(e) for w in TIMED_OUT)


def process_state(pid: int) -> str | None:
    """The kernel's one-letter state of process ``pid`` of this host (R, S, D, T, Z...), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def hung_peers(peers: list[tuple[int, int]]) -> list[str]:
    """'rank R (pid P) is stopped ...' for each (rank, pid) of this host whose process cannot progress."""
    named = []
    for rank, pid in peers:
        state = process_state(pid)
        if state in STATES:
            named.append(f"rank {rank} (pid {pid}) {STATES[state]}")
    return named


def hang_message(e: BaseException, peers: list[tuple[int, int]], timeout: datetime.timedelta) -> str:
    """The failure board's line for a collective that timed out; ``peers``: (rank, pid) of this host's peers."""
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    words = first.split("] ", 1)[-1][:200]  # the backend's sentence, without [source:line]
    who = "; ".join(hung_peers(peers)) or ("a peer rank did not join it (not named: on another host, or busy "
                                           "but not stopped)")
    return (f"a collective timed out after {timeout.total_seconds() / 60:g} min (--distributed-timeout-minutes): "
            f"{who}; the job ends so that its launcher can restart it ({words})")
