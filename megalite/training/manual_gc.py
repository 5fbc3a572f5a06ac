"""--manual-gc: Python's garbage collector at fixed points of the run instead of whenever it decides.

An automatic collection pauses one rank at a step its peers do not pause at, and every collective then
waits for it; collecting at the same iterations on every rank keeps the pauses aligned (Megatron-LM's
meaning: off for the run, one collection at the start, one every --manual-gc-interval iterations, a
full one before each evaluation and a young-generation one after it unless --no-manual-gc-eval).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

from megalite.config.training import TrainingConfig


class ManualGC:
    def __init__(self, t: TrainingConfig) -> None:
        self.on, self.interval, self.at_eval = t.manual_gc, t.manual_gc_interval, t.manual_gc_eval
        self._was_enabled = gc.isenabled()

    def start(self) -> None:
        if self.on:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()

    def stop(self) -> None:
        if self.on and self._was_enabled:  # an in-process caller gets its collector back
            gc.enable()

    def after_step(self, step: int) -> None:
        if self.on and self.interval and step % self.interval == 0:
            gc.collect()

    @contextlib.contextmanager
    def around_eval(self) -> Iterator[None]:
        if self.on and self.at_eval:
            gc.collect()
        yield
        if self.on and self.at_eval:
            gc.collect(generation=0)  # what evaluation itself left behind
