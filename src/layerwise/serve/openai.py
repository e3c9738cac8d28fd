"""OpenAI-compatible routes: ``POST /v1/embeddings`` and ``GET /v1/models``, for the ``openai`` client and every
framework built on it (LangChain's ``OpenAIEmbeddings``, LlamaIndex, vector databases).

``input`` is a string, a list of strings, a list of token ids or a list of lists of ids (the model's own ids: an id
outside its vocabulary is refused, with the hint for LangChain, which sends tiktoken ids unless told not to).
``encoding_format`` is ``float`` or ``base64`` (little-endian float32, the ``openai`` client's default; with an
integer ``output_dtype`` each value is its integer as a float32, so the client decodes it unchanged);
``dimensions`` keeps the leading dimensions (then renormalised); ``user`` is accepted and ignored.

Which layers: the request's ``model`` may name an alias (``layerwise serve --alias NAME='layers=3;pool=mean'``),
and any :class:`~layerwise.EncodeSpec` field may ride in the body as an extension (``openai``:
``extra_body={"layers": "-4:", "combine": "concat"}``); later ones win over earlier ones: the defaults (last
layer, mean-pooled, L2-normalised as OpenAI's embeddings are), then the alias, then the body. The
``X-Layerwise-Spec`` response header says which resolved spec was used. One vector per input: the level is
``sentence``.

Example::

    >>> from openai import OpenAI                                                   # doctest: +SKIP
    >>> client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")       # doctest: +SKIP
    >>> client.embeddings.create(model="all-MiniLM-L6-v2", input=["I love Paris"],  # doctest: +SKIP
    ...                          extra_body={"layers": 3}).data[0].embedding[:3]
"""

from __future__ import annotations

import base64
import time
from typing import Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictStr

from ..encoding.spec import EncodeSpec
from ..encoding.vocab import OutputDtype
from ..errors import ServiceError
from .body import json_body, request_body
from .errors import OPENAI, protocol_router
from .inputs import Inputs, WholeInt
from .respond import finite, respond, service_of
from .service import OPENAI_DEFAULTS, Kind

LayerSpecField = Optional[Union[WholeInt, StrictStr, list[Union[WholeInt, StrictStr]]]]


class Calibration(BaseModel):
    """``int8``/``uint8`` ranges: each value's minimum and maximum over a calibration set."""

    model_config = ConfigDict(extra="forbid")

    min: list[float] = Field(min_length=1)
    max: list[float] = Field(min_length=1)


class SpecExtension(BaseModel):
    """The :class:`~layerwise.EncodeSpec` fields a request may add to OpenAI's or TEI's body (all optional)."""

    layers: LayerSpecField = Field(None, description="Layer spec: -1, '-4:', [0, 6], 'all' (layerwise extension).")
    site: Optional[str] = Field(None, description="block | attention | intermediate | pre_ln (extension).")
    combine: Optional[str] = Field(None, description="How layers combine: concat | mean | sum | ... (extension).")
    weights: Optional[list[float]] = Field(None, description="Weights for combine 'weighted' (extension).")
    pool: Optional[str] = Field(None, description="Sentence pool: mean | cls | max | last | ... (extension).")
    skip_special_tokens: Optional[bool] = Field(None, description="Leave special tokens out of pooling (extension).")
    prompt: Optional[str] = Field(None, description="Text put before every input (extension).")
    add_eos: Optional[bool] = Field(None, description="Append the end-of-sequence token (extension).")
    output_dtype: Optional[OutputDtype] = Field(
        None, description="float32 | float16 | int8 | uint8 (with calibration) | binary | ubinary (sign bits packed "
                          "8 to a byte) (extension).")
    calibration: Optional[Calibration] = Field(
        None, description="int8/uint8: per-value ranges {'min': [...], 'max': [...]} (extension; an alias can hold "
                          "them).")

    def spec_fields(self) -> dict:
        """The extension fields given (``None`` for the others)."""
        out = {name: getattr(self, name) for name in SpecExtension.model_fields}
        if self.calibration is not None:
            out["calibration"] = (self.calibration.min, self.calibration.max)
        return out


