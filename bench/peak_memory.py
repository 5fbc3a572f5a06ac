"""Peak bytes a process holds in torch's CPU allocator while a call runs, from the profiler's memory events.

With ``profile_memory=True`` torch's default CPU allocator reports every allocation and free made on the
profiled (main) thread: a ``[memory]`` event with the block's address and +bytes / -bytes. Replaying them
in time order gives the blocks live at every instant, counted from the start of the profile: run the
whole ``pretrain()`` (model build included) inside it, so every weight, gradient buffer, shard,
optimizer state, gathered layer, saved activation and temporary is counted from allocation to free.

One gap, bounded: a block freed on another thread (gloo's worker dropping the last reference to a
collective's tensor, a race) reports no free. A new block at a live address retires the old one (the
allocator only reuses a free address); a block whose address is not reused stays counted, which can only
overstate the live total, by an amount that varies between runs and ranks. Blocks allocated before the
profile are ignored on both sides. Storage outside torch's allocator (gloo's transport buffers, Python
objects) is not counted.

A step's window is the span of a ``record_function`` label the caller wraps around it; ``peak`` is the
largest live total inside any window, ``held`` the live total at the end of the last one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from torch.profiler import ProfilerActivity, profile, record_function

LABEL = "bench::step"


@dataclass
class PeakReport:
    peak: int = 0  # most bytes live at once inside a step window
    held: int = 0  # bytes live at the end of the last step window
    steps: list[int] = field(default_factory=list)  # peak per step window


def labelled(fn: Callable) -> Callable:
    """``fn`` wrapped so each call is one step window of the profile."""

    def wrapped(*args, **kwargs):
        with record_function(LABEL):
            return fn(*args, **kwargs)

    return wrapped


def analyse(trace: dict) -> PeakReport:
    """Replay the ``[memory]`` events of a chrome trace by address; peak inside and total at the end of the windows."""
    evs = trace["traceEvents"]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e.get("name") == LABEL)
    mem = sorted((e["ts"], e["args"]["Bytes"], e["args"]["Addr"]) for e in evs if e.get("name") == "[memory]")
    rep = PeakReport(steps=[0] * len(windows))
    blocks: dict[int, int] = {}
    live, i = 0, 0
    for t, nbytes, addr in mem:
        live -= blocks.pop(addr, 0)  # a free; or an allocation at an address whose free was not seen
        if nbytes > 0:
            blocks[addr] = nbytes
            live += nbytes
        while i < len(windows) and t > windows[i][1]:
            i += 1
        if i < len(windows) and t >= windows[i][0]:
            rep.steps[i] = max(rep.steps[i], live)
        if windows and t <= windows[-1][1]:
            rep.held = live
    rep.peak = max(rep.steps, default=0)
    return rep


@contextlib.contextmanager
def measure() -> Iterator[PeakReport]:
    """Profile the body's CPU allocations; the yielded report is filled in when the body ends."""
    rep = PeakReport()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        yield rep
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            got = analyse(json.load(f))
    rep.peak, rep.held, rep.steps = got.peak, got.held, got.steps
