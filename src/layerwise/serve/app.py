"""The HTTP service: ``POST /v1/encode``, ``GET /v1/model``, ``GET /health``, ``GET /metrics`` (FastAPI).

Every request names its own layers, site, combination, pooling and level; requests with the same options are
merged by the :class:`~layerwise.serve.batcher.Batcher` into token-budget batches run by one worker thread.

Limits: a body over ``max_body_bytes`` gets 413; more than ``max_texts`` texts or a text over ``max_text_chars``
characters get 422 naming the limit; a bad layer spec, site, combine or pool gets 422 with the library's
message (valid range / values); an internal error gets 500 without a stack trace (it goes to the server log).
"""

from __future__ import annotations

import base64
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Literal, Optional, Union

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictInt, StrictStr

from ..encoding.spec import EncodeSpec
from ..encoding.tokenize import check_texts
from ..encoding.vocab import FIXED_COMBINES, FIXED_POOLS, LEVELS, WORD_POOL_MODES, Level, OutputDtype
from ..errors import LayerwiseError
from ..explore.app import Explorer, explorer_router
from ..extractor import Extractor
from ..model.families import SUPPORTED_MODEL_TYPES
from ..model.options import ModelOptions
from ..version import __version__
from .batcher import Batcher
from .metrics import Metrics

log = logging.getLogger("layerwise.serve")


@dataclass
class Limits:
    """Request limits of the service."""

    max_texts: int = 256
    max_text_chars: int = 20_000
    max_body_bytes: int = 4 << 20
    max_batch_tokens: int = 16384

    def __post_init__(self) -> None:
        for name in ("max_texts", "max_text_chars", "max_body_bytes", "max_batch_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayerwiseError(f"{name} must be a positive int, got {value!r} (CLI: --{name.replace('_', '-')})")


class EncodeRequest(BaseModel):
    """Body of ``POST /v1/encode``: the fields of an :class:`~layerwise.EncodeSpec`, the input and the encoding.

    Give ``texts`` (any level) or ``words`` (pre-tokenised; level ``word``). Unknown fields are refused (422).
    """

    model_config = ConfigDict(extra="forbid")

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
        description="Dtype of the returned features (float32 | float16; 'dtype' is its name before layerwise 0.2).")
    prompt: str = Field("", description="Text put before every text (an instruction), levels sentence/token.")
    add_eos: bool = Field(False, description="Append the tokenizer's end-of-sequence token (pool 'last' reads it).")
    encoding: Literal["json", "base64"] = "json"

    def spec(self) -> EncodeSpec:
        """The request's :class:`~layerwise.EncodeSpec` (``ValueError`` for invalid or inapplicable options)."""
        fields = self.model_dump(exclude={"texts", "words", "encoding"})
        return EncodeSpec.from_dict(fields)


def _pack(arr: np.ndarray, dtype: str, encoding: str):
    with np.errstate(over="ignore"):
        arr = np.ascontiguousarray(arr, dtype=np.float16 if dtype == "float16" else np.float32)
    if not np.isfinite(arr).all():
        raise HTTPException(422, f"the result holds inf or NaN values (huge or NaN weights, or {dtype} overflow); "
                                 f"use smaller weights or dtype float32")
    if encoding == "base64":
        return {"base64": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode("ascii"),
                "dtype": dtype, "shape": list(arr.shape)}
    return arr.astype(np.float32).tolist()


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
        await JSONResponse({"detail": detail}, status_code=413)(scope, receive, send)


