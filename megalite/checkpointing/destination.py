"""One rule for every writer of a checkpoint folder (training and every conversion): before anything is
written, :func:`claim` refuses a destination that is, contains or lies inside a source (compared by resolved
path and by device and inode, so a symlink or a bind mount of the source is the source), or lies inside a
folder a live run holds, and takes the destination's lock (``lock.py``, the lock a training run holds).

A writer that replaces its destination as a whole (every ``convert_checkpoint.py`` subcommand) then writes
into a per-process staging sibling (:func:`replacing`) that is switched into place only once complete, so a
failure, an interrupt or a full disk leaves the destination as it was and no partial output. ``--overwrite``
thus never removes a source (refused above) nor a folder a live run holds (its lock, or a held lock below it,
refuses the claim). Training writes into its folder in place (its saves replace only their own iteration
folders), so there ``--save`` equal to ``--load`` is a resume, not a conflict."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterator, Sequence

try:
    import resource
except ImportError:  # not on every system
    resource = None  # type: ignore[assignment]

from megalite.checkpointing.errors import CheckpointError
from megalite.checkpointing.lock import LOCK, Owner, SaveLock, is_stale, read_owner
from megalite.checkpointing.paths import exchange, run_tag
from megalite.launch.tool_errors import first_existing, remove_created

Sources = Sequence[tuple[str, str | None]]  # (flag, path) of everything a writer reads; None: not given
SCAN_LIMIT = 100_000  # folders looked at for live locks below a destination about to be replaced
COMMITTED: list[str] = []  # destinations replaced by this process, for an interrupt's message
# The system's reasons a write fails that are the destination's (not a bug): said in one line.
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS,
                          errno.EIO})


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _chain(path: str) -> list[tuple[str, tuple[int, int] | None]]:
    """``path`` (resolved) and each of its ancestors, with their (device, inode) where they exist."""
    out, p = [], os.path.realpath(path)
    while True:
        out.append((p, _identity(p)))
        parent = os.path.dirname(p)
        if parent == p:
            return out
        p = parent


def relation(dest: str, source: str) -> str | None:
    """How ``dest`` stands to ``source``: "is", "contains", "lies inside", or None (apart)."""
    d, s = _chain(dest), _chain(source)
    d_ids, s_ids = [i for _, i in d], [i for _, i in s]
    if d[0][0] == s[0][0] or (d_ids[0] is not None and d_ids[0] == s_ids[0]):
        return "is"
    if s[0][0] in [p for p, _ in d[1:]] or (s_ids[0] is not None and s_ids[0] in d_ids[1:]):
        return "lies inside"
    if d[0][0] in [p for p, _ in s[1:]] or (d_ids[0] is not None and d_ids[0] in s_ids[1:]):
        return "contains"
    return None


def check_sources(dest: str, sources: Sources, flag: str = "--save") -> None:
    """Refuse a destination that is, contains or lies inside a source; one line naming both flags."""
    for src_flag, src in sources:
        if not src:
            continue
        how = relation(dest, src)
        if how is None:
            continue
        if how == "is":
            alias = "" if os.path.abspath(dest) == os.path.abspath(src) else " by another path"
            raise CheckpointError(f"{flag} {dest} must differ from {src_flag} {src}: it is the same folder{alias}, "
                                  "and a writer never writes over what it reads; choose another " + flag)
        why = ("replacing it (--overwrite) would remove the source" if how == "contains"
               else "the output would be written into its source")
        raise CheckpointError(f"{flag} {dest} {how} {src_flag} {src}: {why}; choose a {flag} apart from it")


def _live(folder: str) -> Owner | None:
    """The live holder of ``folder``'s lock (an owner still being written counts as live), or None."""
    path = os.path.join(folder, LOCK)
    if not os.path.isfile(path):
        return None
    owner = read_owner(path)
    if owner is None:
        return Owner("?", -1, None, "(its lock is being written or is damaged)", "")
    return None if is_stale(owner) else owner


