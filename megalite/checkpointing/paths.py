"""Names of checkpoint files and directories, the tracker, and the commit of a finished save.

Replacing an existing iteration is one atomic switch where the system can swap two folders in one
rename (Linux's ``renameat2`` with ``RENAME_EXCHANGE``, on the local file systems it supports): the new
folder takes ``iter_N``'s name and the old one the staging name, removed afterwards. Elsewhere it takes
two renames (old folder aside, new folder in); a kill between them leaves the old folder under
``.iter_N.replaced.TAG``, which :func:`iteration_dir` finds and :func:`recover` (run by the holder of the
save lock at start-up) moves back."""

from __future__ import annotations

import ctypes
import errno
import os
import re
import secrets
import shutil
import sys
from collections.abc import Callable

from megalite.checkpointing.errors import CheckpointError, CheckpointNotFoundError
from megalite.tensor_parallel.param_meta import ParamFamily

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"  # what a Megatron-LM tracker may name instead of an iteration: its release/ folder
TRACKER_MAX_BYTES = 32  # an iteration number and a newline; anything longer is not a tracker
# Called with the name of each commit step just done; tests set it to simulate a kill between steps.
FAULT: Callable[[str], None] | None = None
_TAGS: dict[int, str] = {}


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def shard_dirname(tp_rank: int, pp_rank: int) -> str:
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def family_dirname(family: ParamFamily, shard_rank: int, split_rank: int, pp_rank: int) -> str:
    """The folder of a parameter family's files at rank ``shard_rank`` of the group its spec cuts over,
    block ``split_rank`` of its split dim (named only for families that split) and stage ``pp_rank``:
    mp_rank_TT_PPP (dense) or expert_rank_TT_EEE_PPP (routed experts)."""
    split = [f"{split_rank:03d}"] if family.split is not None else []
    return "_".join([family.folder, f"{shard_rank:02d}", *split, f"{pp_rank:03d}"])


def optim_filename(dp_rank: int) -> str:
    return f"optim_dp_{dp_rank:03d}.safetensors"


def rng_filename(rank: int) -> str:
    return os.path.join("rng", f"rank_{rank:05d}.safetensors")


def run_tag() -> str:
    """This process's tag in staging names: its pid and a random part, so two writers (even on two hosts
    sharing the folder) never share a staging or replaced-folder name."""
    pid = os.getpid()
    if pid not in _TAGS:
        _TAGS[pid] = f"{pid}-{secrets.token_hex(3)}"
    return _TAGS[pid]


def staging_dir(save_dir: str, iteration: int, tag: str | None = None) -> str:
    """Where ranks write a save in progress; it becomes the iteration directory only once complete.
    ``tag`` defaults to this process's :func:`run_tag` (rank 0 chooses it and tells the others)."""
    return os.path.join(save_dir, f".{iter_dirname(iteration)}.incomplete.{tag or run_tag()}")


def replaced_dir(save_dir: str, iteration: int, tag: str | None = None) -> str:
    """Where a committed iteration waits while a new save of the same iteration replaces it."""
    return os.path.join(save_dir, f".{iter_dirname(iteration)}.replaced.{tag or run_tag()}")


def _leftovers(save_dir: str, iteration: int | None, kind: str) -> list[str]:
    """Staging (``incomplete``) or ``replaced`` folders in ``save_dir`` (of one iteration, or of all)."""
    it = iter_dirname(iteration) if iteration is not None else r"iter_[0-9]+"
    pattern = re.compile(rf"\.({it})\.{kind}(\..+)?")
    try:
        names = sorted(os.listdir(save_dir))
    except OSError:
        return []
    return [os.path.join(save_dir, n) for n in names if pattern.fullmatch(n)]


def iteration_dir(load_dir: str, iteration: int) -> str:
    """The folder holding ``iteration``: ``iter_N``, or, when a replace of it was killed between its two
    renames, the complete old folder set aside as ``.iter_N.replaced.TAG`` (read where it lies)."""
    final = os.path.join(load_dir, iter_dirname(iteration))
    if os.path.isdir(final):
        return final
    for old in _leftovers(load_dir, iteration, "replaced"):
        if os.path.isfile(os.path.join(old, "metadata.json")):
            return old
    return final


