"""The HTTP service: ``POST /v1/encode``, ``GET /v1/model``, ``GET /health``, ``GET /ready``, ``GET /metrics``
(FastAPI).

Every request names its own layers, site, combination, pooling and level; requests with the same options are
merged by the :class:`~layerwise.serve.batcher.Batcher` into token-budget batches run by one worker thread.

Limits: a body over ``max_body_bytes`` gets 413; more than ``max_texts`` texts or a text over ``max_text_chars``
characters get 422 naming the limit; a bad layer spec, site, combine or pool gets 422 with the library's
message (valid range / values); an internal error gets 500 without a stack trace (it goes to the server log).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
from typing import Any, Literal, Optional, Sequence, Union

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.middleware.trustedhost import TrustedHostMiddleware

from ..encoding.layers import LayerSpec
from ..encoding.spec import EncodeSpec
from ..encoding.vocab import FIXED_COMBINES, FIXED_POOLS, LEVELS, WORD_POOL_MODES, Level, OutputDtype
from ..errors import ServiceError
from ..explore.app import Explorer, explorer_router
from ..extractor import Extractor
from ..model.families import SUPPORTED_MODEL_TYPES
from ..model.options import ModelOptions
from ..version import __version__
from .body import add_body_schemas, json_body, off_loop_if_large, request_body
from .errors import detail_responses, error_response, install_error_shapes
from .openai import Calibration, openai_router
from .ready import Readiness, warm_depths
from .security import ApiKey
from .service import Kind, Limits, Service, finite, render
from .tei import tei_router


class EncodeRequest(BaseModel):
    """Body of ``POST /v1/encode``: the fields of an :class:`~layerwise.EncodeSpec`, the input and the encoding.

    Give ``texts`` (any level) or ``words`` (pre-tokenised; level ``word``). Unknown fields are refused (422).
    """

    model_config = ConfigDict(extra="forbid", strict=True)  # 1 is not true, "3" is not 3

    texts: Optional[list[str]] = Field(None, description="Texts to encode.")
    words: Optional[list[list[str]]] = Field(None, description="Pre-tokenised words (level 'word').")
    layers: Union[StrictInt, StrictStr, list[Union[StrictInt, StrictStr]]] = Field(
        -1, description="Layer spec: -1, '-4:', [0, 6], 'all'.")
    site: str = "block"
    combine: str = "concat"
    weights: Optional[list[float]] = None
    pool: Optional[str] = Field(None, description="Sentence pool (level 'sentence' only; default mean).")
    level: Level = "sentence"
    subword: Optional[str] = Field(None, description="Sub-token pooling (level 'word' only; default first).")
    skip_special_tokens: bool = False
    truncate: bool = False
    normalize: bool = Field(False, description="L2-normalise sentence vectors (level 'sentence' only).")
    output_dtype: OutputDtype = Field(
        "float32", validation_alias=AliasChoices("output_dtype", "dtype"),
        description="Precision of the returned features: float32 | float16 | int8 | uint8 (both with calibration) | "
                    "binary | ubinary (sign bits packed 8 to a byte); 'dtype' is its name before layerwise 0.2.")
    dimensions: Optional[int] = Field(None, ge=1, description="Keep the leading values of the last axis.")
    calibration: Optional[Calibration] = Field(None, description="int8/uint8: per-value ranges.")
    prompt: str = Field("", description="Text put before every text (an instruction), levels sentence/token.")
    add_eos: bool = Field(False, description="Append the tokenizer's end-of-sequence token (pool 'last' reads it).")
    encoding: Literal["json", "base64"] = "json"

    def spec_fields(self) -> dict[str, Any]:
        """The request's :class:`~layerwise.EncodeSpec` fields."""
        return self.model_dump(exclude={"texts", "words", "encoding"})

    def spec(self) -> EncodeSpec:
        """The request's :class:`~layerwise.EncodeSpec` (``SpecError`` for invalid or inapplicable options)."""
        return EncodeSpec.from_dict(self.spec_fields())


def _pack(arr: np.ndarray, dtype: str, encoding: str):
    """One array as JSON numbers, or ``{"base64", "dtype", "shape"}`` (little-endian values of ``arr``'s dtype:
    ``dtype`` names the precision; ``binary`` is int8, ``ubinary`` uint8)."""
    arr = finite(arr, dtype)
    if encoding == "base64":
        return {"base64": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode("ascii"),
                "dtype": dtype, "shape": list(arr.shape)}
    return arr.tolist() if arr.dtype.kind in "iu" else arr.astype(np.float32).tolist()


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
        await error_response(scope.get("path", ""), 413, detail)(scope, receive, send)