def check_live_runs(dest: str, flag: str = "--save", replacing: bool = False) -> None:
    """Refuse a destination inside a folder a live run holds, and (``replacing``: the destination is about
    to be replaced as a whole) one holding such a folder below it."""
    for folder, _ in _chain(dest)[1:]:
        owner = _live(folder)
        if owner is not None:
            raise CheckpointError(f"{flag} {dest} lies inside {folder}, which a live run saves into "
                                  f"({owner.describe()}); choose a {flag} outside it")
    if not (replacing and os.path.isdir(dest)):
        return
    for n, (root, dirs, _) in enumerate(os.walk(dest)):
        if n >= SCAN_LIMIT:
            raise CheckpointError(f"{flag} {dest} holds over {SCAN_LIMIT} folders; it is not replaced as a whole "
                                  "(choose a new folder)")
        owner = _live(root) if root != dest else None
        if owner is not None:
            raise CheckpointError(f"{flag} {dest} holds {root}, which a live run saves into ({owner.describe()}); "
                                  "--overwrite never removes it: choose another " + flag)
        dirs[:] = [d for d in dirs if not os.path.islink(os.path.join(root, d))]


@contextlib.contextmanager
def claim(dest: str, sources: Sources, say: Callable[[str], None], *, flag: str = "--save", in_place: bool = False,
          replacing: bool = False) -> Iterator[SaveLock]:
    """The start of every write into ``dest``: the source and live-run checks above, then ``dest``'s lock
    (created with the folder where needed), held for the body; a folder the claim created is removed again
    when the body fails and left it empty. ``in_place``: the writer adds to ``dest`` and removes nothing but
    what it wrote (training: its saves replace only their own iteration folders), so ``dest`` may be, hold
    or lie inside a source (``--save`` equal to ``--load`` is a resume); the sources are not compared."""
    if not in_place:
        check_sources(dest, sources, flag)
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise CheckpointError(f"{flag} {dest} is a file, not a directory; choose a new directory")
    check_live_runs(dest, flag, replacing)
    existed = first_existing(dest)
    if not os.path.isdir(existed):
        raise CheckpointError(f"{flag} {dest}: {existed} is a file, not a directory; choose a new directory")
    try:
        os.makedirs(dest, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{flag} {dest}: cannot create the folder ({e.strerror or e})") from None
    lock = SaveLock(dest, flag)
    try:
        lock.acquire(say)
    except BaseException:
        remove_created(dest, existed)
        raise
    try:
        yield lock
    finally:
        lock.release()
        remove_created(dest, existed)


def staging_sibling(dest: str, kind: str = "incomplete", tag: str | None = None) -> str:
    """This process's staging (or set-aside) folder for ``dest``: ``.NAME.KIND.TAG`` beside it."""
    parent, name = os.path.split(os.path.abspath(dest))
    return os.path.join(parent, f".{name}.{kind}.{tag or run_tag()}")


def _sweep(dest: str) -> list[str]:
    """Remove the staging folders writers of ``dest`` that died left beside it (only the holder of its lock
    may: every writer of ``dest`` holds that lock while its staging folder exists). A folder an interrupted
    switch set aside is removed only when the new one arrived; else it is the only copy, and is named."""
    parent, name = os.path.split(os.path.abspath(dest))
    pattern = re.compile(rf"\.{re.escape(name)}\.(incomplete|replaced)\..+")
    arrived = any(entry != LOCK for entry in os.listdir(dest))
    done = []
    for entry in sorted(os.listdir(parent)):
        match = pattern.fullmatch(entry)
        if not match:
            continue
        if match.group(1) == "replaced" and not arrived:
            raise CheckpointError(f"{os.path.join(parent, entry)} holds what an interrupted --overwrite of {dest} "
                                  f"set aside, and {dest} is empty: move it back to {dest} (or remove it) first")
        shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)
        done.append(entry)
    return done


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Ctrl-C waits for the body (the two renames of a switch must not be parted)."""
    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_sigmask")
    if main:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        if main:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _switch(staged: str, dest: str) -> str:
    """Put ``staged`` at ``dest`` (which exists: the claim made it); returns where the old folder now lies."""
    if exchange(staged, dest):
        return staged
    old = staging_sibling(dest, "replaced")
    os.replace(dest, old)
    try:
        os.replace(staged, dest)
    except BaseException:
        os.replace(old, dest)
        raise
    return old


def _probable_reason(folder: str) -> str:
    """Why a library's write failed where it does not say (torch.save): a full disk or a file-size limit
    where one is found, else that the reason is unknown."""
    with contextlib.suppress(OSError):
        st = os.statvfs(first_existing(folder))
        if st.f_bavail * st.f_frsize < (1 << 20):
            return os.strerror(errno.ENOSPC)
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE) if resource else (None, None)
    if resource and soft != resource.RLIM_INFINITY:
        return f"{os.strerror(errno.EFBIG)} (this process may write files of at most {soft} bytes)"
    return "the library gave no reason"


def write_failure(e: BaseException, staged: str) -> str | None:
    """The system's reason when ``e`` is a failed write (an OSError of WRITE_ERRNOS, or one a library wrapped:
    safetensors, torch.distributed.checkpoint, torch.save), else None."""
    if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
        where = f" ({e.filename})" if e.filename and not str(e.filename).startswith(staged) else ""
        return (e.strerror or os.strerror(e.errno)) + where
    if type(e).__name__ == "SafetensorError" or isinstance(e, CheckpointError):  # the OS error in its text
        code = re.search(r"os error (\d+)", str(e))
        return os.strerror(int(code.group(1))) if code and int(code.group(1)) in WRITE_ERRNOS else None
    for wrapped in getattr(e, "failures", {}).values():  # torch.distributed.checkpoint's CheckpointException
        inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
        if isinstance(inner, BaseException) and write_failure(inner, staged):
            return write_failure(inner, staged)
    if isinstance(e, RuntimeError) and re.search(r"PytorchStreamWriter|inline_container", str(e)):
        return _probable_reason(staged)
    return None


def _wrapped_interrupt(e: BaseException) -> bool:
    return any(isinstance(w[0] if isinstance(w, tuple) else w, KeyboardInterrupt)
               for w in getattr(e, "failures", {}).values())


@contextlib.contextmanager
def replacing(dest: str, lock: SaveLock, say: Callable[[str], None], flag: str = "--save") -> Iterator[str]:
    """A per-process staging folder (not yet created) that replaces the claimed ``dest`` as a whole once the
    body completes: one atomic exchange where the system has one, else two renames with Ctrl-C deferred
    between them. On failure the staging folder is removed and ``dest`` is untouched; an OSError becomes one
    line naming the folder and the system's reason."""
    left = _sweep(dest)
    if left:
        say(f"{flag} {dest}: removed what interrupted writers left beside it: {', '.join(left)}")
    staged = staging_sibling(dest)
    try:
        yield staged
        os.makedirs(staged, exist_ok=True)
        lock.plant(staged)  # the new folder carries the lock: dest is never unlocked while switched
        with _sigint_deferred():
            old = _switch(staged, dest)
            COMMITTED.append(os.path.abspath(dest))
    except BaseException as e:
        shutil.rmtree(staged, ignore_errors=True)
        if _wrapped_interrupt(e):
            raise KeyboardInterrupt from None
        reason = write_failure(e, staged)
        if reason is not None:
            raise CheckpointError(f"{flag} {dest}: writing failed: {reason}; nothing was written, {dest} is as "
                                  "it was") from None
        if isinstance(e, CheckpointError) and staged in str(e):  # a writer named the staging folder: name dest
            raise CheckpointError(str(e).replace(staged, dest)) from None
        raise
    shutil.rmtree(old, ignore_errors=True)