def recover(save_dir: str) -> list[str]:
    """Undo what killed saves left in ``save_dir`` (only its one writer may call this): a replaced folder
    goes back to ``iter_N`` when the new one never arrived (else it is removed), staging folders and
    temporary trackers are removed. Returns what was done, one phrase per folder."""
    done = []
    for old in _leftovers(save_dir, None, "replaced"):
        name = os.path.basename(old).split(".")[1]
        final = os.path.join(save_dir, name)
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {os.path.basename(old)}")
        else:
            os.replace(old, final)
            done.append(f"restored {name} from {os.path.basename(old)}")
    for staged in _leftovers(save_dir, None, "incomplete"):
        shutil.rmtree(staged, ignore_errors=True)
        done.append(f"removed {os.path.basename(staged)}")
    for name in os.listdir(save_dir) if os.path.isdir(save_dir) else []:
        if name.startswith(f".{TRACKER}.") and name.endswith(".tmp"):
            os.remove(os.path.join(save_dir, name))
    return done


def _bad_tracker(text: bytes) -> str:
    """Why the bytes of a tracker are not an iteration number."""
    try:
        shown = text.decode("utf-8")
    except UnicodeDecodeError:
        return f"binary bytes ({text[:16]!r})"
    body = shown.strip()
    if not body:
        return "nothing"
    if not shown.isascii():
        return f"{shown!r}: not ASCII digits (Unicode digits are not an iteration number)"
    if re.fullmatch(r"[-+][0-9]+", body):
        return f"{shown!r}: a signed number"
    if re.fullmatch(r"[0-9]+", body):
        return f"{shown!r}: whitespace around the number (only one trailing newline is allowed)"
    return repr(shown)


def read_tracker(load_dir: str, flag: str = "--load") -> int:
    """The iteration ``load_dir``'s tracker names: ASCII digits, optionally one trailing newline; any
    other content, a tracker that is a directory or cannot be read raises CheckpointError naming the file
    and what it holds. The one tracker reader of both checkpoint formats (a Megatron-LM folder's goes
    through :func:`tracked_dir`, which also takes its ``release``)."""
    return int(_read_tracker(load_dir, flag, release=False))


def _read_tracker(load_dir: str, flag: str, *, release: bool) -> int | str:
    """read_tracker(); with ``release`` also the word ``release`` (returned as :data:`RELEASE`)."""
    path = os.path.join(load_dir, TRACKER)
    if os.path.isdir(path):
        raise CheckpointError(f"{flag} {load_dir}: {path} is a directory, expected the tracker file (an "
                              "iteration number, as --save writes it)")
    if not os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{flag} {load_dir}: no {TRACKER} there; expected a checkpoint directory written by --save "
            f"(holding {TRACKER} and iter_NNNNNNN/ folders)")
    try:
        with open(path, "rb") as f:
            raw = f.read(TRACKER_MAX_BYTES + 1)
    except OSError as e:
        raise CheckpointError(f"{flag} {load_dir}: cannot read {TRACKER} ({e.strerror or e})") from None
    body = raw[:-1] if raw.endswith(b"\n") else raw
    if len(raw) <= TRACKER_MAX_BYTES and re.fullmatch(rb"[0-9]{1,12}", body):
        return int(body)
    if release and body == RELEASE.encode():
        return RELEASE
    what = f"{len(raw)}+ bytes" if len(raw) > TRACKER_MAX_BYTES else _bad_tracker(raw)
    also = " or 'release'" if release else ""
    raise CheckpointError(f"{flag} {load_dir}: {path} holds {what}, expected an iteration number (ASCII "
                          f"digits, as --save writes it){also}")


