"""--async-save: the training step stops only to copy this rank's shards into host memory; a background
thread writes, fsyncs and checksums them; the commit (metadata.json, the rename, the tracker) happens on
the main thread once every rank's write is done.

Why the split: every collective runs on the main thread, at step boundaries (ProcessGroups is the only
caller of torch.distributed, and a collective issued from another thread could interleave with the
training's on the same group, in a different order on different ranks). The writer thread therefore only
touches files. ``poll()`` (after every step while a save is in flight) all-gathers each rank's "done"
flag, and when all are done every rank joins the same commit as a synchronous save (save.finish_save);
``finish()`` waits for the writer first (before the next save, and at the end of the run).

The files are the same bytes as a synchronous save of that iteration: the writer reads only the host
copies taken when the save was started, never the live tensors.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from megalite import device
from megalite.checkpointing.save import (
    RankFiles,
    finish_save,
    metadata_fields,
    prepare_save,
    rank_files,
    write_files,
)
from megalite.parallel.groups import ProcessGroups

# The kill tests' hook, told each point an asynchronous save passes: "copied" (main thread, the host
# copies taken, nothing written), "file written" (the writer thread, after each durable file), "files
# written" (the writer is done; nothing committed). The commit's own points are paths.FAULT's.
FAULT: Callable[[str], None] | None = None


def _point(name: str) -> None:
    if FAULT is not None:
        FAULT(name)


@dataclass
class PendingSave:
    """One save in flight: where it goes, what metadata.json will say, and the writer's outcome."""

    save_dir: str
    iteration: int
    staged: str
    meta: dict[str, Any]
    files: RankFiles
    stall_s: float  # how long the training step stopped for it (checks, staging, host copies)
    thread: threading.Thread | None = None
    outcome: tuple[str | None, dict[str, str] | None] = ("the writer did not finish", None)
    done: threading.Event = field(default_factory=threading.Event)


class AsyncSaver:
    """At most one asynchronous save in flight per run; every rank holds one and calls it alike."""

    def __init__(self, pg: ProcessGroups) -> None:
        self.pg = pg
        self.snapshot = device.HostSnapshot()
        self.pending: PendingSave | None = None

    def start(self, save_dir: str, iteration: int, chunks: list[nn.Module], optimizer: Any, config: dict,
              state: dict[str, Any], rng_states: dict[str, torch.Tensor], extra_meta: dict[str, Any] | None = None,
              extra_files: RankFiles | None = None) -> PendingSave:
        """Copy this rank's files to host memory and start writing them; the previous save (if any) is
        finished first. Same arguments as save_checkpoint; returns the save now in flight."""
        self.finish()
        t0 = time.perf_counter()
        staged = prepare_save(save_dir, iteration, chunks, optimizer, self.pg)
        try:
            live = rank_files(chunks, optimizer, self.pg, rng_states, extra_files)
            files = {rel: (self._copy(rel, tensors), meta) for rel, (tensors, meta) in live.items()}
            meta = metadata_fields(iteration, self.pg, chunks, optimizer, config, state, extra_meta)
            _point("copied")
        except BaseException:
            self._remove(staged)
            raise
        pending = PendingSave(save_dir, iteration, staged, meta, files, time.perf_counter() - t0)
        pending.thread = threading.Thread(target=self._write, args=(pending,), name="megalite-async-save",
                                          daemon=True)
        self.pending = pending
        pending.thread.start()
        return pending

    def _copy(self, rel: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        copies = self.snapshot.copy({f"{rel}/{k}": t for k, t in tensors.items()})
        return {k: copies[f"{rel}/{k}"] for k in tensors}

    def _write(self, pending: PendingSave) -> None:
        """The writer thread: files only, no collectives. Any failure is reported to every rank at the
        commit, as a synchronous save's would be."""
        try:
            self.snapshot.ready()
            sums = write_files(pending.staged, pending.files, lambda rel: _point("file written"))
            _point("files written")
            pending.outcome = (None, sums)
        except BaseException as e:  # noqa: BLE001 - reported to every rank, never lost in the thread
            pending.outcome = (f"{type(e).__name__}: {e}", None)
        finally:
            pending.files = {}
            pending.done.set()

    def poll(self) -> PendingSave | None:
        """At a step boundary, on every rank: commit the save in flight if every rank's writer is done.
        Returns the committed save, or None (nothing in flight, or still writing)."""
        if self.pending is None:
            return None
        done = self.pending.done.is_set()
        agreed = self.pg.all_gather_object((done, self.pending.outcome if done else None))
        if not all(d for d, _ in agreed):
            return None
        return self._commit([outcome for _, outcome in agreed])

    def finish(self) -> PendingSave | None:
        """Wait for the save in flight (if any) and commit it on every rank; returns it."""
        if self.pending is None:
            return None
        self.pending.done.wait()
        return self._commit(self.pg.all_gather_object(self.pending.outcome))

    def _commit(self, results: list) -> PendingSave:
        pending, self.pending = self.pending, None
        try:
            finish_save(pending.save_dir, pending.iteration, pending.staged, results, self.pg, pending.meta)
        except BaseException:
            self._remove(pending.staged)
            raise
        return pending

    def abandon(self) -> None:
        """The run is ending on an error (no collectives now): wait for this rank's writer, then rank 0
        removes the staging directory. The tracker still names the previous checkpoint."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.done.wait()
            self._remove(pending.staged)

    def _remove(self, staged: str) -> None:
        if self.pg.rank == 0:
            shutil.rmtree(staged, ignore_errors=True)
