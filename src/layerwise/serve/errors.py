"""Error bodies in each protocol's own shape, so each client reads the service's errors as it reads its peers'.

============================  ========================================================================  ==========
routes                        body                                                                      validation
============================  ========================================================================  ==========
OpenAI (``/v1/embeddings``,   ``{"error": {"message", "type", "param", "code"}}``                       400
``/v1/models``)
TEI (``/embed``, ``/``,       ``{"error": message, "error_type": "Validation" | "Backend" | ...}``      422
``/embed_all``,
``/tokenize``, ``/info``)
layerwise's own               ``{"detail": message}``                                                   422
============================  ========================================================================  ==========

:func:`install_error_shapes` makes FastAPI's own errors (a body that does not parse or fit the schema, an
unknown route) follow the same table.
"""

from __future__ import annotations

from typing import Any, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

OPENAI_ROUTES = ("/v1/embeddings", "/v1/models")
TEI_ROUTES = ("/embed", "/", "/embed_all", "/tokenize", "/info")
_TEI_TYPES = {413: "Validation", 422: "Validation", 424: "Backend", 429: "Overloaded", 503: "Unhealthy",
              500: "Backend", 400: "Validation", 404: "Validation", 405: "Validation", 401: "Validation"}
_OPENAI_TYPES = {401: "authentication_error", 404: "invalid_request_error", 429: "rate_limit_exceeded",
                 500: "server_error", 503: "server_error"}


class DetailBody(BaseModel):
    """layerwise's own error body: ``detail`` is the message (or FastAPI's list of validation problems)."""

    detail: Union[str, list[dict[str, Any]]]


def detail_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for layerwise's own routes: each of ``codes`` with :class:`DetailBody`."""
    what = {400: "A body that is not JSON, or an invalid value.", 401: "Missing or wrong API key (--api-key).",
            404: "Nothing of that name is loaded.", 413: "The body, or the answer it asks for, is over the limit.",
            422: "Invalid request (the message names the field, the value and the valid ones).",
            429: "The queue is full (max_queue_tokens); retry after Retry-After seconds.",
            500: "An internal error (the server log has the details)."}
    return {code: {"model": DetailBody, "description": what.get(code, "Error.")} for code in codes}


def protocol(path: str) -> str:
    """``openai``, ``tei`` or ``layerwise``: whose error shape the route at ``path`` answers in."""
    if path.startswith(OPENAI_ROUTES):
        return "openai"
    return "tei" if path in TEI_ROUTES else "layerwise"


def status_for(path: str, status: int) -> int:
    """OpenAI answers a request that does not validate with 400, the others with 422."""
    return 400 if status == 422 and protocol(path) == "openai" else status


def error_body(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body for ``status`` on the route at ``path`` (see the module docstring)."""
    kind = protocol(path)
    if kind == "openai":
        return {"error": {"message": message, "type": _OPENAI_TYPES.get(status, "invalid_request_error"),
                          "param": param, "code": code}}
    if kind == "tei":
        return {"error": message, "error_type": _TEI_TYPES.get(status, "Validation")}
    return {"detail": message}


def error_response(path: str, status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """:func:`error_body` as a response, with the protocol's status for a validation error."""
    status = status_for(path, status)
    return JSONResponse(error_body(path, status, message, param, code), status_code=status, headers=headers)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return "the request body does not fit the schema", None
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    field = ".".join(loc) or None
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    where = f"field '{field}': " if field else ""
    return f"{where}{first.get('msg', 'invalid')}{more}", field


def install_error_shapes(app: FastAPI) -> None:
    """Render FastAPI's validation and HTTP errors in each route's protocol shape (layerwise's own routes keep
    FastAPI's ``{"detail": ...}``)."""

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        path = request.url.path
        if protocol(path) == "layerwise":
            return JSONResponse({"detail": jsonable(exc.errors())}, status_code=422)
        message, field = _validation_message(exc)
        return error_response(path, 422, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        headers = dict(exc.headers or {})
        methods = allowed_methods(app, request) if exc.status_code == 405 else None
        if methods:  # every method of every route at this path (Starlette names only one route's)
            headers["Allow"] = ", ".join(methods)
        if protocol(path) == "layerwise":
            return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)
        return error_response(path, exc.status_code, str(exc.detail), headers=headers)


def allowed_methods(app: FastAPI, request: Request) -> list[str] | None:
    """The methods the app's OpenAPI document gives the request's path (``None`` for a path it does not list)."""
    item = app.openapi().get("paths", {}).get(request.url.path)
    return sorted(m.upper() for m in item) if item else None


def jsonable(value: Any) -> Any:
    """``value`` with anything JSON cannot hold (an exception inside a validation error's context) as text."""
    from fastapi.encoders import jsonable_encoder

    try:
        return jsonable_encoder(value)
    except (TypeError, ValueError):
        return str(value)


__all__ = ["DetailBody", "OPENAI_ROUTES", "TEI_ROUTES", "allowed_methods", "detail_responses", "error_body",
           "error_response", "install_error_shapes", "protocol"]
