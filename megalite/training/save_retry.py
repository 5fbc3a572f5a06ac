"""What a run does when a periodic save cannot be written: go on training and try again.

A full disk, a file-size limit or an I/O error while saving is a fault of the storage, not of the run:
the save's staging folder is removed, every earlier checkpoint stays as it was (save.py), so stopping
would only throw away the iterations since the last checkpoint. The run says so in one line and tries
again at the next ``--save-interval``; after ``--max-consecutive-failed-saves`` failures in a row (the
storage is not coming back) it stops with a clear message. The final save (the end of the run, a signal,
an exit condition) is never skipped: its failure stops the run at once. Every rank meets a save's failure
together (the save agrees on each rank's outcome), so every rank decides alike without a collective.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from megalite.checkpointing.save import CheckpointSaveError, CheckpointWriteError


class SavesKeepFailing(CheckpointSaveError):
    """--max-consecutive-failed-saves periodic saves in a row failed to write."""


class SaveRetry:
    """Counts periodic saves that failed in a row; ``limit`` is --max-consecutive-failed-saves."""

    def __init__(self, limit: int, say: Callable[[str], None]) -> None:
        self.limit, self.say = limit, say
        self.failed_in_row = 0

    def succeeded(self) -> None:
        self.failed_in_row = 0

    @contextlib.contextmanager
    def attempt(self, final: bool) -> Iterator[None]:
        """Run a save (or the commit of one in flight); a write failure of a periodic one is reported and
        swallowed until the limit. ``final``: the run ends after it, so a failure is re-raised."""
        try:
            yield
        except CheckpointWriteError as e:
            if final:
                raise
            self.failed_in_row += 1
            count = f"{self.failed_in_row} of --max-consecutive-failed-saves {self.limit} in a row"
            if self.failed_in_row >= self.limit:
                raise SavesKeepFailing(f"{e}; stopping: {count} failed (free space or fix the storage, then "
                                       "restart: the run resumes from the last checkpoint)") from None
            self.say(f" WARNING: {e}; training goes on and saves again at the next --save-interval ({count} "
                     "failed)")
