"""layerwise's own routes: ``POST /v1/encode``, ``GET /v1/model``, ``GET /health``, ``GET /ready``, ``GET /metrics``.

Every request names its own layers, site, combination, pooling, level and output; requests share forward passes
through the :class:`~layerwise.serve.batcher.Batcher` whatever they ask (see :mod:`layerwise.serve.batcher`).

Limits: a body over ``max_body_bytes`` gets 413; a body not sent as ``application/json`` 415; more than ``max_texts``
texts, an empty text or a text over ``max_text_chars`` characters get 422 naming the limit; a request whose
estimated tokens pass ``max_request_tokens`` or whose answer would pass ``max_response_bytes`` 413; a bad layer
spec, site, combine or pool gets 422 with the library's message (valid range / values); an internal error gets 500
without a stack trace (it goes to the server log).
"""

from __future__ import annotations

import base64
import dataclasses
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StrictStr

from ..encoding.spec import EncodeSpec
from ..encoding.vocab import FIXED_COMBINES, FIXED_POOLS, LEVELS, WORD_POOL_MODES, Level, OutputDtype
from ..errors import ServiceError
from ..extractor import Extractor
from ..model.families import SUPPORTED_MODEL_TYPES
from .body import json_body, request_body
from .errors import LAYERWISE, detail_responses, protocol_router
from .inputs import Texts, WholeInt, Words
from .openai import Calibration
from .respond import finite, respond, service_of
from .service import Kind, Service

router = protocol_router(LAYERWISE, tags=["layerwise"])


class EncodeRequest(BaseModel):
    """Body of ``POST /v1/encode``: the fields of an :class:`~layerwise.EncodeSpec`, the input and the encoding.

    Give ``texts`` (any level) or ``words`` (pre-tokenised; level ``word``). Unknown fields are refused (422).
    """

    model_config = ConfigDict(extra="forbid", strict=True,  # 1 is not true, "3" is not 3
                              json_schema_extra=lambda schema: _exactly_one(schema, "texts", "words"))

    texts: Optional[Texts] = Field(None, description="Texts to encode (each not blank).")
    words: Optional[Words] = Field(None, description="Pre-tokenised words (level 'word'; each list not empty).")
    layers: Union[WholeInt, StrictStr, list[Union[WholeInt, StrictStr]]] = Field(
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
    dimensions: Optional[WholeInt] = Field(None, ge=1, description="Keep the leading values of the last axis.")
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


def _exactly_one(schema: dict[str, Any], *names: str) -> None:
    """The JSON schema of a body that takes exactly one of the fields ``names`` (each a value, never null)."""
    for name in names:
        prop = schema["properties"][name]
        given = [v for v in prop.pop("anyOf", []) if v.get("type") != "null"]
        prop.pop("default", None)
        if given:
            prop.update(given[0])
    schema["oneOf"] = [{"required": [name]} for name in names]


def _pack(arr: np.ndarray, dtype: str, encoding: str):
    """One array as JSON numbers, or ``{"base64", "dtype", "shape"}`` (little-endian values of ``arr``'s dtype:
    ``dtype`` names the precision; ``binary`` is int8, ``ubinary`` uint8)."""
    arr = finite(arr, dtype)
    if encoding == "base64":
        return {"base64": base64.b64encode(arr.astype(arr.dtype.newbyteorder("<")).tobytes()).decode("ascii"),
                "dtype": dtype, "shape": list(arr.shape)}
    return arr.tolist() if arr.dtype.kind in "iu" else arr.astype(np.float32).tolist()


@router.head("/health", include_in_schema=False)
@router.get("/health")
async def health() -> dict:
    """Answered on the event loop itself: no worker thread (they may all be busy parsing or rendering)."""
    return {"status": "ok"}


@router.head("/ready", include_in_schema=False)
@router.get("/ready",
                  responses={503: {"description": "Still preparing: the depths pending, or the error"}})
async def ready(request: Request) -> JSONResponse:
    """200 once the default request's depth and every ``--warm`` depth are prepared (and from then on), else 503; both
    with ``{"ready", "depths", "pending", "preparing", "error"}`` (``preparing``: other depths requests asked for,
    prepared in the background; never in the status). Answered on the event loop, like ``/health``."""
    state = request.app.state.readiness.state()
    return JSONResponse(state, status_code=200 if state["ready"] else 503)


@router.head("/v1/model", include_in_schema=False)
@router.get("/v1/model", responses=detail_responses(401))
def model_info(request: Request) -> dict:
    """The model, the modes and levels it takes, the names and aliases it answers to, and the limits."""
    return describe_service(service_of(request))


@router.head("/metrics", include_in_schema=False)
@router.get("/metrics", response_class=PlainTextResponse,
                  responses=detail_responses(401))
def prometheus(request: Request) -> PlainTextResponse:
    """Prometheus metrics (see :mod:`layerwise.serve.metrics`)."""
    body, content_type = service_of(request).metrics.render()
    return PlainTextResponse(body, media_type=content_type)


@router.post("/v1/encode", responses=detail_responses(400, 401, 413, 415, 422, 429, 500),
             openapi_extra=request_body(EncodeRequest))
async def encode(request: Request, req: EncodeRequest = json_body(EncodeRequest)) -> Response:
    """Features of any layers, combination, pooling and level (the fields of :class:`~layerwise.EncodeSpec`)."""
    service = service_of(request)

    def check() -> tuple[EncodeSpec, list, Kind, int]:
        items, spec, kind = _validate(service, req)
        return spec, items, kind, service.check_response(spec, items, kind, binary=req.encoding == "base64")

    def build(spec: EncodeSpec, items: list, rows: list) -> dict:
        layers, spec_dict, _ = service.specs(spec)
        return _response(service.ex, spec, req.encoding, items, rows, layers, spec_dict)

    return await respond(request, check, build)


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
    given = [name for name in ("texts", "words") if name in req.model_fields_set]
    if len(given) != 1:
        raise ServiceError(422, "give exactly one of 'texts' (strings) or 'words' (lists of word strings)")
    if getattr(req, given[0]) is None:
        raise ServiceError(422, f"'{given[0]}' is null; give a list", given[0])
    if req.words is not None and req.level != "word":
        raise ServiceError(422, f"'words' (pre-tokenised input) needs level 'word', got level {req.level!r}")
    field = "texts" if req.texts is not None else "words"
    kind: Kind = "words" if req.level == "word" else "text"
    raw: list = req.texts if req.texts is not None else req.words  # type: ignore[assignment]
    if req.level == "word" and req.texts is not None:
        raw = [t.split() for t in req.texts]  # whitespace words
    items = service.check_items(raw, kind, req.prompt, field)
    return items, service.spec(req.spec_fields()), kind


__all__ = ["EncodeRequest", "describe_service", "router"]