def create_app(model: Extractor | ModelOptions | str, limits: Limits | None = None,
               explorer: Explorer | None = None, aliases: dict[str, dict[str, Any]] | None = None, *,
               api_key: str | None = None, allowed_hosts: list[str] | None = None,
               warm: Sequence[LayerSpec] = ()) -> FastAPI:
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
    """
    limits = limits or Limits()
    ex = Extractor.of(model)
    explorer = explorer if explorer is not None else Explorer(extractor=ex)
    # the model runs one call at a time: the batcher's worker and the explorer's sentence view share this lock
    service = Service(ex, limits, explorer.model_lock, aliases)
    metrics = service.metrics
    readiness = Readiness(ex, warm_depths(ex, warm))  # a bad --warm spec is said now, before serving

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        readiness.start()  # prepared while requests are answered; /ready says when it is done
        yield
        service.batcher.close()  # stop the worker thread when the server stops

    app = FastAPI(title="layerwise", version=__version__, lifespan=lifespan,
                  description="Hidden layers of a transformer as features, with dynamic batching. Speaks "
                              "layerwise's own API, OpenAI's embeddings API and text-embeddings-inference's API.")
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    if allowed_hosts and "*" not in allowed_hosts:
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed_hosts)
    app.state.batcher, app.state.metrics, app.state.extractor = service.batcher, metrics, ex
    app.state.service = service
    install_error_shapes(app)

    app.include_router(explorer_router(explorer))
    app.include_router(openai_router(service))

    @app.get("/health")
    async def health() -> dict:
        """Answered on the event loop itself: no worker thread (they may all be busy parsing or rendering)."""
        return {"status": "ok"}

    @app.get("/ready", responses={503: {"description": "Still preparing: the depths pending, or the error"}})
    async def ready() -> JSONResponse:
        """200 once the default request's depth and every ``--warm`` depth are prepared, else 503; both with
        ``{"ready", "depths", "pending", "error"}``. Answered on the event loop, like ``/health``."""
        state = readiness.state()
        return JSONResponse(state, status_code=200 if state["ready"] else 503)

    @app.get("/v1/model", responses=detail_responses(401))
    def model_info() -> dict:
        return describe_service(service)

    @app.get("/metrics", response_class=PlainTextResponse, responses=detail_responses(401))
    def prometheus() -> PlainTextResponse:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/v1/encode", responses=detail_responses(400, 401, 413, 422, 429, 500),
              openapi_extra=request_body(EncodeRequest))
    async def encode(request: Request, req: EncodeRequest = json_body(EncodeRequest)) -> Response:
        def check() -> tuple[list, EncodeSpec, Kind]:
            items, spec, kind = _validate(service, req)
            service.check_response(spec, items, kind, binary=req.encoding == "base64")
            return items, spec, kind

        async def work() -> tuple[bytes, EncodeSpec]:
            items, spec, kind = await off_loop_if_large(request, check)  # a large body: off the event loop
            rows = await service.encode(spec, items, kind, request)
            layers, spec_dict, _ = service.specs(spec)
            # rendered off the event loop, and sent as it is: FastAPI's jsonable_encoder would walk every float
            return await render(lambda: _response(ex, spec, req.encoding, items, rows, layers, spec_dict)), spec

        return await service.answer("/v1/encode", work)

    app.include_router(tei_router(service))  # last: it answers POST / (TEI's predict route)

    app.openapi = lambda: openapi_with_names(app, service)  # type: ignore[method-assign]
    return app


def describe_service(service: Service) -> dict:
    """``GET /v1/model``: the model (:func:`~layerwise.model.describe.describe`), the modes and levels it takes,
    the names and aliases it answers to, and the limits."""
    ex = service.ex
    d = ex.describe()
    return {
        **d, "sites": list(d["sites"]), "table_families": list(SUPPORTED_MODEL_TYPES),
        "layers": f"{d['layers']} (0 = embeddings; negatives count from the end)",
        "combine": list(FIXED_COMBINES), "pools": list(FIXED_POOLS), "subword": list(WORD_POOL_MODES),
        "levels": list(LEVELS), "max_length": ex.max_length, "names": service.model_names(),
        "aliases": service.described_aliases(), "limits": dataclasses.asdict(service.limits),
    }


def openapi_with_names(app: FastAPI, service: Service) -> dict:
    """FastAPI's document (built once), with the names this server answers to as the enum of an OpenAI request's
    ``model``."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        doc = add_body_schemas(get_openapi(title=app.title, version=app.version, description=app.description,
                                           routes=app.routes))
        props = doc.get("components", {}).get("schemas", {}).get("EmbeddingsRequest", {}).get("properties", {})
        if "model" in props:
            props["model"]["enum"] = service.model_names()
        app.openapi_schema = doc
    return app.openapi_schema


def _response(ex: Extractor, spec: EncodeSpec, encoding: str, items: list, rows: list, layers: list[int],
              spec_dict: dict) -> dict:
    """The JSON body for one request's rows ``[(vector, Tokenized)]``; ``spec`` is the resolved request spec."""
    body: dict = {"model": ex.loaded.name, "layers": layers, "level": spec.level, "spec": spec_dict}
    vecs = [v for v, _ in rows]
    if spec.level == "sentence":
        arr = np.stack(vecs)
        body["shape"] = list(arr.shape)
        body["vectors"] = _pack(arr, spec.output_dtype, encoding)
    else:
        body["shapes"] = [list(v.shape) for v in vecs]
        body["vectors"] = [_pack(v, spec.output_dtype, encoding) for v in vecs]
        if spec.level == "token":
            tok = ex.tokenizer
            body["tokens"] = [tok.convert_ids_to_tokens(t.ids) for _, t in rows]
            body["offsets"] = [[list(o) for o in t.offsets] for _, t in rows]
        else:
            body["words"] = [list(w) for w in items]
    return body


def _validate(service: Service, req: EncodeRequest) -> tuple[list, EncodeSpec, Kind]:
    """Items, the resolved spec (the batching key) and their kind; :class:`~layerwise.ServiceError` (422) for
    anything invalid."""
    if (req.texts is None) == (req.words is None):
        raise ServiceError(422, "give exactly one of 'texts' (strings) or 'words' (lists of word strings)")
    if req.words is not None and req.level != "word":
        raise ServiceError(422, f"'words' (pre-tokenised input) needs level 'word', got level {req.level!r}")
    field = "texts" if req.texts is not None else "words"
    kind: Kind = "words" if req.level == "word" else "text"
    raw: list = req.texts if req.texts is not None else req.words  # type: ignore[assignment]
    if req.level == "word" and req.texts is not None:
        raw = [t.split() for t in req.texts]  # whitespace words
    items = service.check_items(raw, kind, req.prompt, field)
    return items, service.spec(req.spec_fields()), kind
