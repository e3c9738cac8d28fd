"""Connection limits of ``layerwise serve``: how long a client may take to send a request, how long an idle
connection is kept, and how many connections are open at once.

============================  =======  ========================================================================
limit (CLI flag)              default  what happens when it is reached
============================  =======  ========================================================================
``header_timeout``            10 s     the request line and headers are not complete this long after the
(``--header-timeout``)                 connection opened (a fresh connection, idle or not) or after the first byte
                                       of a later request on a kept-alive connection: the connection is closed (a
                                       408 first if some of the request had arrived)
``body_timeout``              30 s     the whole body has not arrived this long after its headers: a deadline for
(``--body-timeout``)                   the body, not a per-chunk idle time, so trickling bytes does not extend it;
                                       408 and close (only close if the answer has started)
``keep_alive_timeout``        5 s      no next request begins this long after an answer: closed (uvicorn's own
(``--keep-alive-timeout``)             keep-alive timer, ``timeout_keep_alive``)
``send_timeout``              30 s     the client has taken less than 64 KiB of an answer in this long (the bytes
(``--send-timeout``)                   it has not acknowledged, in the server's and the kernel's send buffers,
                                       have not shrunk by that): the connection is reset and the answer's memory
                                       freed (as nginx's ``send_timeout``, between reads, so a slow reader that
                                       keeps reading is served)
``max_connections``           1024     a connection beyond this many open ones is answered 503 at once, before
(``--max-connections``)                its request is read (``Retry-After: 1``, ``Connection: close``), and
                                       closed; the open ones are untouched. :data:`PROBE_SLOTS` more are kept for
                                       orchestrators' probes: there only ``GET``/``HEAD`` ``/health`` and ``/ready``
                                       are answered (a Kubernetes liveness probe sees 200 at the cap), anything
                                       else 503
============================  =======  ========================================================================

How. uvicorn 0.54 (h11 or httptools) has no header or body read timeout: a connection that sends nothing, or a
header or body a byte every few seconds, stays open for good (measured in issue 39: all still open after 60 s). Its
``limit_concurrency=N`` is no connection cap either: it is checked when a complete request head arrives, and
answers that request 503 if ``N`` connections are open (the asking one included) or ``N`` requests are running;
connections themselves are accepted and kept without bound, idle or half-sent ones included. So :class:`LimitedH11`
subclasses uvicorn's h11 protocol: one ``loop.call_later`` timer per connection, armed when a request head or body
is awaited and cancelled when it is complete, and the cap is checked as each connection is made. The h11
protocol is used whether or not httptools is installed (layerwise does not depend on it), so the limits behave the
same everywhere; the parse cost is small beside a forward pass. h11 also bounds a request head to 16 KiB (400 past
it). A body whose reading uvicorn pauses because the app has not consumed 64 KiB of it yet still counts against
``body_timeout``; layerwise's routes read bodies at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct

try:  # Unix: the kernel's unacknowledged bytes of a socket (see LimitedH11.unacked)
    import fcntl
    import termios
except ImportError:  # pragma: no cover - Windows
    fcntl = termios = None  # type: ignore[assignment]
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..errors import LayerwiseError
from .ceilings import Ceilings

log = logging.getLogger("layerwise.serve")

MAX_SECONDS = 3600.0  # the largest timeout accepted: an hour
MAX_CONNECTIONS = 1_000_000


def plain_response(status: str, text: str, *headers: str) -> bytes:
    """The bytes of a whole ``Connection: close`` HTTP/1.1 answer with a plain-text body, written past h11."""
    body = text.encode()
    head = [f"HTTP/1.1 {status}", "content-type: text/plain; charset=utf-8", f"content-length: {len(body)}",
            *headers, "connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


TIMEOUT_408 = plain_response("408 Request Timeout", "Request Timeout")
PROBE_SLOTS = 8  # connections past the cap kept for GET/HEAD /health and /ready
# what a client must take of its answer within each send timeout: a client that reads nothing still sees its
# kernel take a few kB now and then (its receive queue compacted), which must not count as reading
MIN_PROGRESS = 64 << 10
PROBES = (b"GET /health", b"HEAD /health", b"GET /ready", b"HEAD /ready")
BUSY_503 = plain_response("503 Service Unavailable", "Too many open connections; retry in a moment", "retry-after: 1")


@dataclass(frozen=True)
class ConnectionLimits:
    """Connection limits of the service (seconds, and a count of open connections); see the module's table."""

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024
    send_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout", "send_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_SECONDS:
                raise LayerwiseError(f"--{name.replace('_', '-')} (ConnectionLimits.{name}) must be seconds in "
                                     f"(0, {MAX_SECONDS:g}], got {value!r} (default {DEFAULTS[name]:g})")
        n = self.max_connections
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_CONNECTIONS:
            raise LayerwiseError(f"--max-connections (ConnectionLimits.max_connections) must be an int in "
                                 f"1..{MAX_CONNECTIONS}, got {n!r} (default {DEFAULTS['max_connections']})")

    def protocol(self, refused: Callable[[int], None] | None = None,
                 ceilings: Ceilings | None = None) -> type[LimitedH11]:
        """The uvicorn HTTP protocol class that enforces these limits: pass it as ``uvicorn.run(app, http=...)``.
        ``refused(status)`` is called for every answer given below the app (503 past the cap, 408 on a deadline,
        400 for a request h11 cannot parse), so the metrics count them. ``ceilings``: the app's
        (:mod:`layerwise.serve.ceilings`), told of every open connection (their send buffers count against its
        ``max_unsent_bytes``) and of every one dropped by the send timeout."""
        return type("LimitedH11", (LimitedH11,), {"limits": self, "counters": (refused,) if refused else (),
                                                  "ceilings": ceilings})



