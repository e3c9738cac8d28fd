"""The service's memory ceilings: what the process holds (``--max-memory``) and the bytes of answers it holds for
clients that have not read them (``--max-unsent-bytes``). Both are checked when a request is admitted, after its
input is checked and before any compute; a request that would pass either is shed with 503 and ``Retry-After: 1``
(``code: "overloaded"``), counted in ``layerwise_shed_total{reason}``, and the server keeps serving the others.

* ``max_memory`` (``--max-memory``): a request is shed when the process's resident memory (RSS), plus the answers
  admitted and not yet sent, plus this request's answer and working states, would pass it. Default: the resident
  memory when the app is made plus 90% of what the process may still take (the cgroup, ``ulimit`` or the machine,
  the lowest); ``0``: none.
* ``max_unsent_bytes`` (``--max-unsent-bytes``): a request is shed when the answers being computed, plus the bytes
  waiting in the sockets' send buffers, plus this answer, would pass it. Default 64 MiB: one answer of the largest
  size (``--max-response-bytes``) at a time, or many small ones. At 128 MiB, 15 clients that never read their 57 MB
  answers added 313 MB to the server at the peak; at 64 MiB, 132 MB, and the one answered was dropped 32 s after
  it was asked for (``benchmarks/serve_slow_readers.py``, 2-core EPYC, 2026-11-28).

An answer's bytes are counted from its admission (its estimate, :meth:`Service.check_response
<layerwise.serve.service.Service.check_response>`) until the server has handed it to the socket; from then on they are
what its connection's send buffer holds, until the client reads them. A client that reads nothing of an answer for
``send_timeout`` seconds (``--send-timeout``, :mod:`layerwise.serve.connections`) is disconnected and its buffer freed:
counted in ``layerwise_send_timeouts_total``.

Why both: memory followed load in issue 52. 15 connections that asked for 64 MB answers and never read them held
2.5 GB until they closed; at the defaults (1,024 connections x 64 MiB) one client could pin tens of GB.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

from ..errors import LayerwiseError, ServiceError
from ..model.memory import available, human, parse_size, resident_bytes

MEMORY_SHARE = 0.9  # of what the process may still take when the app is made: the default --max-memory
UNSENT_BYTES = 64 << 20  # the default --max-unsent-bytes: one answer of the largest size (--max-response-bytes)
RETRY_AFTER = 1  # seconds a shed client is told to wait: answers drain in about that


def default_max_memory() -> tuple[int, str]:
    """The default ``--max-memory`` and where it comes from: the resident memory now plus :data:`MEMORY_SHARE` of
    what the process may still take (:func:`layerwise.model.memory.available`: cgroup, ``ulimit``, the machine)."""
    rss, room = resident_bytes(), available()
    if room is None or not rss:
        return 0, "no limit could be read"
    return rss + int(MEMORY_SHARE * room.bytes), f"{human(rss)} resident + {MEMORY_SHARE:.0%} of {room.source}"


class Ceilings:
    """The two ceilings of one server and what counts against them (thread-safe: admissions come from the event
    loop, releases from wherever an answer finishes).

    Args:
        max_memory: bytes (or a size such as ``"8GB"``); ``None``: :func:`default_max_memory`; ``0``: no memory
            ceiling.
        max_unsent_bytes: bytes of answers held for clients at once.
        shed: told the reason (``"memory"``, ``"answers"``) of every request shed (the metrics' counter).
    """

    def __init__(self, max_memory: int | str | None = None, max_unsent_bytes: int = UNSENT_BYTES,
                 shed: Callable[[str], None] | None = None):
        if isinstance(max_unsent_bytes, bool) or not isinstance(max_unsent_bytes, int) or max_unsent_bytes < 1:
            raise LayerwiseError(f"max_unsent_bytes must be a positive int of bytes, got {max_unsent_bytes!r} "
                                 f"(CLI: --max-unsent-bytes; default {UNSENT_BYTES})")
        if max_memory is None:
            self.max_memory, self.source = default_max_memory()
        elif max_memory == 0:
            self.max_memory, self.source = 0, "no ceiling (0)"
        else:
            self.max_memory, self.source = parse_size(max_memory, "--max-memory"), "--max-memory"
        self.max_unsent_bytes = max_unsent_bytes
        self.transports: set[asyncio.WriteTransport] = set()  # open connections (registered by the protocol)
        self.reserved = 0  # bytes of admitted answers not yet handed to a socket
        self.send_timeouts = 0
        self._shed = shed or (lambda reason: None)
        self._lock = threading.Lock()

    def buffered(self) -> int:
        """Bytes waiting in the connections' send buffers (answers handed to the socket, not yet read), closing ones
        included: a connection closed after its answer (keep-alive) holds its buffer until it is sent or dropped."""
        return sum(t.get_write_buffer_size() for t in list(self.transports))

    def unsent(self) -> int:
        """Bytes of answers held for clients: admitted and not yet handed to a socket, plus :meth:`buffered`."""
        return self.reserved + self.buffered()

    def admit(self, answer_bytes: int, working_bytes: int = 0) -> "Ticket":
        """Count ``answer_bytes`` (the answer's estimate) against the ceilings until the :class:`Ticket` is released;
        ``working_bytes``: what computing it holds besides (its states), checked against ``max_memory`` only.

        Raises:
            ServiceError: 503 with ``Retry-After``, saying which ceiling, the numbers, and what to do.
        """
        with self._lock:
            unsent = self.reserved + self.buffered()
            if unsent + answer_bytes > self.max_unsent_bytes:
                self._shed("answers")
                raise ServiceError(503, f"the service holds {human(unsent)} of answers its clients have not read yet, "
                                        f"and this one (about {human(answer_bytes)}) would pass max_unsent_bytes "
                                        f"({human(self.max_unsent_bytes)}); retry in {RETRY_AFTER} s, or ask for a "
                                        f"smaller answer (fewer inputs or layers, a pooled level, base64)",
                                   code="overloaded", headers={"Retry-After": str(RETRY_AFTER)})
            if self.max_memory:
                rss = resident_bytes()  # 0 where it cannot be read: no memory check then
                need = answer_bytes + working_bytes
                if rss and rss + self.reserved + need > self.max_memory:
                    self._shed("memory")
                    raise ServiceError(503, f"the service is at its memory ceiling: {human(rss)} resident and "
                                            f"{human(self.reserved)} of answers being made, and this request needs "
                                            f"about {human(need)}, over max_memory {human(self.max_memory)} "
                                            f"({self.source}); retry in {RETRY_AFTER} s, or ask for less (fewer "
                                            f"inputs, a pooled level)",
                                       code="overloaded", headers={"Retry-After": str(RETRY_AFTER)})
            self.reserved += answer_bytes
        return Ticket(self, answer_bytes)

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` of an admitted answer (it has been handed to the socket, or was never made)."""
        with self._lock:
            self.reserved -= nbytes

    def timed_out(self) -> None:
        """Count a connection dropped by the send timeout."""
        with self._lock:
            self.send_timeouts += 1


class Ticket:
    """An admitted answer's bytes, counted until :meth:`release` (idempotent)."""

    def __init__(self, ceilings: Ceilings, nbytes: int):
        self.ceilings, self.nbytes = ceilings, nbytes

    def release(self) -> None:
        nbytes, self.nbytes = self.nbytes, 0
        if nbytes:
            self.ceilings.release(nbytes)


__all__ = ["Ceilings", "MEMORY_SHARE", "RETRY_AFTER", "Ticket", "UNSENT_BYTES", "default_max_memory",
           "resident_bytes"]
