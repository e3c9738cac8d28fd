"""One writer per store: the advisory lock file ``STORE/writer.lock`` that the process writing a store holds.

The lock is ``fcntl.flock`` (exclusive, non-blocking) on ``writer.lock``, which holds its holder's facts as JSON::

    {"format": "layerwise-store-lock", "pid": 4242, "host": "node7", "since": "2026-11-25T10:00:00+00:00",
     "command": "layerwise extract corpus.tsv -o feats"}

* The kernel drops a ``flock`` when its process ends, however it ends (``kill -9`` included), so the file of a
  crashed writer stays behind unlocked: a **stale** lock. A new writer on the same host takes it over and says so
  in one line (:attr:`StoreLock.took_over`). A lock file naming another host is not taken over: this host cannot
  tell whether that process still runs (the message says to delete the file once it has ended).
* A second writer while the first holds the lock is refused with a :class:`~layerwise.StoreError` naming the holder
  (pid, host, since when, its command) and what to do.
* A writer that finishes (or fails) removes the file while it still holds the lock; a writer that takes a lock
  checks that the file it locked is still the one at ``writer.lock``, so a lock released at that moment is never
  held by two.
* :func:`lock_state` tells a reader (``layerwise verify``) whether a live writer holds the store, or a dead one left
  its file, without keeping the lock.

``flock`` is advisory: it binds layerwise's writers, not other programs. It works on local file systems and on NFS
(Linux maps it to NFS locks); a file system without locks is reported. Without ``fcntl`` (not POSIX) the lock file
alone is the lock: a live process of this host named in it holds the store.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import StoreError
from ..provenance import now

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: the lock file's pid is the lock (see _flock)
    fcntl = None  # type: ignore[assignment]

LOCK = "writer.lock"
LOCK_FORMAT = "layerwise-store-lock"
RETRY_SECONDS = 1.0  # a reader's probe holds the lock for an instant: a writer tries again for this long


def host() -> str:
    """This machine's host name, as lock files record it."""
    return socket.gethostname()


