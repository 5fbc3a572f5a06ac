"""Which checkpoint a restarting run resumes from when the newest one is damaged.

A run restarted into its own folder (``--load`` equal to ``--save``, e.g. under ``torchrun
--max-restarts`` or a scheduler's requeue) must not need a human when its newest checkpoint fails its
checks (a file whose CRC differs from metadata.json's, an unreadable metadata.json, a garbled or deleted
tracker): a blind restart loop would meet the same error forever. Rank 0 of such a run, holding the save
lock, checks the newest checkpoint before anything loads it; one that fails is set aside (renamed to
``iter_N.corrupt-TAG``, never deleted) with a one-line notice and the previous one is checked, until one
passes; the tracker is then pointed at it. A tracker that is not an iteration number, or is missing
while iteration folders exist, is replaced by a scan of the folders (the newest that passes).
``--on-bad-checkpoint refuse`` stops with the error instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from megalite.checkpointing.checksum import file_checksum
from megalite.checkpointing.errors import CheckpointError, CheckpointNotFoundError
from megalite.checkpointing.paths import TRACKER, iter_dirname, read_tracker, run_tag
from megalite.checkpointing.schema import load_metadata

ITERATION_FOLDER = re.compile(r"iter_([0-9]{7,})")
SET_ASIDE = "corrupt"  # iter_N.corrupt-TAG


def iterations_on_disk(folder: str) -> list[int]:
    """The iterations of ``folder``'s ``iter_N`` folders, newest first (set-aside and staging ones excluded)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    found = [int(m[1]) for n in names if (m := ITERATION_FOLDER.fullmatch(n))
             and os.path.isdir(os.path.join(folder, n))]
    return sorted(found, reverse=True)


def problem(folder: str, iteration: int) -> str | None:
    """Why ``iteration`` in ``folder`` cannot be resumed from (None: it passes): its folder or
    metadata.json missing or unreadable, a file it lists missing or not matching its CRC-32."""
    where = os.path.join(folder, iter_dirname(iteration))
    if not os.path.isdir(where):
        return f"{iter_dirname(iteration)}/ is missing"
    meta_path = os.path.join(where, "metadata.json")
    if not os.path.isfile(meta_path):
        return "its metadata.json is missing"
    try:
        meta = load_metadata(meta_path)
    except CheckpointError as e:
        return str(e)
    for rel, want in sorted((meta.get("checksums") or {}).items()):
        path = os.path.join(where, rel)
        if not os.path.isfile(path):
            return f"{rel} is missing"
        got = file_checksum(path)
        if got != want:
            return f"{rel} is corrupt (checksum {got}, metadata.json recorded {want})"
    return None


def _write_tracker(folder: str, iteration: int) -> None:
    tmp = os.path.join(folder, f".{TRACKER}.{run_tag()}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(folder, TRACKER))


def _set_aside(folder: str, name: str) -> str:
    """Rename ``folder/name`` to ``name.corrupt-TAG``; returns the new name."""
    aside = f"{name}.{SET_ASIDE}-{run_tag()}"
    os.replace(os.path.join(folder, name), os.path.join(folder, aside))
    return aside


def _tracked(folder: str) -> tuple[int | None, str | None]:
    """(the tracker's iteration, why there is none usable): (N, None), (None, None) when absent, or
    (None, the reader's error) when it holds something else."""
    try:
        return read_tracker(folder), None
    except CheckpointNotFoundError:
        return None, None
    except CheckpointError as e:
        return None, str(e)


def resume_point(folder: str, refuse: bool, say: Callable[[str], None]) -> int | None:
    """Make ``folder``'s tracker name the newest checkpoint that passes its checks, setting aside (or, with
    ``refuse``, raising CheckpointError on) each newer one that fails; returns its iteration, or None
    when the folder holds no checkpoint (a fresh start). Only the folder's one writer may call this."""
    flag = "--load"
    tracked, garbled = _tracked(folder)
    on_disk = iterations_on_disk(folder)
    if garbled is not None:
        if refuse:
            raise CheckpointError(f"{garbled} (--on-bad-checkpoint refuse)")
        aside = _set_aside(folder, TRACKER)
        say(f"{flag} {folder}: {TRACKER} is unusable, set aside as {aside}; scanning the iteration folders")
    elif tracked is None:
        if not on_disk or refuse:
            return None  # nothing saved yet (or refuse: as before, a missing tracker means a fresh start)
        say(f"{flag} {folder}: {TRACKER} is missing; scanning the iteration folders")
    candidates = on_disk if tracked is None else [tracked] + [i for i in on_disk if i < tracked]
    for iteration in candidates:
        why = problem(folder, iteration)
        if why is None:
            if iteration != tracked:
                _write_tracker(folder, iteration)
                say(f"{flag} {folder}: resuming from {iter_dirname(iteration)}, the newest checkpoint that passes "
                    f"its checks ({TRACKER} now names it)")
            return iteration
        if refuse:
            raise CheckpointError(f"{flag} {folder}: {iter_dirname(iteration)} fails its checks: {why} "
                                  "(--on-bad-checkpoint refuse; the default sets it aside and resumes from the "
                                  "previous checkpoint)")
        if os.path.isdir(os.path.join(folder, iter_dirname(iteration))):
            aside = _set_aside(folder, iter_dirname(iteration))
            say(f"{flag} {folder}: {iter_dirname(iteration)} fails its checks ({why}): set aside as {aside}")
        else:
            say(f"{flag} {folder}: {TRACKER} names iteration {iteration}, but {why}")
    if candidates:
        raise CheckpointError(f"{flag} {folder}: no checkpoint there passes its checks (each failing one was set "
                              "aside as iter_N.corrupt-TAG); restore one from a copy, or start afresh in a new "
                              "--save folder")
    return None  # a garbled tracker and no iteration folders: nothing was ever saved there