class EmbeddingsRequest(SpecExtension):
    """Body of ``POST /v1/embeddings`` (OpenAI's, plus the :class:`SpecExtension` fields). Unknown fields: 400."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1 is not true, "3" is not 3

    input: Inputs = Field(..., description="A text, a list of texts, a list of token ids, or a list of lists of token "
                                           "ids (texts not blank, lists not empty, ids in the model's vocabulary).")
    model: str = Field(..., description="The served model's name or an alias (GET /v1/models lists them).")
    encoding_format: Literal["float", "base64"] = Field("float", description="float, or base64 (float32 LE).")
    dimensions: Optional[WholeInt] = Field(None, ge=1, description="Keep this many leading dimensions (renormalised).")
    user: Optional[str] = Field(None, description="Accepted and ignored.")
    normalize: Optional[bool] = Field(None, description="L2-normalise (default true, as OpenAI; extension).")
    truncate: Optional[bool] = Field(None, description="Cut inputs at the model's length instead of windowing "
                                                       "(extension).")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Union[list[float], str]


class Usage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIErrorDetail


ERRORS: dict[int | str, dict] = {code: {"model": OpenAIErrorBody, "description": what} for code, what in (
    (400, "Invalid request: a body that does not fit the schema, an invalid option, an empty input, a token id "
          "outside the vocabulary."),
    (401, "Missing or wrong API key (--api-key)."),
    (404, "The model name is neither the served model nor an alias."),
    (429, "The queue is full (max_queue_tokens); retry after Retry-After seconds."),
    (413, "The body is over max_body_bytes, or the request over max_request_tokens or max_response_bytes."),
    (415, "A body that is not application/json."),
    (500, "An internal error (the server log has the details)."))}


router = protocol_router(OPENAI, tags=["OpenAI-compatible"])


@router.head("/v1/models", include_in_schema=False)
@router.get("/v1/models", response_model=ModelList, responses=ERRORS)
def models(request: Request) -> ModelList:
    """The served model and its aliases, as OpenAI lists models."""
    created = int(time.time())
    return ModelList(data=[ModelCard(id=name, created=created, owned_by="layerwise")
                           for name in service_of(request).model_names()])


@router.post("/v1/embeddings", response_model=EmbeddingsResponse, responses=ERRORS,
             openapi_extra=request_body(EmbeddingsRequest))
async def embeddings(request: Request, req: EmbeddingsRequest = json_body(EmbeddingsRequest)) -> Response:
    """Embeddings as OpenAI's ``/v1/embeddings`` returns them, from any layer (see the module docstring)."""
    service = service_of(request)

    def check() -> tuple[EncodeSpec, list, Kind, int]:
        spec = service.spec(OPENAI_DEFAULTS, service.alias_fields(req.model), req.spec_fields(),
                            {"normalize": req.normalize, "truncate": req.truncate, "dimensions": req.dimensions})
        if spec.level != "sentence":
            raise ServiceError(422, f"OpenAI's embeddings are one vector per input: level {spec.level!r} "
                                    f"is served by /v1/encode (and token vectors by /embed_all)", "level")
        items, kind, answer = service.prepare(spec, req.input, "input", binary=req.encoding_format == "base64",
                                              itemsize=4)
        return spec, items, kind, answer

    def build(spec: EncodeSpec, items: list, rows: list) -> dict:
        vectors = finite(np.stack([v for v, _ in rows]), spec.output_dtype)
        tokens = sum(len(t.ids) for _, t in rows)
        if req.encoding_format == "base64":  # OpenAI's base64 is float32 (integer precisions: their values)
            data = [{"object": "embedding", "index": i, "embedding": base64.b64encode(v.tobytes()).decode()}
                    for i, v in enumerate(vectors.reshape(len(vectors), -1).astype("<f4"))]
        else:
            data = [{"object": "embedding", "index": i, "embedding": v.tolist()}  # one flat vector (a stack flattened,
                    for i, v in enumerate(vectors.reshape(len(vectors), -1))]  # as base64 and TEI's /embed give it)
        return {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    return await respond(request, check, build)


__all__ = ["Calibration", "EmbeddingsRequest", "EmbeddingsResponse", "SpecExtension", "router"]
