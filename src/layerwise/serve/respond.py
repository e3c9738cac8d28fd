"""The one path of an encoding request, whatever its protocol: check the input (off the event loop when the body is
large), encode it through the batcher, render the answer off the loop, and answer: the ``X-Layerwise-Spec`` header
(the resolved spec) and the ``X-Layerwise-Runtime`` header (what computed it:
:func:`~layerwise.serve.service.runtime_label`) on success, a :class:`~layerwise.ServiceError` in the route's
protocol shape, anything else as the protocol's internal error (500; TEI says 424) with the traceback in the server log.

A route gives two functions: ``check() -> (spec, items, kind, answer_bytes)`` (raising
:class:`~layerwise.ServiceError` for a bad request; ``answer_bytes``: the answer's estimate) and ``build(spec, items,
rows) -> JSON-ready body`` (``rows``: ``[(vector ndarray, Tokenized)]``). A checked request is admitted under the
service's ceilings (:mod:`layerwise.serve.ceilings`: 503 when it would pass one) and its answer counted against them
until it has been handed to the socket.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from ..encoding.spec import EncodeSpec
from ..errors import ServiceError
from .body import off_loop_if_large
from .ceilings import Ticket
from .errors import protocol_of
from .service import Kind, Service

log = logging.getLogger("layerwise.serve")
SPEC_HEADER = "X-Layerwise-Spec"  # every encoding response says which resolved spec it used (JSON)
RUNTIME_HEADER = "X-Layerwise-Runtime"  # ... and which runtime computed it (service.runtime_label)
Check = Callable[[], tuple[EncodeSpec, list, Kind, int]]
Build = Callable[[EncodeSpec, list, list], Any]


def service_of(request: Request) -> Service:
    """The :class:`~layerwise.serve.service.Service` of the app answering ``request``."""
    return request.app.state.service


async def respond(request: Request, check: Check, build: Build) -> Response:
    """Answer one encoding request (see the module docstring)."""
    service = service_of(request)
    protocol = protocol_of(request.scope)
    ticket = None
    try:
        spec, items, kind, answer = await off_loop_if_large(request, check)
        ticket = service.ceilings.admit(answer, service.working_bytes(spec, items, kind))
        rows, runtime = await service.encode(spec, items, kind, request)
        content = await render(lambda: build(spec, items, rows))
        headers = {SPEC_HEADER: service.specs(spec)[2], RUNTIME_HEADER: runtime}
        held, ticket = Held(content, ticket, media_type="application/json", headers=headers), None  # the answer
        return held  # releases the ticket, once sent
    except ServiceError as exc:
        return protocol.response(exc.status, exc.detail, exc.param, exc.code, exc.headers)
    except Exception:
        log.exception("%s failed", request.url.path)
        return protocol.response(protocol.internal_status, "internal error while encoding; see the server log")
    finally:
        if ticket is not None:  # refused, failed or cancelled before an answer was made
            ticket.release()


class Held(Response):
    """An answer whose bytes count against the ceilings until it has been handed to the socket (then its
    connection's send buffer holds them: :meth:`Ceilings.buffered <layerwise.serve.ceilings.Ceilings.buffered>`)."""

    def __init__(self, content: bytes, ticket: Ticket, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.ticket = ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.ticket.release()


async def render(build: Callable[[], Any]) -> bytes:
    """``build()`` rendered as JSON bytes (as Starlette's ``JSONResponse`` renders), in a worker thread: turning
    thousands of vectors into text takes long enough that the event loop must not do it (``/health`` and every
    other request would wait)."""

    def run() -> bytes:
        return json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")

    return await run_in_threadpool(run)


def finite(arr: np.ndarray, dtype: str = "float32") -> np.ndarray:
    """``arr`` as a contiguous ``dtype`` array after checking it holds no inf or NaN (integer precisions, which
    cannot hold them, come back as they are).

    Raises:
        ServiceError: 422 saying where inf/NaN come from.
    """
    if arr.dtype.kind in "iu":
        return np.ascontiguousarray(arr)
    with np.errstate(over="ignore"):
        out = np.ascontiguousarray(arr, dtype=np.float16 if dtype == "float16" else np.float32)
    if not np.isfinite(out).all():
        raise ServiceError(422, f"the result holds inf or NaN values (huge or NaN weights, or {dtype} overflow); use "
                                f"smaller weights or dtype float32")
    return out


__all__ = ["RUNTIME_HEADER", "SPEC_HEADER", "finite", "render", "respond", "service_of"]
