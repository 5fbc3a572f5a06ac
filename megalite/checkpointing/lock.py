"""One writer per checkpoint folder: a lock file in ``--save`` naming the run that writes there.

Rank 0 creates it with O_EXCL before anything is saved (and before the start-up checks read the
tracker), so of two runs started into one folder the second is refused, naming the first's host and
pid. The lock is removed when the run ends. A lock left by a run that died without removing it is
stale when its host is this host and its pid is gone (or is now another process: the process start time
differs, or it is a zombie); it is then taken over with a one-line notice. A lock from another host
cannot be checked from here and is treated as held, unless it names this run's own job (a Slurm job
requeued on another node, a torchrun restart there: the job's earlier incarnation is gone); otherwise the
error says to remove the file once that run is known to be gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.paths import run_tag

LOCK = ".megalite-save.lock"
READ_TRIES = 10  # a lock being written by a run starting right now: how often to look again
READ_WAIT_S = 0.05
EMPTY_STALE_S = 60.0  # a lock still without an owner this long after it was made: its writer died creating it


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    proc_start: str | None  # the kernel's start time of the process (ticks since boot), where readable
    started: str  # wall-clock time, for people
    tag: str  # the run's staging tag
    job: str = ""  # the launcher's job identity (job_id()), "" where it has none

    def describe(self) -> str:
        return f"host {self.host}, pid {self.pid}, started {self.started}"


def _proc_stat(pid: int) -> list[str] | None:
    """Fields of /proc/PID/stat after the command name (state first), or None where unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _proc_start(pid: int) -> str | None:
    fields = _proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None  # field 22 of stat: starttime


def job_id() -> str:
    """This process's job as its launcher names it across restarts: the Slurm job id, or torchrun's
    rendezvous id where one was given (its default "none" names no job); "" without either."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm {os.environ['SLURM_JOB_ID']}"
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun {run}" if run not in ("", "none") else ""


def me() -> Owner:
    return Owner(socket.gethostname(), os.getpid(), _proc_start(os.getpid()),
                 time.strftime("%Y-%m-%d %H:%M:%S"), run_tag(), job_id())


def is_stale(owner: Owner, host: str | None = None) -> bool:
    """Whether ``owner``'s run is certainly gone: same host, and its pid is dead, a zombie or reused (or the
    lock never got an owner written, see EMPTY_STALE_S)."""
    if owner.pid == -1:
        return True
    if owner.host != (host or socket.gethostname()):
        return bool(owner.job) and owner.job == job_id()  # this job's earlier incarnation, on another node
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    fields = _proc_stat(owner.pid)
    if fields is None:
        return False
    if fields[0] in ("Z", "X"):
        return True
    return owner.proc_start is not None and _proc_start(owner.pid) not in (None, owner.proc_start)


def read_owner(path: str) -> Owner | None:
    """The lock's owner, or None while the file is empty or partial (its writer is still writing it)."""
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read(4096).decode("utf-8"))
        return Owner(str(data["host"]), int(data["pid"]), data.get("proc_start"), str(data.get("started", "?")),
                     str(data.get("tag", "")), str(data.get("job", "")))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class SaveLock:
    """The lock of ``save_dir``; ``acquire`` takes it or raises CheckpointError naming its holder."""

    def __init__(self, save_dir: str, flag: str = "--save") -> None:
        self.save_dir, self.flag = save_dir, flag
        self.path = os.path.join(save_dir, LOCK)
        self.owner: Owner | None = None

    def _create(self) -> bool:
        owner = me()
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(owner), f)
            f.flush()
            os.fsync(f.fileno())
        self.owner = owner
        return True

    def _holder(self) -> Owner | None:
        for _ in range(READ_TRIES):
            owner = read_owner(self.path)
            if owner is not None or not os.path.exists(self.path):
                return owner
            time.sleep(READ_WAIT_S)
        with contextlib.suppress(OSError):
            if time.time() - os.path.getmtime(self.path) > EMPTY_STALE_S:
                return Owner("?", -1, None, "(no owner written)", "")
        raise CheckpointError(f"{self.flag} {self.save_dir}: its lock {self.path} names no owner (empty or damaged); "
                              "if no run is saving there, remove that file")

    def _take_over(self, stale: Owner) -> bool:
        """Move the stale lock aside and check that it was still the stale one (another starting run may
        have taken it over first; then its fresh lock is put back and this run looks again)."""
        aside = f"{self.path}.stale.{run_tag()}"
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return False
        if read_owner(aside) != (None if stale.pid == -1 else stale):
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            os.remove(aside)
            return False
        os.remove(aside)
        return True

    def acquire(self, say: Callable[[str], None]) -> None:
        for _ in range(5):
            if self._create():
                return
            holder = self._holder()
            if holder is None:
                continue  # released meanwhile
            if not is_stale(holder):
                other = "" if holder.host == socket.gethostname() else (
                    "; a lock of another host and another job cannot be checked from here: if that run is "
                    f"gone, remove {self.path}")
                raise CheckpointError(
                    f"{self.flag} {self.save_dir} is in use by another run ({holder.describe()}): only one run may "
                    f"save into a folder; wait for it to end or save elsewhere{other}")
            if self._take_over(holder):
                say(f"{self.flag} {self.save_dir}: taking over the lock of a run that is gone ({holder.describe()})")
        raise CheckpointError(f"{self.flag} {self.save_dir}: could not take its lock {self.path} (other runs keep "
                              "starting into this folder)")

    def plant(self, folder: str) -> None:
        """Write this lock's owner into ``folder`` too: a folder about to replace the locked one as a whole
        (see destination.py) carries the lock, so the destination is never unlocked while switched."""
        assert self.owner is not None, "plant() needs the lock held"
        with open(os.path.join(folder, LOCK), "w") as f:
            json.dump(asdict(self.owner), f)
            f.flush()
            os.fsync(f.fileno())

    def release(self) -> None:
        """Remove the lock if it is still this run's."""
        if self.owner is not None and read_owner(self.path) == self.owner:
            with contextlib.suppress(OSError):
                os.remove(self.path)
        self.owner = None


@contextlib.contextmanager
def holding(save_dir: str, say: Callable[[str], None]) -> Iterator[SaveLock]:
    """Hold ``save_dir``'s lock for the body."""
    lock = SaveLock(save_dir)
    lock.acquire(say)
    try:
        yield lock
    finally:
        lock.release()
