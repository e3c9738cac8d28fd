"""Locks on files that hold across processes and threads: what lets every process share one graph cache
(:mod:`~layerwise.model.backends.cache`).

A :class:`FileLock` is ``flock`` on a small file: exclusive, re-entrant within a thread (an ``RLock`` per path in the
process, so threads exclude each other too: ``flock`` alone would let two threads of one process in through one
descriptor), and released by the kernel when its process dies, so a killed process never leaves a lock held. A
lock file may be removed while nobody holds it (:meth:`FileLock.remove`): whoever had opened the removed file and then
got the lock sees that the path now names another file, and locks that one instead.

Where ``fcntl`` is missing (Windows), a lock holds between the threads of one process only.

Example::

    >>> with FileLock(tmp / ".locks" / "x.lock"):          # doctest: +SKIP
    ...     ...                                           # no other process or thread holds it here
"""

from __future__ import annotations

import errno
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: the locks hold within the process only
    fcntl = None  # type: ignore[assignment]


@dataclass
class _State:
    """One lock path in this process: its in-process lock, the locked descriptor and how deep it is held."""

    rlock: threading.RLock = field(default_factory=threading.RLock)
    fd: int | None = None
    count: int = 0


_GUARD = threading.Lock()
_STATES: dict[str, _State] = {}


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (a zombie counts as alive; on a system without ``os.kill(pid, 0)`` every
    process is assumed alive)."""
    if pid <= 0:
        return False
    if pid == os.getpid():
        return True
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except OSError:
        return True
    return True


def _open_locked(path: Path, blocking: bool) -> int | None:
    """A descriptor of ``path`` (made if absent) locked by ``flock``, or ``None`` when ``blocking`` is false and
    another holds it. Re-opened until the locked file is the one at ``path`` (it may be removed while waited for)."""
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        except FileNotFoundError:  # its directory was removed meanwhile (a cleared cache)
            path.parent.mkdir(parents=True, exist_ok=True)
            continue
        if fcntl is None:
            return fd
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        try:
            here, locked = os.stat(path), os.fstat(fd)
            if (here.st_ino, here.st_dev) == (locked.st_ino, locked.st_dev):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # removed (and perhaps made again) while it was waited for: lock the file now at the path


class FileLock:
    """An exclusive lock on ``path`` across processes (``flock``) and threads, re-entrant within a thread.

    Args:
        path: the lock file (made, with its directory, when first taken; zero bytes).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        with _GUARD:
            self._state = _STATES.setdefault(os.path.abspath(self.path), _State())

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock (waiting for it when ``blocking``); ``False`` when not blocking and another holds it. A lock
        file that cannot be made (a read-only cache) is a lock within this process only."""
        state = self._state
        if not state.rlock.acquire(blocking):
            return False
        if state.count == 0:
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                fd = _open_locked(self.path, blocking)
            except PermissionError:
                fd = -1  # cannot be written: nobody else can build or trim here either
            except OSError as exc:
                if exc.errno != errno.EROFS:
                    state.rlock.release()
                    raise
                fd = -1
            except BaseException:
                state.rlock.release()
                raise
            if fd is None:
                state.rlock.release()
                return False
            state.fd = fd
        state.count += 1
        return True

    def release(self) -> None:
        """Give the lock back (the last release of a re-entrant hold unlocks the file)."""
        state = self._state
        state.count -= 1
        if state.count == 0 and state.fd is not None:
            if state.fd >= 0:
                os.close(state.fd)  # closing the only descriptor releases the flock
            state.fd = None
        state.rlock.release()

    def held(self) -> int:
        """How many times this process holds it (only meaningful in the thread that holds it)."""
        return self._state.count

    def remove(self, held: int = 0) -> bool:
        """Remove the lock file when nobody else holds it (``held``: how many times the calling thread already holds
        it); ``True`` when removed. Safe against a process waiting for it (see the module docstring)."""
        if not self.acquire(blocking=False):
            return False
        try:
            if self._state.count != held + 1:
                return False
            try:
                self.path.unlink()
            except OSError:
                return False
            return True
        finally:
            self.release()

    def __enter__(self) -> "FileLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder_alive(path: Path, pid: int) -> bool:
    """Whether the lease file ``path`` that process ``pid`` made is still held: a live process keeps an exclusive
    ``flock`` on it (so a shared one cannot be taken), which the kernel drops when it dies, whatever its PID namespace;
    without ``fcntl``, whether ``pid`` is alive. ``False`` when the file is gone."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return False
    try:
        if fcntl is None:
            return pid_alive(pid)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        return False
    finally:
        os.close(fd)


def lock_exclusive(fd: int) -> None:
    """``flock`` ``fd`` exclusively, at once (a lease file of this process's own); nothing without ``fcntl``."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


__all__ = ["FileLock", "holder_alive", "lock_exclusive", "pid_alive"]
