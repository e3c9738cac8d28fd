"""``layerwise serve``: an HTTP service for layer features with dynamic batching (FastAPI + uvicorn).

Its Python client, :class:`layerwise.Client`, lives in :mod:`layerwise.client` (standard library only), so
``import layerwise`` never loads the web stack.
"""

import ctypes
import logging
import platform
import sys
from typing import Any

from ..client import Client
from ..errors import ServiceError
from .app import create_app
from .connections import ConnectionLimits, fit_open_files
from .routes import EncodeRequest
from .service import Limits

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
TRIM_THRESHOLD = 256 << 20  # free memory kept at the top of a heap before glibc gives it back to the system
MMAP_THRESHOLD = 32 << 20  # blocks at least this large get their own mapping (glibc's upper limit on 64-bit)


def keep_freed_memory() -> bool:
    """Tell glibc's allocator to keep freed memory for reuse (Linux/glibc only; ``False`` elsewhere, a no-op).

    The model runs in the batcher's worker thread, whose glibc arena gives freed activation buffers back to the
    system after each forward pass (``madvise``) and faults them in again, zero-filled, on the next one. Measured
    on the 2-core development machine (MiniLM-L6, PyTorch backend, merged batches of 256 SST-2 sentences): about
    200,000 minor page faults per 512 sentences, and the server used ~8% more CPU time and wall time at 64 clients
    than with the memory kept. Raising the trim and mmap thresholds keeps the buffers mapped: the process keeps
    its peak working set, as a server does. A process-wide setting: :func:`serve` calls it, ``create_app`` does not.
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def server(model: Any, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
           aliases: dict[str, dict[str, Any]] | None = None, log_level: str = "info",
           connections: ConnectionLimits | None = None) -> Any:
    """The uvicorn server of the service, configured and not started: ``server(...).run()`` serves until told to
    exit (``.should_exit = True``) or interrupted. Arguments as :func:`serve`'s; ``port=0`` binds a free port (read it
    from ``.servers[0].sockets[0]`` once ``.started``). Nothing process-wide is changed: :func:`serve` does that.
    Returns a ``uvicorn.Server``."""
    import uvicorn
    from fastapi import FastAPI

    connections = connections or ConnectionLimits()
    app = model if isinstance(model, FastAPI) else create_app(model, limits, aliases=aliases)
    metrics = getattr(app.state, "metrics", None)  # an app of create_app's: refusals below it are counted too
    refused = metrics.refused if metrics is not None else None
    service = getattr(app.state, "service", None)  # its ceilings count the send buffers of the connections
    return uvicorn.Server(uvicorn.Config(
        app, host=host, port=port, log_level=log_level,
        http=connections.protocol(refused, service.ceilings if service is not None else None)))


def serve(model: Any, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          aliases: dict[str, dict[str, Any]] | None = None, log_level: str = "info",
          connections: ConnectionLimits | None = None) -> None:
    """Run the service for ``model`` (a :class:`~layerwise.ModelOptions`, a directory / hub id, a loaded
    :class:`~layerwise.Extractor`, or an app made by :func:`create_app`) with uvicorn until interrupted (binds
    127.0.0.1 unless told otherwise). ``aliases``: see :mod:`layerwise.serve.aliases`. ``connections``: header,
    body and keep-alive timeouts and a cap on open connections (:class:`ConnectionLimits`; its defaults when
    ``None``), enforced by uvicorn's h11 protocol subclassed (:mod:`layerwise.serve.connections`).

    The process is the server's: glibc is told to keep freed memory (:func:`keep_freed_memory`), and the soft
    limit of open files is raised to hold the connection cap (:func:`~layerwise.serve.connections.fit_open_files`).
    The server itself is :func:`server`'s.
    """
    keep_freed_memory()
    connections = connections or ConnectionLimits()
    if not fit_open_files(connections.max_connections):
        logging.getLogger("layerwise.serve").warning(
            "the open-file limit (ulimit -n) is below --max-connections %d plus 256: connections past it fail at "
            "accept instead of being answered 503; raise ulimit -n or lower --max-connections",
            connections.max_connections)
    server(model, host=host, port=port, limits=limits, aliases=aliases, log_level=log_level,
           connections=connections).run()


__all__ = [
    "Client", "ConnectionLimits", "EncodeRequest", "Limits", "ServiceError", "create_app", "keep_freed_memory", "serve",
    "server",
]
