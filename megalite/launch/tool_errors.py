"""Interrupts and the system's refusals in the command-line tools, each said in one line.

Every tool under ``tools/`` and ``tasks/main.py`` runs its body through :func:`tool_main`: Ctrl-C becomes
``NAME: interrupted; <what was left>`` and exit status 130 (the shell's 128 + SIGINT), an OSError (a full
disk, a file-size limit, a permission, a missing folder) becomes ``NAME: error: PATH: reason`` and a
non-zero status, never a traceback. A file-size limit (``ulimit -f``) sends SIGXFSZ, which kills a process
before Python can say anything; :func:`tool_main` ignores the signal so the write raises EFBIG instead.

A tool writes each output through :func:`atomic_output`: a temporary name beside the output, renamed over
it only once complete, so an interrupt or a failed write leaves no partial file (and the old output, if
any, as it was)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C'd command


def describe_os_error(e: OSError) -> str:
    """An OSError as one line: the path(s) it names and the system's reason."""
    if e.strerror is None:  # raised with a message of its own
        text = str(e) or type(e).__name__
        return " ".join(text.split())
    paths = " -> ".join(str(p) for p in (e.filename, e.filename2) if p is not None)
    reason = e.strerror
    if e.errno == errno.EFBIG:
        reason += " (the file-size limit, ulimit -f, was reached)"
    return f"{paths}: {reason}" if paths else f"{reason} ({errno.errorcode.get(e.errno, e.errno)})"


def ignore_file_size_signal() -> None:
    """Let a write past the file-size limit raise EFBIG (caught, said in one line) instead of SIGXFSZ killing
    the process without a word. Only the main thread may set a handler; elsewhere this does nothing."""
    if hasattr(signal, "SIGXFSZ") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def tool_main(name: str, body: Callable[[], int | None], *, error_status: int = 1,
              interrupted: Callable[[], str] = lambda: "nothing written") -> int:
    """Run a tool's ``body`` (its exit status, None meaning 0) with Ctrl-C and OSErrors said in one line on
    stderr. ``interrupted()`` says what an interrupt left (default: nothing, as :func:`atomic_output`
    ensures)."""
    ignore_file_size_signal()
    try:
        return body() or 0
    except KeyboardInterrupt:
        print(f"{name}: interrupted; {interrupted()}", file=sys.stderr)
        return INTERRUPTED
    except OSError as e:
        print(f"{name}: error: {describe_os_error(e)}", file=sys.stderr)
        return error_status


def temporary_name(path: str) -> str:
    """This process's temporary name for ``path``, beside it (the same file system, so a rename is atomic),
    ending as ``path`` does (a library may choose the format by the extension)."""
    parent, base = os.path.split(os.path.abspath(path))
    return os.path.join(parent, f".{base}.tmp-{os.getpid()}{os.path.splitext(base)[1]}")


def first_existing(path: str) -> str:
    """The nearest of ``path`` and its ancestors that exists (what a failed write must not remove)."""
    p = os.path.abspath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    return p


def remove_created(dest: str, existed: str) -> None:
    """Remove the empty folders a failed write created, from ``dest`` up to ``existed``."""
    p = os.path.abspath(dest)
    while p != existed and p.startswith(existed.rstrip(os.sep) + os.sep):
        try:
            os.rmdir(p)
        except OSError:
            return
        p = os.path.dirname(p)


@contextlib.contextmanager
def atomic_output(path: str) -> Iterator[str]:
    """Yield a temporary name to write ``path`` under; it replaces ``path`` when the body completes, and is
    removed (``path`` untouched) when the body fails or is interrupted."""
    tmp = temporary_name(path)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_folder_files(folder: str) -> Iterator[str]:
    """Yield a temporary folder beside ``folder`` to write files into; on success each file is moved into
    ``folder`` (created if needed), on failure the temporary folder is removed and ``folder`` is untouched."""
    import shutil

    tmp = temporary_name(folder.rstrip(os.sep) or folder)
    existed = first_existing(folder)
    done = False
    try:
        os.makedirs(tmp, exist_ok=True)
        yield tmp
        os.makedirs(folder, exist_ok=True)
        for entry in sorted(os.listdir(tmp)):
            os.replace(os.path.join(tmp, entry), os.path.join(folder, entry))
        done = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if not done:  # the parents made for the temporary folder go too (``folder`` itself if emptied)
            remove_created(folder, existed)
            remove_created(os.path.dirname(tmp), existed)
