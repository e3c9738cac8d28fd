"""The HTTP service, assembled: layerwise's own routes (:mod:`layerwise.serve.routes`), the OpenAI routes
(:mod:`layerwise.serve.openai`), the TEI routes (:mod:`layerwise.serve.tei`) and the layer explorer, over one
:class:`~layerwise.serve.service.Service`, behind the middleware that every answer passes: metrics (every answer,
refusals included), CORS (off unless origins are given), the body limit, the API key and the ``Host:`` allowlist.

A new route is a module with its router (:func:`~layerwise.serve.errors.protocol_router`), its tests and docs; this
module only includes it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..encoding.layers import LayerSpec
from ..explore.app import Explorer, explorer_router
from ..extractor import Extractor
from ..model.options import ModelOptions
from ..version import __version__
from . import openai, routes, tei
from .body import add_body_schemas
from .errors import error_response, install_error_shapes
from .inputs import fill_model_facts
from .metrics import CountAnswers
from .ready import Readiness, warm_depths
from .rules import state_rules
from .security import ApiKey
from .service import Limits, Service
from .tei import prompts


class _BodyLimit:
    """ASGI middleware: 413 for bodies over the limit, by Content-Length or by counting a streamed body."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._too_big(scope, receive, send)
        if length is not None:
            return await self.app(scope, receive, send)
        # no Content-Length (chunked): read the body here, refusing it as soon as it passes the limit
        messages, seen = [], 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            seen += len(message.get("body", b""))
            if seen > self.limit:
                return await self._too_big(scope, receive, send)
            if not message.get("more_body", False):
                break
        replay = iter(messages)

        async def replayed():
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)

    async def _too_big(self, scope, receive, send) -> None:
        detail = f"request body over the limit of {self.limit} bytes (max_body_bytes)"
        await error_response(scope, 413, detail)(scope, receive, send)


def create_app(model: Extractor | ModelOptions | str, limits: Limits | None = None,
               explorer: Explorer | None = None, aliases: dict[str, dict[str, Any]] | None = None, *,
               api_key: str | None = None, allowed_hosts: list[str] | None = None,
               warm: Sequence[LayerSpec] = (), cors_origins: Sequence[str] = ()) -> FastAPI:
    """A FastAPI app serving ``model`` (call :func:`layerwise.serve.serve` to run it with uvicorn): layerwise's own
    ``/v1/encode``, the OpenAI routes (``/v1/embeddings``, ``/v1/models``), the TEI routes (``/embed``, ``/``,
    ``/embed_all``, ``/tokenize``, ``/info``), and the layer explorer (``explorer``: default, the sentence view of
    the model; see :mod:`layerwise.explore`).

    ``model``: a :class:`~layerwise.ModelOptions` (or a directory / hub id), or an already loaded
    :class:`~layerwise.Extractor`. ``aliases``: model name -> :class:`~layerwise.EncodeSpec` fields, picked by an
    OpenAI request's ``model`` (see :mod:`layerwise.serve.aliases`). ``api_key``: every route but ``/health``
    needs ``Authorization: Bearer KEY``; ``allowed_hosts``: the ``Host:`` names answered (others: 400); see
    :mod:`layerwise.serve.security`. ``warm``: layer specs whose depths are prepared when the server starts, besides
    the default request's; ``GET /ready`` answers 200 once they are (see :mod:`layerwise.serve.ready`).
    ``cors_origins``: the web origins (``https://app.example``, or ``*``) whose pages may call the service from a
    browser (CORS); none by default.
    """
    limits = limits or Limits()
    ex = Extractor.of(model)
    explorer = explorer if explorer is not None else Explorer(extractor=ex)
    # the model runs one call at a time: the batcher's worker and the explorer's sentence view share this lock
    service = Service(ex, limits, explorer.model_lock, aliases)
    # a bad --warm spec is said now, before serving; the stages of a named runtime are timed with the lock held
    readiness = Readiness(ex, warm_depths(ex, warm), explorer.model_lock)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        readiness.start()  # prepared while requests are answered; /ready says when it is done
        yield
        service.batcher.close()  # stop the worker thread when the server stops

    app = FastAPI(title="layerwise", version=__version__, lifespan=lifespan,
                  description="Hidden layers of a transformer as features, with dynamic batching. Speaks "
                              "layerwise's own API, OpenAI's embeddings API and text-embeddings-inference's API.")
    # added innermost first: the body limit, the key, CORS (outside the key: a browser's preflight carries none),
    # the Host check, and the count of every answer outermost
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    if cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(cors_origins), allow_methods=["GET", "POST", "HEAD"],
                           allow_headers=["Authorization", "Content-Type"],
                           expose_headers=["X-Layerwise-Spec", "X-Layerwise-Runtime"], max_age=600)
    if allowed_hosts and "*" not in allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    app.add_middleware(CountAnswers, metrics=service.metrics)
    app.state.service, app.state.readiness = service, readiness
    app.state.batcher, app.state.metrics, app.state.extractor = service.batcher, service.metrics, ex
    install_error_shapes(app)

    app.include_router(explorer_router(explorer))
    app.include_router(routes.router)
    app.include_router(openai.router)
    app.include_router(tei.router)  # last: it answers POST / (TEI's predict route)

    app.openapi = lambda: openapi_with_names(app, service)  # type: ignore[method-assign]
    return app


def openapi_with_names(app: FastAPI, service: Service) -> dict:
    """FastAPI's document (built once), with the served model's facts: the names this server answers to as the enum
    of an OpenAI request's ``model``, the range of a token id and TEI's prompt names
    (:func:`~layerwise.serve.inputs.fill_model_facts`), and the rules a request must follow on it (its sites, the
    modes, the rules between fields: :func:`~layerwise.serve.rules.state_rules`)."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = add_body_schemas(get_openapi(title=app.title, version=app.version, description=app.description,
                                           routes=app.routes))
        fill_model_facts(doc, len(service.ex.tokenizer), sorted(prompts(str(service.ex.loaded.name))))
        state_rules(doc, list(service.ex.sites))
        props = doc.get("components", {}).get("schemas", {}).get("EmbeddingsRequest", {}).get("properties", {})
        if "model" in props:
            props["model"]["enum"] = service.model_names()
        app.openapi_schema = doc
    return app.openapi_schema


__all__ = ["create_app", "openapi_with_names"]
