"""Error bodies in each protocol's own shape, so each client reads the service's errors as it reads its peers'.

=========================  ========================================================================  ==========
protocol                   body                                                                      validation
=========================  ========================================================================  ==========
:data:`OPENAI`             ``{"error": {"message", "type", "param", "code"}}``                       400
:data:`TEI`                ``{"error": message, "error_type": "Validation" | "Backend" | ...}``      422
:data:`LAYERWISE`          ``{"detail": message}``                                                   422
=========================  ========================================================================  ==========

A route declares its protocol: its router is made by :func:`protocol_router`, whose routes carry it. The error
shape of an answer then comes from the route that answers: :func:`protocol_of` finds it for a request that reached
the route (a body that does not parse or fit the schema, a :class:`~layerwise.ServiceError`) and for one refused
before it (a missing API key, a body over the limit, a method the path does not take: the route the path matches).
A path no route matches answers in layerwise's shape. :func:`install_error_shapes` makes FastAPI's own errors
follow the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, MutableMapping, Union

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match


@dataclass(frozen=True)
class Protocol:
    """One protocol's error shape: its name, the status of a request that does not validate, the status of an
    internal error, and the ``type`` words of its body per status."""

    name: str
    validation_status: int = 422
    internal_status: int = 500
    types: dict[int, str] = field(default_factory=dict)
    default_type: str = ""

    def body(self, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
        """The error body for ``status`` (see the module docstring)."""
        if self.name == "openai":
            return {"error": {"message": message, "type": self.types.get(status, self.default_type), "param": param,
                              "code": code}}
        if self.name == "tei":
            return {"error": message, "error_type": self.types.get(status, self.default_type)}
        return {"detail": message}

    def status(self, status: int) -> int:
        """The protocol's status for ``status`` (a validation error, 422, is 400 in OpenAI's)."""
        return self.validation_status if status == 422 else status

    def response(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> JSONResponse:
        """:meth:`body` as a response, with the protocol's status for a validation error."""
        status = self.status(status)
        return JSONResponse(self.body(status, message, param, code), status_code=status, headers=headers)


LAYERWISE = Protocol("layerwise")
OPENAI = Protocol("openai", validation_status=400, default_type="invalid_request_error", types={
    401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_exceeded", 500: "server_error",
    503: "server_error"})
TEI = Protocol("tei", internal_status=424, default_type="Validation", types={
    424: "Backend", 429: "Overloaded", 503: "Unhealthy", 500: "Backend"})


def protocol_router(protocol: Protocol, **kwargs: Any) -> APIRouter:
    """An ``APIRouter`` whose routes answer errors in ``protocol``'s shape (``kwargs``: ``APIRouter``'s)."""
    route_class = type(f"{protocol.name.title()}Route", (APIRoute,), {"protocol": protocol})
    return APIRouter(route_class=route_class, **kwargs)


def protocol_of(scope: MutableMapping[str, Any]) -> Protocol:
    """The protocol of the route answering ``scope`` (an ASGI HTTP scope of the app): the route it reached, else the
    route its path and method match, else the route its path matches, else :data:`LAYERWISE`."""
    route = scope.get("route")
    if route is None:
        route = route_of(scope)
    return getattr(route, "protocol", LAYERWISE)


def route_of(scope: MutableMapping[str, Any]) -> Any:
    """The route of the app (``scope["app"]``) that ``scope`` matches: fully (path and method), else by path only
    (the route a 405 is about), else ``None``."""
    partial = None
    for route in _routes(getattr(scope.get("app"), "router", None)):
        match, _ = route.matches(scope)
        if match == Match.FULL:
            return route
        if match == Match.PARTIAL and partial is None:
            partial = route
    return partial


def _routes(router: Any) -> Any:
    """Every route of ``router``, those of included routers in place (FastAPI wraps an included router in one
    route-like entry that holds it as ``original_router``)."""
    for route in getattr(router, "routes", ()):
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from _routes(inner)
        else:
            yield route


def error_response(scope: MutableMapping[str, Any], status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The error answer to ``scope`` in its route's protocol shape (see :func:`protocol_of`)."""
    return protocol_of(scope).response(status, message, param, code, headers)


class DetailBody(BaseModel):
    """layerwise's own error body: ``detail`` is the message (or FastAPI's list of validation problems)."""

    detail: Union[str, list[dict[str, Any]]]


def detail_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for layerwise's own routes: each of ``codes`` with :class:`DetailBody`."""
    what = {400: "A body that is not JSON, or an invalid value.", 401: "Missing or wrong API key (--api-key).",
            404: "Nothing of that name is loaded.", 413: "The body, or the answer it asks for, is over the limit.",
            415: "A body that is not application/json.",
            422: "Invalid request (the message names the field, the value and the valid ones).",
            429: "The queue is full (max_queue_tokens); retry after Retry-After seconds.",
            500: "An internal error (the server log has the details)."}
    return {code: {"model": DetailBody, "description": what.get(code, "Error.")} for code in codes}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return "the request body does not fit the schema", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field_name = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    where = f"field '{field_name}': " if field_name else ""
    return f"{where}{first.get('msg', 'invalid')}{more}", field_name


def install_error_shapes(app: FastAPI) -> None:
    """Render FastAPI's validation and HTTP errors in each route's protocol shape (layerwise's own routes keep
    FastAPI's ``{"detail": ...}``)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        protocol = protocol_of(request.scope)
        if protocol is LAYERWISE:
            return JSONResponse({"detail": jsonable(exc.errors())}, status_code=422)
        message, field_name = _validation_message(exc)
        return protocol.response(422, message, field_name)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        protocol = protocol_of(request.scope)
        headers = dict(exc.headers or {})
        methods = allowed_methods(app, request) if exc.status_code == 405 else None
        if methods:  # every method of every route at this path (Starlette names only one route's)
            headers["Allow"] = ", ".join(methods)
        if protocol is LAYERWISE:
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)
        return protocol.response(exc.status_code, str(exc.detail), headers=headers)


def allowed_methods(app: FastAPI, request: Request) -> list[str] | None:
    """The methods the app's OpenAPI document gives the request's path, and HEAD where GET is (``None`` for a path it
    does not list)."""
    item = app.openapi().get("paths", {}).get(request.url.path)
    if not item:
        return None
    methods = {m.upper() for m in item}
    return sorted(methods | ({"HEAD"} if "GET" in methods else set()))  # every GET route answers HEAD too


def jsonable(value: Any) -> Any:
    """``value`` with anything JSON cannot hold (an exception inside a validation error's context) as text."""
    from fastapi.encoders import jsonable_encoder

    try:
        return jsonable_encoder(value)
    except (TypeError, ValueError):
        return str(value)


__all__ = ["DetailBody", "LAYERWISE", "OPENAI", "Protocol", "TEI", "allowed_methods", "detail_responses",
           "error_response", "install_error_shapes", "protocol_of", "protocol_router", "route_of"]
