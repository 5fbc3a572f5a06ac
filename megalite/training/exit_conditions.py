"""When a run should stop early, decided the same way on every rank.

SIGTERM (with --exit-signal-handler, as a scheduler sends before preemption) and
--exit-duration-in-mins are local observations; they are MAX-reduced over all ranks each iteration so
that every rank saves and leaves together instead of one rank leaving a collective hanging.
"""

from __future__ import annotations

import signal
import time

import torch
import torch.distributed as dist

from megalite import device
from megalite.parallel.groups import Group, ProcessGroups


class ExitConditions:
    def __init__(self, signal_handler: bool, duration_mins: float | None, pg: ProcessGroups) -> None:
        self.start = time.monotonic()
        self.duration = duration_mins * 60.0 if duration_mins else None
        self.pg = pg
        self.signalled = False
        self.active = signal_handler or self.duration is not None
        if signal_handler:
            signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.signalled = True

    def reason(self) -> str | None:
        """Why to stop now (agreed over all ranks), or None. Collective when active: call on every rank."""
        if not self.active:
            return None
        timed_out = self.duration is not None and time.monotonic() - self.start > self.duration
        flags = torch.tensor([float(self.signalled), float(timed_out)], device=device.current_device())
        self.pg.all_reduce(flags, Group.WORLD, op=dist.ReduceOp.MAX)
        if flags[0] > 0:
            return "SIGTERM received (--exit-signal-handler)"
        if flags[1] > 0:
            return f"--exit-duration-in-mins {self.duration / 60:g} reached"
        return None
