"""Start-up checks of ``--save``: a run must never replace another run's checkpoint by accident, and a
directory it cannot write to is found before training, not at the first save.

Checked on every rank before any process group exists (each check only reads, except the write probe,
whose file name is unique per process). Rank 0 first takes the folder's lock (``lock.py``: one writer per
folder) and removes what killed saves left there (``paths.recover``); in a run that continues its own
folder it then sets a damaged newest checkpoint aside (``fallback.py``) before any rank reads the tracker."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from megalite.checkpointing.destination import claim, relation
from megalite.checkpointing.fallback import resume_point
from megalite.checkpointing.load import shape_diffs
from megalite.checkpointing.paths import TRACKER, iter_dirname, iteration_dir, read_tracker, recover
from megalite.checkpointing.reader import CheckpointError
from megalite.checkpointing.schema import load_metadata
from megalite.config.model import ModelConfig
from megalite.config.training import CheckpointConfig

PROBE_BYTES = 1 << 16


def probe_writable(path: str, flag: str = "--save") -> None:
    """Create ``path`` if needed and write, sync and remove a small file in it."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise CheckpointError(f"{flag} {path} is a file, not a directory; give a directory to save checkpoints in")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{flag} {path}: cannot create the directory ({e.strerror or e})") from None
    probe = os.path.join(path, f".write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise CheckpointError(f"{flag} {path} is not writable ({e.strerror or e}); checkpoints could not be "
                              "saved there: choose another directory or free space") from None
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def _saved_config(save: str, iteration: int) -> dict[str, Any] | None:
    try:
        return load_metadata(os.path.join(iteration_dir(save, iteration), "metadata.json"))["config"]
    except CheckpointError:
        return None


def _tracked(path: str) -> int | None:
    try:
        return read_tracker(path) if os.path.isfile(os.path.join(path, TRACKER)) else None
    except CheckpointError:
        return None


def _why_not_continued(ck: CheckpointConfig, model: ModelConfig, saved_iter: int) -> str | None:
    """Why this run would replace the checkpoint in ``ck.save`` instead of continuing it (None: it continues)."""
    if not ck.load:
        return "this run has no --load, so it starts at iteration 0 and would replace it"
    if ck.finetune:
        return "--finetune starts at iteration 0, so this run would replace it"
    saved = _saved_config(ck.save, saved_iter)
    if saved is None:
        return f"its {iter_dirname(saved_iter)}/metadata.json is unreadable, so it cannot be told to be this run's"
    diffs = shape_diffs(saved, dataclasses.asdict(model))
    if diffs:
        return "it is of another model (" + "; ".join(diffs) + ")"
    loaded = _tracked(ck.load)
    if os.path.abspath(ck.load) != os.path.abspath(ck.save) and loaded is not None and loaded < saved_iter:
        return f"--load {ck.load} is at iteration {loaded}, so this run's saves would rewind its tracker"
    return None


def check_save_target(ck: CheckpointConfig, model: ModelConfig) -> None:
    """Refuse a ``--save`` directory this run cannot write, or one holding another run's checkpoint
    (unless ``--overwrite-checkpoint``); raise CheckpointError naming the directory and the way out."""
    if not ck.save:
        return
    probe_writable(ck.save)
    saved_iter = _tracked(ck.save)
    if ck.overwrite_checkpoint or saved_iter is None:
        if saved_iter is None and os.path.isfile(os.path.join(ck.save, TRACKER)) and not ck.overwrite_checkpoint:
            try:
                read_tracker(ck.save, "--save")
            except CheckpointError as e:
                raise CheckpointError(f"{e}; choose a new directory or pass --overwrite-checkpoint") from None
        return
    why = _why_not_continued(ck, model, saved_iter)
    if why:
        raise CheckpointError(
            f"--save {ck.save} already holds a checkpoint (iteration {saved_iter}) and {why}. To continue that "
            f"run pass --load {ck.save}; to keep it, save to a new directory; to replace it, pass "
            "--overwrite-checkpoint")


@contextlib.contextmanager
def guarded_save(ck: CheckpointConfig, model: ModelConfig, rank: int, say: Callable[[str], None]) -> Iterator[None]:
    """The start-up of a run that saves: rank 0 takes ``--save``'s lock (held for the body) and clears what
    killed saves left there; every rank then runs :func:`check_save_target`."""
    with contextlib.ExitStack() as stack:
        if ck.save and rank == 0:
            probe_writable(ck.save)
            stack.enter_context(claim(ck.save, [("--load", ck.load)], say, in_place=True))  # the rule of every writer
            try:
                done = recover(ck.save)
            except OSError as e:
                raise CheckpointError(f"--save {ck.save}: cannot clean up after an interrupted save ({e})") from None
            if done:
                say(f"--save {ck.save}: cleaned up after an interrupted save: " + "; ".join(done))
            if restarts_in_place(ck):
                resume_point(ck.save, ck.on_bad_checkpoint == "refuse", say)
        if rank == 0 or not restarts_in_place(ck):
            check_save_target(ck, model)
        else:  # rank 0 checks the folder, after it may have set a damaged newest checkpoint aside
            probe_writable(ck.save)
        yield


def restarts_in_place(ck: CheckpointConfig) -> bool:
    """Whether the run continues the checkpoint it saves (``--load`` is ``--save``): then rank 0, holding the
    lock, sets a damaged newest checkpoint aside before anything reads the tracker (``fallback.py``). Compared
    as the writer rule compares folders (resolved path, then device and inode): a symlink counts as the same."""
    return bool(ck.save and ck.load and not ck.finetune and relation(ck.save, ck.load) == "is")
