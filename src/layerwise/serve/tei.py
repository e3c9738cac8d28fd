"""text-embeddings-inference (TEI) compatible routes, for ``huggingface_hub.InferenceClient(model=URL)`` and every
tool that speaks TEI: ``POST /embed`` and ``POST /`` (sentence vectors), ``POST /embed_all`` (token vectors),
``POST /tokenize``, ``GET /info``.

As TEI: ``inputs`` is a text or a list of texts (or of the model's token ids); ``normalize`` defaults to true;
``truncate`` cuts inputs at the model's length (without it, layerwise windows a long input instead of refusing
it); ``truncation_direction`` is ``Right`` (``Left`` is refused: layerwise keeps an input's start);
``prompt_name`` picks a prompt from the model's ``config_sentence_transformers.json``; ``dimensions`` keeps the
leading dimensions. Errors are ``{"error": ..., "error_type": ...}``. The :class:`~layerwise.EncodeSpec` fields ride
in the body as extensions (``layers``, ``pool``, ``combine``, ...), and the ``X-Layerwise-Spec`` response header says
which resolved spec was used.

Example::

    >>> from huggingface_hub import InferenceClient                                  # doctest: +SKIP
    >>> InferenceClient(model="http://127.0.0.1:8000").feature_extraction("I love Paris").shape  # doctest: +SKIP
    (1, 384)
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Literal, Optional, Union

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..encoding.spec import EncodeSpec
from ..errors import ServiceError
from ..version import __version__
from .body import json_body, request_body
from .errors import TEI, protocol_router
from .inputs import PROMPT_NAME, Inputs, Text, Texts, WholeInt
from .openai import SpecExtension
from .respond import finite, respond, service_of
from .service import Kind, Service


class TEIErrorBody(BaseModel):
    error: str
    error_type: str


ERRORS: dict[int | str, dict] = {code: {"model": TEIErrorBody, "description": what} for code, what in (
    (400, "A body that is not JSON."),
    (401, "Missing or wrong API key (--api-key)."),
    (413, "The body, the tokens it would run or the answer it asks for is over the limit."),
    (415, "A body that is not application/json."),
    (429, "The queue is full (max_queue_tokens); retry after Retry-After seconds."),
    (422, "Invalid request: a body that does not fit the schema, an invalid option, an empty input, an unknown "
          "prompt name, a token id outside the vocabulary."),
    (424, "An internal error (the server log has the details)."))}


class EmbedRequest(SpecExtension):
    """Body of ``POST /embed`` and ``POST /`` (TEI's, plus the extension fields). Unknown fields: 422."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1 is not true, "3" is not 3

    inputs: Inputs = Field(..., description="A text, a list of texts, or the model's token ids.")
    normalize: bool = Field(True, description="L2-normalise the vectors (TEI's default: true).")
    truncate: Optional[bool] = Field(False, description="Cut inputs at the model's length.")
    truncation_direction: Literal["Right", "right", "Left", "left"] = "Right"
    prompt_name: Optional[str] = Field(None, json_schema_extra={PROMPT_NAME: True})
    dimensions: Optional[WholeInt] = Field(None, ge=1, description="Keep this many leading dimensions (renormalised).")


class EmbedAllRequest(SpecExtension):
    """Body of ``POST /embed_all``: token vectors (TEI's, plus the extension fields)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1 is not true, "3" is not 3

    inputs: Inputs
    truncate: Optional[bool] = False
    truncation_direction: Literal["Right", "right", "Left", "left"] = "Right"
    prompt_name: Optional[str] = Field(None, json_schema_extra={PROMPT_NAME: True})


class TokenizeRequest(BaseModel):
    """Body of ``POST /tokenize``."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1 is not true, "3" is not 3

    inputs: Union[Text, Texts]
    add_special_tokens: bool = True
    prompt_name: Optional[str] = Field(None, json_schema_extra={PROMPT_NAME: True})


class SimpleToken(BaseModel):
    id: int
    text: str
    special: bool
    start: Optional[int] = None
    stop: Optional[int] = None


class Info(BaseModel):
    model_id: str
    model_sha: Optional[str] = None
    model_dtype: str
    model_type: dict
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: Optional[int] = None
    max_client_batch_size: int
    tokenization_workers: int
    version: str
    layerwise: dict


@functools.lru_cache(maxsize=16)
def prompts(model_dir: str) -> dict[str, str]:
    """The named prompts of a sentence-transformers model directory (``config_sentence_transformers.json``)."""
    path = Path(model_dir) / "config_sentence_transformers.json"
    try:
        found = json.loads(path.read_text(encoding="utf-8")).get("prompts") or {}
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


def prompt_of(named: dict[str, str], name: str | None, given: str | None) -> str | None:
    """The prompt of a TEI request: the model's prompt ``name`` (then ``given``, the extension field), or ``given``.

    Raises:
        ServiceError: 422, a name the model's ``config_sentence_transformers.json`` does not have.
    """
    if name is None:
        return given
    if name not in named:
        raise ServiceError(422, f"prompt_name {name!r} is not a prompt of this model; it has "
                                f"{sorted(named) or 'none'} (config_sentence_transformers.json)", "prompt_name")
    return named[name] + (given or "")


def check_direction(value: str) -> None:
    """TEI's ``truncation_direction``: ``Right`` only (layerwise keeps an input's start)."""
    if value.lower() == "left":
        raise ServiceError(422, "truncation_direction 'Left' is not supported: layerwise keeps an input's start; "
                                "use Right", "truncation_direction")


router = protocol_router(TEI, tags=["TEI-compatible"])


async def _embed(request: Request, req: EmbedRequest) -> Response:
    service = service_of(request)

    def check() -> tuple[EncodeSpec, list, Kind, int]:
        check_direction(req.truncation_direction)
        spec = service.spec(req.spec_fields(), {"normalize": req.normalize, "truncate": req.truncate,
                                                "prompt": prompt_of(_named(service), req.prompt_name, req.prompt),
                                                "dimensions": req.dimensions})
        if spec.level != "sentence":
            raise ServiceError(422, "/embed gives one vector per input; token vectors: /embed_all")
        items, kind, answer = service.prepare(spec, req.inputs, "inputs")
        return spec, items, kind, answer

    def build(spec: EncodeSpec, items: list, rows: list) -> list:
        vectors = finite(np.stack([v for v, _ in rows]), spec.output_dtype)
        return vectors.reshape(len(vectors), -1).tolist()

    return await respond(request, check, build)


@router.post("/embed", response_model=list[list[float]], responses=ERRORS, openapi_extra=request_body(EmbedRequest))
async def embed(request: Request, req: EmbedRequest = json_body(EmbedRequest)) -> Response:
    """Sentence vectors, one per input (TEI's ``/embed``)."""
    return await _embed(request, req)


@router.post("/", response_model=list[list[float]], responses=ERRORS, openapi_extra=request_body(EmbedRequest))
async def predict(request: Request, req: EmbedRequest = json_body(EmbedRequest)) -> Response:
    """TEI's predict route: the same as ``/embed`` (``huggingface_hub`` posts here)."""
    return await _embed(request, req)


@router.post("/embed_all", response_model=list[list[list[float]]], responses=ERRORS,
             openapi_extra=request_body(EmbedAllRequest))
async def embed_all(request: Request, req: EmbedAllRequest = json_body(EmbedAllRequest)) -> Response:
    """Token vectors ``[n_tokens, D]`` per input, special tokens included (TEI's ``/embed_all``)."""
    service = service_of(request)

    def check() -> tuple[EncodeSpec, list, Kind, int]:
        check_direction(req.truncation_direction)
        spec = service.spec(req.spec_fields(), {"level": "token", "truncate": req.truncate,
                                                "prompt": prompt_of(_named(service), req.prompt_name, req.prompt)})
        items, kind, answer = service.prepare(spec, req.inputs, "inputs")
        return spec, items, kind, answer

    def build(spec: EncodeSpec, items: list, rows: list) -> list:
        return [finite(v).reshape(v.shape[0], -1).tolist() for v, _ in rows]

    return await respond(request, check, build)


@router.post("/tokenize", response_model=list[list[SimpleToken]], responses=ERRORS,
             openapi_extra=request_body(TokenizeRequest))
def tokenize(request: Request, req: TokenizeRequest = json_body(TokenizeRequest)) -> JSONResponse:
    """Each input's tokens: ``id``, ``text``, ``special``, character ``start``/``stop`` (TEI's ``/tokenize``)."""
    service = service_of(request)
    try:
        prompt = prompt_of(_named(service), req.prompt_name, None) or ""
        texts = [req.inputs] if isinstance(req.inputs, str) else list(req.inputs)
        texts = service.check_items(texts, "text", prompt, "inputs")
    except ServiceError as exc:
        return TEI.response(exc.status, exc.detail, exc.param)
    tok = service.ex.tokenizer
    out = []
    for text in texts:
        enc = tok(prompt + text, add_special_tokens=req.add_special_tokens, return_offsets_mapping=True,
                  return_special_tokens_mask=True, verbose=False)
        pieces = tok.convert_ids_to_tokens(enc["input_ids"])
        out.append([{"id": int(i), "text": piece, "special": bool(sp),
                     "start": None if sp else int(a), "stop": None if sp else int(b)}
                    for i, piece, sp, (a, b) in zip(enc["input_ids"], pieces, enc["special_tokens_mask"],
                                                      enc["offset_mapping"])])
    return JSONResponse(out)


@router.head("/info", include_in_schema=False)
@router.get("/info", response_model=Info, responses=ERRORS)
def info(request: Request) -> dict:
    """What TEI's ``/info`` says, plus the layerwise facts (layers, sites, aliases)."""
    service = service_of(request)
    ex = service.ex
    d = ex.describe()
    return {"model_id": service.model_id, "model_sha": None, "model_dtype": d["compute_dtype"],
            "model_type": {"embedding": {"pooling": "mean"}}, "max_concurrent_requests": 512,
            "max_input_length": ex.max_length, "max_batch_tokens": service.limits.max_batch_tokens,
            "max_batch_requests": None, "max_client_batch_size": service.limits.max_texts,
            "tokenization_workers": 1, "version": __version__,
            "layerwise": {"layers": d["layers"], "sites": list(d["sites"]), "aliases": service.described_aliases(),
                          "names": service.model_names()}}


def _named(service: Service) -> dict[str, str]:
    """The served model's named prompts (read once per model directory)."""
    return prompts(str(service.ex.loaded.name))


__all__ = ["EmbedAllRequest", "EmbedRequest", "TokenizeRequest", "check_direction", "prompt_of", "prompts",
           "router"]