def pid_alive(pid: int) -> bool:
    """Whether a process with id ``pid`` exists on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


@dataclass(frozen=True)
class LockHolder:
    """What a lock file says about the process that holds (or held) it."""

    pid: int
    host: str
    since: str
    command: str = ""

    @property
    def here(self) -> bool:
        """The holder ran on this host (its pid means something here)."""
        return self.host == host()

    def describe(self) -> str:
        """``pid 4242 on host node7 since 2026-11-25T10:00:00+00:00 (layerwise extract ...)``."""
        return (f"pid {self.pid} on host {self.host} since {self.since}"
                + (f" ({self.command})" if self.command else ""))


def _parse(raw: bytes) -> tuple[bool, LockHolder | None]:
    """``(ours, holder)`` of a lock file's bytes: ``ours`` is False when they are not a layerwise lock file; the
    holder is ``None`` when the file is empty (a writer between creating and filling it)."""
    if not raw.strip():
        return True, None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):
        return False, None
    if not isinstance(data, dict) or data.get("format") != LOCK_FORMAT or type(data.get("pid")) is not int:
        return False, None
    return True, LockHolder(data["pid"], str(data.get("host", "")), str(data.get("since", "")),
                            str(data.get("command", "")))


def _read_fd(fd: int) -> tuple[bool, LockHolder | None]:
    os.lseek(fd, 0, os.SEEK_SET)
    return _parse(os.read(fd, 1 << 16))


def _flock(fd: int, exclusive: bool) -> None:
    """Lock ``fd`` (exclusive or shared, never waiting): ``BlockingIOError`` when another holds it. Without
    ``fcntl`` (not POSIX) a live process of this host named in the file holds it."""
    if fcntl is not None:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        return
    _, holder = _read_fd(fd)  # pragma: no cover
    if holder is not None and holder.here and holder.pid != os.getpid() and pid_alive(holder.pid):  # pragma: no cover
        raise BlockingIOError(errno.EWOULDBLOCK, "held")


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _mine(holder: LockHolder | None) -> bool:
    """The holder is this process."""
    return holder is not None and holder.pid == os.getpid() and holder.here


def _foreign(path: Path) -> StoreError:
    return StoreError(f"{str(path)!r} is not a layerwise lock file (its content is not {LOCK_FORMAT!r} JSON); "
                      f"layerwise never replaces files it did not write: move it away, or choose another directory")


@dataclass(frozen=True)
class LockState:
    """What :func:`lock_state` found: the holder the file names (``None``: empty or unreadable) and whether a live
    process holds the lock (``live``)."""

    holder: LockHolder | None
    live: bool

    def describe(self) -> str:
        """One line for ``verify``: who writes the store now, or which writer ended without finishing."""
        who = self.holder.describe() if self.holder is not None else "a writer that left no details"
        if self.live:
            return f"a run is writing it now: {who}"
        return f"its writer ({who}) ended without finishing"


def lock_state(store: str | os.PathLike) -> LockState | None:
    """Whether a writer holds the store at ``store``: ``None`` when there is no lock file (no writer, or one that
    finished), else a :class:`LockState`. Takes a shared lock for an instant to ask the kernel; keeps nothing."""
    path = Path(store) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        _, holder = _read_fd(fd)
        try:
            _flock(fd, exclusive=False)
        except BlockingIOError:
            live = True
        else:
            live = False
            _unlock(fd)
    finally:
        os.close(fd)
    return LockState(holder, live)


class StoreLock:
    """The exclusive lock on one store directory (which must exist), held from :meth:`acquire` to :meth:`release`.

    Attributes:
        path: the lock file. took_over: the one-line notice when :meth:`acquire` took over a stale lock, else
            ``None``. read_only: the directory is not writable by this process (a finished store on a read-only
            disk): :meth:`acquire` takes no lock, and any write fails as it would without one.

    Example::

        >>> with StoreLock(store_dir):        # doctest: +SKIP
        ...     ...                           # write the store
    """

    def __init__(self, store: str | os.PathLike):
        self.store = Path(store)
        self.path = self.store / LOCK
        self.took_over: str | None = None
        self.read_only = False  # the directory is not writable by this process: nothing taken, nothing to exclude
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """This object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> "StoreLock":
        """Take the lock, or raise.

        Raises:
            StoreError: a live writer holds it (naming it: pid, host, since when, its command, and what to do), a
                lock file of another host whose process this host cannot see, or a ``writer.lock`` that layerwise
                did not write.
        """
        if self._fd is not None:
            return self
        deadline = time.monotonic() + RETRY_SECONDS
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and not os.access(self.store, os.W_OK):
                    self.read_only = True  # this process writes nothing here, so it needs no lock to read
                    return self
                raise
            try:
                _flock(fd, exclusive=True)
            except BlockingIOError:
                ours, holder = _read_fd(fd)
                os.close(fd)
                if ours and not _mine(holder) and time.monotonic() < deadline:  # a probe (verify) holds it briefly
                    time.sleep(0.05)
                    continue
                raise self._held(ours, holder) from None
            except OSError as exc:
                os.close(fd)
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise StoreError(f"the file system of {str(self.store)!r} does not support file locks "
                                     f"({exc.strerror}), so layerwise cannot make sure it is the only writer; write "
                                     f"the store on a local disk") from exc
                raise
            if self._same_file(fd):
                break
            os.close(fd)  # released and removed while we waited for it: lock the file that is there now
        try:
            self._take(fd)
        except BaseException:
            _unlock(fd)
            os.close(fd)
            raise
        self._fd = fd
        return self

    def _same_file(self, fd: int) -> bool:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(fd)
        return (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev)

    def _take(self, fd: int) -> None:
        """Write our facts into the locked file; a stale holder of this host is taken over (said in
        :attr:`took_over`), one of another host refused."""
        ours, previous = _read_fd(fd)
        if not ours:
            raise _foreign(self.path)
        self.took_over = None
        if previous is not None and not _mine(previous):
            if not previous.here:
                raise StoreError(
                    f"store {str(self.store)!r} has a lock file of {previous.describe()}, a process this host "
                    f"({host()}) cannot see. If that run has ended, delete {str(self.path)!r} and rerun this "
                    f"command; if it still runs, wait for it to finish"
                )
            why = ("has ended" if not pid_alive(previous.pid)
                   else "no longer holds it (its process number now belongs to another process)")
            self.took_over = f"took over the stale lock of {previous.describe()}: that writer {why}"
        data = {"format": LOCK_FORMAT, "pid": os.getpid(), "host": host(), "since": now(),
                "command": " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:300]}
        text = (json.dumps(data, ensure_ascii=False) + "\n").encode("utf-8")
        os.ftruncate(fd, 0)
        os.pwrite(fd, text, 0)

    def _held(self, ours: bool, holder: LockHolder | None) -> StoreError:
        if not ours:
            return _foreign(self.path)
        if _mine(holder):
            return StoreError(f"this process already writes store {str(self.store)!r} (another writer of it is "
                              f"open): finish or close that one first")
        who = holder.describe() if holder is not None else "another process (it has not said which yet)"
        stop = f"stop it (kill {holder.pid}) and " if holder is not None and holder.here else "stop it and "
        return StoreError(
            f"store {str(self.store)!r} is being written by another run: {who}. Wait for it to finish, or {stop}rerun "
            f"this command to resume the store; two runs into one store would compute every record twice and the "
            f"last manifest would win"
        )

    def release(self) -> None:
        """Remove the lock file and let the lock go (nothing when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._same_file(fd):
                os.unlink(self.path)  # while still locked: a waiting writer then sees the file is gone
        except OSError:
            pass  # a read-only or vanished directory: the unlocked file is stale, and the next writer takes it over
        finally:
            _unlock(fd)
            os.close(fd)

    def __del__(self) -> None:  # a writer dropped without closing lets its store go, as a file object would
        try:
            self.release()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    def __enter__(self) -> "StoreLock":
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()


__all__ = ["LOCK", "LOCK_FORMAT", "LockHolder", "LockState", "StoreLock", "host", "lock_state", "pid_alive"]
