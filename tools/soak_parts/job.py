"""One launch of a multi-rank pretrain_gpt.py job for tools/soak.py, as a cluster scheduler starts it:
one process per rank with the launcher's variables (RANK, WORLD_SIZE, MASTER_ADDR/PORT), every rank's
output read line by line as it comes (the soak injects faults on what the log says), and the scheduler's
rule when a task ends badly: the others get a grace period, then SIGKILL."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRETRAIN = str(ROOT / "pretrain_gpt.py")

LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([0-9.E+-]+) \|")
LOADED = re.compile(r"loaded checkpoint from \S+ at iteration (\d+)")
SAVING = re.compile(r"saving checkpoint at iteration (\d+) in the background")
SAVED = re.compile(r"saved checkpoint at iteration (\d+)")
SAVE_FAILED = re.compile(r"WARNING: --save \S+: saving iteration (\d+) failed")
ERROR = "pretrain_gpt.py: error:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Line:
    t: float  # time.monotonic() when read
    rank: int
    text: str


@dataclass
class Job:
    """The ranks of one launch. ``args``: pretrain_gpt.py's flags; ``log``: a file every line goes to."""

    args: list[str]
    nproc: int
    log: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    lines: queue.Queue = field(default_factory=queue.Queue)
    started: float = 0.0
    first_exit: float | None = None

    def start(self) -> Job:
        port = free_port()
        out = open(self.log, "a")
        self._out, self._lock = out, threading.Lock()
        self.started = time.monotonic()
        for rank in range(self.nproc):
            env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "WORLD_SIZE": str(self.nproc),
                   "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(self.nproc), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            for var in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_USE_AGENT_STORE"):
                env.pop(var, None)
            proc = subprocess.Popen([sys.executable, PRETRAIN, *self.args], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT, start_new_session=True)
            self.procs.append(proc)
            threading.Thread(target=self._read, args=(rank, proc), daemon=True).start()
        return self

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        for text in proc.stdout:
            with self._lock:
                if not self._out.closed:
                    self._out.write(f"[rank {rank}] {text}")
                    self._out.flush()
            self.lines.put(Line(time.monotonic(), rank, text.rstrip("\n")))

    def next_line(self, timeout: float) -> Line | None:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            return None

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def running(self) -> bool:
        return any(c is None for c in self.codes())

    def signal(self, rank: int, sig: int) -> None:
        try:
            os.kill(self.procs[rank].pid, sig)
        except ProcessLookupError:
            pass

    def reap(self, grace: float, stopped: int | None = None) -> None:
        """The scheduler's rule: once a rank has exited, the others get ``grace`` seconds, then SIGKILL; a
        rank ``stopped`` by the soak (SIGSTOP) can never finish and is killed at once."""
        codes = self.codes()
        if all(c is None for c in codes):
            return
        if self.first_exit is None:
            self.first_exit = time.monotonic()
        if stopped is not None and codes[stopped] is None:
            self.signal(stopped, signal.SIGKILL)
        if time.monotonic() - self.first_exit > grace:
            for rank, c in enumerate(codes):
                if c is None:
                    self.signal(rank, signal.SIGKILL)

    def close(self) -> None:
        for rank, p in enumerate(self.procs):
            if p.poll() is None:
                self.signal(rank, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        time.sleep(0.05)  # the reader threads drain the pipes' last lines
        with self._lock:
            self._out.close()
