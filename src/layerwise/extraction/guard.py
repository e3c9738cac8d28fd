"""The guard of a driver's own Ray cluster: a small process that ends the cluster's processes when the driver ends.

A local Ray cluster started by ``lw.ray.extract`` is a tree of processes under the driver (GCS server, raylet, the
dashboard and runtime-env agents, log monitor, workers). Ray ties only the first ones to the driver (Linux's
parent-death signal), so a driver killed with ``kill -9`` left ``ray::DashboardAgent`` and ``ray::RuntimeEnvAgent``
running for minutes. The driver therefore starts this guard first (:class:`~layerwise.extraction.cluster.Guard`),
in a session of its own and outside Ray's tree::

    python -m layerwise.extraction.guard DRIVER_PID MARKER

It reads its standard input, a pipe whose only writer is the driver: the driver writes the cluster's session
directory there once Ray runs, and the pipe reaches its end when the driver closes it or dies, however it dies
(the kernel closes a dead process's files). Then the guard ends the session's processes, and only them: processes
of this user that are

* under the driver's children that carry ``MARKER``, as last seen while it lived (each checked by its start time,
  so a process number taken again by another process is left alone; the driver's other children are not
  touched);
* or carry ``MARKER`` in their environment (the driver sets it for the cluster it starts; every Ray process
  inherits it);
* or name the session directory on their command line.

Each gets ``SIGTERM``, and ``SIGKILL`` after :data:`GRACE_SECONDS`. Other people's processes, and this user's
other Ray clusters, are never matched. It imports nothing but the standard library.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from typing import Callable

POLL_SECONDS = 0.5  # how often the driver's descendants are looked at while it lives
GRACE_SECONDS = 3.0  # between SIGTERM and SIGKILL
MARKER_VARIABLE = "LAYERWISE_RAY_GUARD"  # the environment variable whose value marks a guarded cluster's processes


def _stat(pid: int) -> tuple[int, int] | None:
    """``(parent pid, start time in clock ticks)`` of ``pid``, or ``None`` when it is gone (or a zombie: it has
    ended, only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
    except OSError:
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # after "pid (comm) ": state ppid ... starttime (field 22)
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[1]), int(fields[19])


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _mine(pid: int) -> bool:
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return False


def cluster_descendants(root: int, marker: str) -> dict[int, int]:
    """The processes under ``root`` now that belong to its guarded cluster: ``{pid: start time}`` of each child of
    ``root`` carrying ``marker`` and everything under such a child (the driver's other children are not the
    cluster's)."""
    children: dict[int, list[int]] = {}
    start: dict[int, int] = {}
    for pid in _pids():
        st = _stat(pid)
        if st is not None:
            children.setdefault(st[0], []).append(pid)
            start[pid] = st[1]
    tag = f"{MARKER_VARIABLE}={marker}".encode()
    out: dict[int, int] = {}
    todo = [pid for pid in children.get(root, []) if _marked(pid, tag, None)]
    while todo:
        pid = todo.pop()
        if pid in out or pid not in start:
            continue
        out[pid] = start[pid]
        todo.extend(children.get(pid, []))
    return out


def _marked(pid: int, marker: bytes, session: bytes | None) -> bool:
    """Whether ``pid`` carries the marker in its environment or names the session directory on its command line."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            if marker in fh.read().split(b"\0"):
                return True
        if session is not None:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                return session in fh.read()
    except OSError:
        pass
    return False


def session_processes(seen: dict[int, int], marker: str, session: str | None) -> list[int]:
    """This user's processes of the guarded session now: the descendants ``seen`` still alive (same start time),
    and every process carrying ``marker`` or naming ``session`` (not this one)."""
    me = os.getpid()
    tag = f"{MARKER_VARIABLE}={marker}".encode()
    where = session.encode() if session else None
    found = []
    for pid in _pids():
        if pid == me or not _mine(pid):
            continue
        st = _stat(pid)
        if st is None:
            continue
        if seen.get(pid) == st[1] or _marked(pid, tag, where):
            found.append(pid)
    return found


def end_processes(find: Callable[[], list[int]], grace: float = GRACE_SECONDS) -> int:
    """``SIGTERM`` what ``find()`` returns, then ``SIGKILL`` whatever it still returns after ``grace`` seconds (and
    what appeared meanwhile). Returns how many processes were signalled."""
    hit: set[int] = set()
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        deadline = time.monotonic() + wait
        while True:
            left = find()
            if not left or time.monotonic() >= deadline:
                break
            for pid in left:
                if sig == signal.SIGTERM and pid in hit:
                    continue
                try:
                    os.kill(pid, sig)
                    hit.add(pid)
                except OSError:
                    pass
            time.sleep(0.1)
        if sig == signal.SIGKILL:
            for pid in find():
                try:
                    os.kill(pid, signal.SIGKILL)
                    hit.add(pid)
                except OSError:
                    pass
    return len(hit)


def guard(driver: int, marker: str) -> None:
    """Watch ``driver`` until standard input ends, then end its cluster's processes (see the module docstring)."""
    seen: dict[int, int] = {}
    session: str | None = None
    buf = b""
    fd = sys.stdin.fileno()
    while True:
        seen.update(cluster_descendants(driver, marker))
        ready, _, _ = select.select([fd], [], [], POLL_SECONDS)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"session "):
                session = line[len(b"session ") :].decode(errors="surrogateescape")
    end_processes(lambda: session_processes(seen, marker, session))


def main(argv: list[str]) -> int:
    """``python -m layerwise.extraction.guard DRIVER_PID MARKER``."""
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # the terminal's signals are the driver's to take
    if len(argv) != 2 or not argv[0].isdigit() or not argv[1]:
        print("usage: python -m layerwise.extraction.guard DRIVER_PID MARKER", file=sys.stderr)
        return 2
    guard(int(argv[0]), argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