def tracked_dir(load_dir: str, iteration: int | None = None, flag: str = "--load", *, release: bool = False
                ) -> tuple[str, int | str]:
    """(the iteration folder to read, its iteration) — the tracker's (:func:`read_tracker`) or the given
    ``iteration``'s: ``iter_N`` (:func:`iteration_dir`), or ``release/`` where a Megatron-LM tracker says
    ``release`` (its iteration then :data:`RELEASE`). The one iteration-folder rule of both formats."""
    it = _read_tracker(load_dir, flag, release=release) if iteration is None else iteration
    if it == RELEASE:
        return os.path.join(load_dir, RELEASE), it
    return iteration_dir(load_dir, int(it)), it


def check_recorded_iteration(recorded: object, iteration: int, where: str, what: str) -> None:
    """A checkpoint's recorded iteration (``what`` in ``where``) must be its folder's and so its tracker's:
    a folder renamed or copied under another iteration's name would otherwise resume at the wrong step."""
    if type(recorded) is not int or recorded != iteration:
        raise CheckpointError(f"{where}: {what} is {recorded!r:.40}, but the checkpoint's folder is "
                              f"{iter_dirname(iteration)} (named by the tracker or --iteration); a checkpoint folder "
                              "must keep the iteration it was saved at")


def swap_into_place(staged: str, final: str) -> None:
    """Move a finished folder to ``final``; an existing one is removed only after the new one is there
    (in one atomic switch where the system can exchange two folders)."""
    if os.path.exists(final) and exchange(staged, final):
        shutil.rmtree(staged, ignore_errors=True)  # the old folder, now under the staging name
    elif os.path.exists(final):
        old = final.rstrip("/") + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(staged, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staged, final)


def exchange(a: str, b: str) -> bool:
    """Swap the paths ``a`` and ``b`` in one atomic rename; False (nothing changed) where the system or
    the file system cannot (not Linux, a libc without ``renameat2``, a network file system)."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV):
        return False
    raise OSError(code, f"exchanging {a} and {b}: {os.strerror(code)}")


def _step(name: str) -> None:
    if FAULT is not None:
        FAULT(name)


# The steps of a commit, in order, for each way of replacing an existing iteration (a new one: the same
# without the first step).
EXCHANGE_STEPS = ("old and new exchanged", "tracker written", "tracker replaced", "old removed")
COMMIT_STEPS = ("old moved aside", "new moved in", "tracker written", "tracker replaced", "old removed")


def _move_in(staged: str, final: str, save_dir: str, iteration: int, tag: str | None) -> str | None:
    """``staged`` becomes ``final``; returns where the replaced folder now lies (None: there was none)."""
    if not os.path.lexists(final):
        os.replace(staged, final)
        _step(COMMIT_STEPS[1])
        return None
    if exchange(staged, final):  # one atomic switch: the old folder now lies at the staging name
        _step(EXCHANGE_STEPS[0])
        return staged
    old = replaced_dir(save_dir, iteration, tag)
    shutil.rmtree(old, ignore_errors=True)
    os.replace(final, old)
    _step(COMMIT_STEPS[0])
    os.replace(staged, final)
    _step(COMMIT_STEPS[1])
    return old


def commit(save_dir: str, iteration: int, staged: str | None = None) -> str:
    """Move the complete ``staged`` folder (default: this process's staging folder) to ``iter_N``, then
    point the tracker at it. A kill between any two steps leaves a loadable checkpoint: an existing
    ``iter_N`` is exchanged with the new folder in one rename where the system can (else first set aside
    as ``.iter_N.replaced.TAG``, which loading finds while ``iter_N`` is absent) and removed only after
    the tracker was written."""
    staged = staged or staging_dir(save_dir, iteration)
    final = os.path.join(save_dir, iter_dirname(iteration))
    tag = os.path.basename(staged).rsplit(".incomplete.", 1)[-1] if ".incomplete." in staged else None
    old = _move_in(staged, final, save_dir, iteration, tag)
    tmp = os.path.join(save_dir, f".{TRACKER}.{tag or run_tag()}.tmp")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    _step(COMMIT_STEPS[2])
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    _step(COMMIT_STEPS[3])
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
        _step(COMMIT_STEPS[4])
    return final