DEFAULTS = {f.name: f.default for f in fields(ConnectionLimits)}  # for the error messages


class LimitedH11(H11Protocol):
    """uvicorn's h11 protocol with :class:`ConnectionLimits` (bound by :meth:`ConnectionLimits.protocol`).

    One deadline timer per connection, ``phase`` saying what it waits for: ``"head"`` (armed when the connection
    opens, or at the first byte after a kept-alive answer), ``"body"`` (armed when the head is complete), or
    ``None`` (the request has been read: the app's time is not the client's; or uvicorn's keep-alive timer runs).
    """

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    counters: ClassVar[tuple[Callable[[int], None], ...]] = ()  # told the status of every refusal below the app
    ceilings: ClassVar[Ceilings | None] = None  # told of open connections and send timeouts

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.timeout_keep_alive = self.limits.keep_alive_timeout  # type: ignore[assignment]  # call_later takes float
        self.deadline: asyncio.TimerHandle | None = None
        self.phase: str | None = None
        self.probe_only = False  # a connection past the cap: only /health and /ready are answered on it
        self.head = b""  # its first bytes, until its request line is whole
        self.stall: asyncio.TimerHandle | None = None  # the send timeout's timer, while the send buffer is full
        self.unread = 0  # the send buffer's size when that timer was armed

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.ceilings is not None:
            self.ceilings.transports.add(transport)
        open_now = len(self.connections)
        if open_now > self.limits.max_connections + PROBE_SLOTS:
            self.refuse(open_now)
            return
        self.probe_only = open_now > self.limits.max_connections
        self.arm()

    def refuse(self, open_now: int) -> None:
        """Answer 503 (``Retry-After: 1``) and close: the cap is reached."""
        log.warning("refused a connection: %d open (--max-connections %d)", open_now - 1,
                    self.limits.max_connections)
        self.transport.write(BUSY_503)
        self.transport.close()
        self.count(503)

    def data_received(self, data: bytes) -> None:
        if self.probe_only:  # past the cap: a probe is answered, anything else refused once its line is known
            self.head += data
            if b"\n" not in self.head and len(self.head) < 1024:
                return
            line = self.head.split(b"\n", 1)[0]
            if not any(line.startswith(p) and line[len(p):len(p) + 1] in (b" ", b"?") for p in PROBES):
                self.refuse(len(self.connections))
                return
            self.probe_only, data, self.head = False, self.head, b""
        super().data_received(data)
        self.arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.arm()

    def count(self, status: int) -> None:
        """Tell the counters of a refusal answered here."""
        for counter in self.counters:
            counter(status)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (or a head over 16 KiB): uvicorn's 400, counted."""
        super().send_400_response(msg)
        self.count(400)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self._unwatch()
        if self.ceilings is not None:
            self.ceilings.transports.discard(self.transport)
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The send buffer is full (the client reads slower than the answer is written): the send timeout starts."""
        super().pause_writing()
        if self.stall is None:
            self.unread = self.unacked()
            self.stall = self.loop.call_later(self.limits.send_timeout, self.stalled)

    def unacked(self) -> int:
        """Bytes of answers the client has not received: the transport's buffer plus, on Linux, what the kernel's send
        queue holds unacknowledged (``SIOCOUTQ``). The kernel's send buffer grows on its own while a client reads
        nothing (TCP autotuning), so only the sum says whether the client read anything."""
        left = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is None or termios is None or not hasattr(termios, "TIOCOUTQ"):
            return left
        try:
            return left + struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            return left

    def resume_writing(self) -> None:
        super().resume_writing()
        self._unwatch()

    def _unwatch(self) -> None:
        if self.stall is not None:
            self.stall.cancel()
        self.stall = None

    def stalled(self) -> None:
        """``send_timeout`` passed with the send buffer full: the client took at least :data:`MIN_PROGRESS` bytes
        since, so wait again; or less, so reset the connection (``abort``: the buffer is freed at once, unsent)."""
        self.stall = None  # a closing transport counts too: closed after an answer (keep-alive), it still holds it
        left = self.unacked()
        if left <= self.unread - MIN_PROGRESS:
            self.unread = left
            self.stall = self.loop.call_later(self.limits.send_timeout, self.stalled)
            return
        log.warning("dropped a connection whose client took less than %d kB of its answer in %g s (%d bytes unsent; "
                    "--send-timeout)", MIN_PROGRESS >> 10, self.limits.send_timeout, left)
        if self.ceilings is not None:
            self.ceilings.timed_out()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:  # a reset, not a close: the kernel drops what it still holds for the client too
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.transport.abort()

    def arm(self) -> None:
        """Set the deadline for what the connection now waits for (called after every state change)."""
        state = self.conn.their_state
        waiting = state is h11.SEND_BODY or (state is h11.IDLE and self.timeout_keep_alive_task is None)
        if not waiting or self.transport.is_closing() or self.transport.get_protocol() is not self:
            self.disarm()  # request read, idle under keep-alive (uvicorn's timer), closing, or a WebSocket now
            return
        phase = "head" if state is h11.IDLE else "body"
        if phase != self.phase:
            self.disarm()
            seconds = self.limits.header_timeout if phase == "head" else self.limits.body_timeout
            self.deadline, self.phase = self.loop.call_later(seconds, self.expire), phase

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.phase = None, None

    def expire(self) -> None:
        """The deadline passed: 408 if part of a request came and no answer has begun, then close."""
        phase = self.phase
        self.deadline, self.phase = None, None
        if self.transport.is_closing():
            return
        begun = phase == "body" or bool(self.conn.trailing_data[0])
        if begun and self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # no answer begun
            self.transport.write(TIMEOUT_408)
            self.count(408)
        log.debug("closed a connection: request %s not received within %g s", phase,
                  self.limits.header_timeout if phase == "head" else self.limits.body_timeout)
        self.transport.close()


def fit_open_files(max_connections: int, spare: int = 256) -> bool:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to hold ``max_connections`` sockets plus
    ``spare`` other files (model files, the listening socket), as far as the hard limit allows. Returns whether
    the limit now holds them (``True`` where it cannot be read, as on Windows). A process-wide setting:
    :func:`layerwise.serve.serve` calls it, and warns when it returns ``False``: past the limit, uvicorn's accept
    fails (EMFILE) before the cap answers 503."""
    try:
        import resource  # Unix only

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = max_connections + spare
        if soft == resource.RLIM_INFINITY or soft >= want:
            return True
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        return new >= want
    except (ImportError, OSError, ValueError):
        return True
