"""Request bodies parsed and validated off the event loop.

FastAPI reads, decodes and validates a declared body model on the event loop; for a 4 MiB body of texts or token
ids that is tens of milliseconds during which ``/health`` and every other request wait. A route that takes
``req: Model = json_body(Model)`` instead gets the same model, decoded and validated (``json.loads`` and
``Model.model_validate``, as FastAPI does) in a worker thread when the body is over :data:`INLINE_BYTES` (a small
body costs less than the thread hop, so it is parsed in place; :func:`off_loop_if_large` does the same for a route's
input checks). The errors are the same (a :class:`~fastapi.exceptions.RequestValidationError`, which the protocol
error shapes of :mod:`layerwise.serve.errors` render). ``openapi_extra=request_body(Model)`` keeps the route's
OpenAPI document exact, and :func:`add_body_schemas` puts the models into its components.

Only a body sent as ``application/json`` is read (else 415, before the body is parsed): the other types (text/plain,
form, multipart) are those a web page's ``fetch`` or form may send to any server without asking it first (no CORS
preflight), so a page in the user's browser could otherwise make a key-less server on their loopback compute.
"""

from __future__ import annotations

import json
from typing import Any, Callable, TypeVar

from fastapi import Depends, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

T = TypeVar("T")
BODY_MODELS: dict[str, type[BaseModel]] = {}  # every model a route parses with json_body, by schema name
INLINE_BYTES = 64 << 10  # bodies up to this size are parsed on the loop: a thread hop costs more than they do
JSON_TYPE = "application/json"


def check_json_type(request: Request) -> None:
    """Refuse a body not sent as ``application/json`` (parameters such as ``charset=utf-8`` allowed).

    Raises:
        HTTPException: 415 naming the type sent and the one to send.
    """
    given = request.headers.get("content-type", "")
    if given.split(";", 1)[0].strip().lower() != JSON_TYPE:
        raise HTTPException(415, f"the body must be sent as Content-Type: {JSON_TYPE}, got {given or 'none'!r}")


def _validate(model: type[BaseModel], raw: bytes) -> BaseModel:
    """As FastAPI validates a body: Python's ``json.loads`` (which keeps a lone surrogate, so the input checks can
    name the text holding it), then the model's validation; errors as FastAPI words them."""
    try:
        data = json.loads(raw) if raw else None
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: "[[[[..." nested too deep
        pos = getattr(exc, "pos", 0)
        why = "nested too deeply" if isinstance(exc, RecursionError) else getattr(exc, "msg", str(exc))
        raise RequestValidationError([{"type": "json_invalid", "loc": ("body", pos), "msg": "JSON decode error",
                                       "input": {}, "ctx": {"error": why}}]) from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        errors = [{**e, "loc": ("body", *e.get("loc", ()))} for e in exc.errors(include_url=False)]
        raise RequestValidationError(errors, body=data) from None


def json_body(model: type[BaseModel]) -> Any:
    """A FastAPI dependency giving the request body as ``model``, read on the loop and validated in a thread."""
    BODY_MODELS[model.__name__] = model

    async def parse(request: Request) -> BaseModel:
        check_json_type(request)
        try:
            raw = await request.body()
        except ClientDisconnect:  # gone mid-body (or closed by --body-timeout): nothing to answer, nothing to log
            raise HTTPException(400, "the client went away while sending the body") from None
        if len(raw) <= INLINE_BYTES:
            return _validate(model, raw)
        return await run_in_threadpool(_validate, model, raw)

    return Depends(parse)


async def off_loop_if_large(request: Request, check: Callable[[], T]) -> T:
    """``check()`` (a request's input checks), in a worker thread when the body is over :data:`INLINE_BYTES`
    (thousands of texts or ids to check), else right here."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) <= INLINE_BYTES:
        return check()
    return await run_in_threadpool(check)


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """The ``openapi_extra`` of a route whose body is ``model`` (required JSON)."""
    BODY_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def add_body_schemas(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (an OpenAPI document) with the JSON schema of every :data:`BODY_MODELS` model in its components."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for name, model in BODY_MODELS.items():
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}", mode="validation")
        for sub, sub_schema in schema.pop("$defs", {}).items():
            schemas.setdefault(sub, sub_schema)
        schemas[name] = schema
    return doc


__all__ = ["BODY_MODELS", "INLINE_BYTES", "JSON_TYPE", "add_body_schemas", "check_json_type", "json_body",
           "off_loop_if_large", "request_body"]