def create_app(model: Extractor | ModelOptions | str, limits: Limits | None = None,
               explorer: Explorer | None = None) -> FastAPI:
    """A FastAPI app serving ``model`` (call :func:`layerwise.serve.serve` to run it with uvicorn), with the layer
    explorer's page at ``/`` (``explorer``: default, the sentence view of the model; see :mod:`layerwise.explore`).

    ``model``: a :class:`~layerwise.ModelOptions` (or a directory / hub id), or an already loaded
    :class:`~layerwise.Extractor`.
    """
    limits = limits or Limits()
    ex = Extractor.of(model)
    metrics = Metrics()
    explorer = explorer if explorer is not None else Explorer(extractor=ex)
    # the model runs one call at a time: the batcher's worker and the explorer's sentence view share this lock
    batcher = Batcher(_runner(ex, metrics, explorer.model_lock), max_batch_tokens=limits.max_batch_tokens,
                      on_batch=metrics.batch)
    headers = _Headers()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batcher.close()  # stop the worker thread when the server stops

    app = FastAPI(title="layerwise", version=__version__, lifespan=lifespan,
                  description="Hidden layers of a transformer as features, with dynamic batching.")
    app.add_middleware(_BodyLimit, limit=limits.max_body_bytes)
    app.state.batcher, app.state.metrics, app.state.extractor = batcher, metrics, ex

    app.include_router(explorer_router(explorer))

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/model")
    def model_info() -> dict:
        d = ex.describe()
        return {
            **d, "sites": list(d["sites"]), "table_families": list(SUPPORTED_MODEL_TYPES),
            "layers": f"{d['layers']} (0 = embeddings; negatives count from the end)",
            "combine": list(FIXED_COMBINES), "pools": list(FIXED_POOLS), "subword": list(WORD_POOL_MODES),
            "levels": list(LEVELS), "max_length": ex.max_length,
            "limits": {"max_texts": limits.max_texts, "max_text_chars": limits.max_text_chars,
                       "max_body_bytes": limits.max_body_bytes, "max_batch_tokens": limits.max_batch_tokens},
        }

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> PlainTextResponse:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/v1/encode")
    async def encode(req: EncodeRequest, request: Request):
        t0 = time.perf_counter()
        try:
            items, spec = _validate(ex, req, limits)
        except HTTPException as exc:
            metrics.request(str(exc.status_code), time.perf_counter() - t0)
            raise
        cost = sum((len(t) if isinstance(t, str) else sum(len(w) + 1 for w in t)) // 3 + 2 for t in items)
        try:
            rows = await batcher.submit(spec, items, cost)
        except Exception:
            log.exception("encode failed")
            metrics.request("500", time.perf_counter() - t0)
            return JSONResponse({"detail": "internal error while encoding; see the server log"}, status_code=500)
        try:
            body = _response(ex, spec, req.encoding, items, rows, headers)
        except HTTPException as exc:
            metrics.request(str(exc.status_code), time.perf_counter() - t0)
            raise
        metrics.request("200", time.perf_counter() - t0)
        # a Response is sent as it is: FastAPI's jsonable_encoder would walk every float of the vectors first (the
        # bytes are the same: JSONResponse renders with json.dumps, as FastAPI's default response does)
        return JSONResponse(body)

    return app


class _Headers:
    """The per-spec part of every response (``layers`` and ``spec.to_dict()``), built once per spec.

    Requests repeat a handful of option sets, so the dict is cached (at most ``size`` specs, oldest dropped).
    The cached values are only read (serialised), never changed.
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._cache: dict[EncodeSpec, tuple[list[int], dict]] = {}

    def __call__(self, spec: EncodeSpec) -> tuple[list[int], dict]:
        hit = self._cache.get(spec)
        if hit is None:
            if len(self._cache) >= self.size:
                self._cache.pop(next(iter(self._cache)))
            hit = self._cache[spec] = (list(spec.layer_indices), spec.to_dict())
        return hit


def _response(ex: Extractor, spec: EncodeSpec, encoding: str, items: list, rows: list, headers: _Headers) -> dict:
    """The JSON body for one request's rows ``[(vector, Tokenized)]``; ``spec`` is the resolved request spec."""
    layers, spec_dict = headers(spec)
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


def _validate(ex: Extractor, req: EncodeRequest, limits: Limits) -> tuple[list, EncodeSpec]:
    """Items and the resolved spec (the batching key); HTTP 422 with the library's message for anything invalid."""
    if (req.texts is None) == (req.words is None):
        raise HTTPException(422, "give exactly one of 'texts' (strings) or 'words' (lists of word strings)")
    if req.words is not None and req.level != "word":
        raise HTTPException(422, f"'words' (pre-tokenised input) needs level 'word', got level {req.level!r}")
    items = req.texts if req.texts is not None else req.words
    if not items:
        field = "texts" if req.texts is not None else "words"
        raise HTTPException(422, f"'{field}' is empty; give at least one {'text' if field == 'texts' else 'word list'}")
    if len(items) > limits.max_texts:
        raise HTTPException(422, f"{len(items)} texts in one request; the limit is {limits.max_texts} (max_texts)")
    for i, item in enumerate(items):
        n = len(item) if isinstance(item, str) else sum(len(w) + 1 for w in item)
        if n > limits.max_text_chars:
            raise HTTPException(
                422, f"text {i} has {n} characters; the limit is {limits.max_text_chars} (max_text_chars)"
            )
    if req.level == "word" and req.texts is not None:
        items = [t.split() for t in req.texts]
    try:
        check_texts(items, words=req.level == "word")  # wrong types, lone surrogates: 422 naming the index
        spec = req.spec().resolve(ex)
    except (ValueError, TypeError) as exc:
        raise HTTPException(422, str(exc)) from None
    return list(items), spec


def _runner(ex: Extractor, metrics: Metrics, lock: threading.Lock) -> Callable[[EncodeSpec, list], list]:
    """The worker's model call for one merged batch: ``(spec, items) -> [(vector ndarray, Tokenized)]``."""

    def run(spec: EncodeSpec, items: list) -> list:
        t0 = time.perf_counter()
        with lock:
            out = [(res.features.numpy(), res.tokens) for res in ex.stream(items, spec)]
        metrics.tokens(sum(len(t.ids) for _, t in out), time.perf_counter() - t0)
        return out

    return run
