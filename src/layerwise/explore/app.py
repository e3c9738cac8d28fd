"""The explorer's web app: the page, its static files and its JSON API, on FastAPI.

``GET /`` is the page (``static/index.html``: plain HTML, CSS and JavaScript shipped in the package, no CDN, so it
works offline). The API under ``/explorer/api``:

=========================== =========================================================================================
``GET  info``               what is loaded: the corpus (texts, labels, layer names, sample note), the model and its
                            sites, the probe directories, the projections available
``GET  layer/{k}?method=``  layer view ``k`` of the corpus: ``points [n, 2]`` and its scores (computed once per
                            layer and method, then cached)
``GET  scores``             every layer view's scores (for the per-layer curve)
``POST sentence``           ``{"text", "site"}``: :func:`~layerwise.explore.sentence.sentence_view`
``GET  probe/{i}``          probe directory ``i`` of those named at start (``--probe``; clients never send paths;
                            :func:`~layerwise.explore.probe_dir.read_probe_dir`)
=========================== =========================================================================================

Errors are JSON ``{"detail": ...}`` with status 400 (bad input, with what was wrong) or 404 (nothing loaded).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from ..corpus.records import EMPTY_TEXT, NON_BLANK, is_blank
from ..errors import InputError, LayerwiseError
from .corpus import Corpus
from .probe_dir import read_probe_dir
from .projection import available_methods, project
from .scores import layer_scores
from .sentence import sentence_view

if TYPE_CHECKING:
    from ..extractor import Extractor

STATIC = {"explorer.js": "text/javascript", "explorer.css": "text/css"}  # the page's files and their types


class ErrorBody(BaseModel):
    """An error: ``detail`` says what was wrong and how to fix it (FastAPI's list for a malformed body)."""

    detail: Union[str, list[dict[str, Any]]]


ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "An invalid value (the message names it and the valid ones)."},
    401: {"model": ErrorBody, "description": "Missing or wrong API key (the service's --api-key)."},
    404: {"model": ErrorBody, "description": "Nothing of that kind is loaded, or no such index."},
}


@dataclass
class Explorer:
    """What one explorer shows: a corpus, a model for the sentence view, probe directories (any may be absent).

    Layer views (projection + scores) are computed on first request and cached for the life of the process; one
    lock keeps two requests from computing the same view twice. ``model_lock`` serialises calls into the model
    (the service shares it with its batcher: two threads must not run one model's hooks at once).
    """

    corpus: Corpus | None = None
    extractor: Extractor | None = None
    probe_dirs: list[str] = field(default_factory=list)
    model_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _views: dict[tuple[int, str], dict] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def info(self) -> dict:
        """JSON for ``GET info``."""
        ex = self.extractor
        model = None if ex is None else {"name": ex.loaded.name, "sites": list(ex.sites), "num_layers": ex.num_layers}
        return {"corpus": None if self.corpus is None else self.corpus.info(), "model": model,
                "probe_dirs": [{"index": i, "name": Path(d).resolve().name} for i, d in enumerate(self.probe_dirs)],
                "methods": available_methods()}

    def probe(self, index: int) -> dict:
        """Probe directory ``index`` of :attr:`probe_dirs` (named at start), read for the probe view.

        Raises:
            LookupError: no such index (naming how many there are).
        """
        if not 0 <= index < len(self.probe_dirs):
            n = len(self.probe_dirs)
            raise LookupError(f"no probe directory {index}: this explorer was started with {n} (0..{n - 1})"
                              if n else "no probe directory: start the explorer with --probe DIR")
        return read_probe_dir(self.probe_dirs[index])

    def layer(self, k: int, method: str = "pca") -> dict:
        """Layer view ``k``: ``{"k", "name", "points" [n][2], "method", "explained", "scores"}`` (cached)."""
        corpus = self.corpus
        if corpus is None:
            raise LookupError("no corpus is loaded: start the explorer with a store or --texts")
        if not 0 <= k < len(corpus.layer_names):
            raise LayerwiseError(f"layer view {k} does not exist; this corpus has views "
                                 f"0..{len(corpus.layer_names) - 1} ({', '.join(corpus.layer_names)})")
        with self._lock:
            key = (k, method)
            if key not in self._views:
                x = corpus.vectors[:, k]
                xy, info = project(x, method)
                scores = layer_scores(x, corpus.labels) if corpus.labels is not None else {}
                points = xy.astype(np.float64).round(4).tolist()  # (float64: 4 decimals print as 4 decimals)
                self._views[key] = {"k": k, "name": corpus.layer_names[k], "points": points, **info,
                                    "scores": {name: _finite(v) for name, v in scores.items()}}
            return self._views[key]

    def sentence(self, text: str, site: str = "block") -> dict:
        """The sentence view of ``text`` at ``site`` (see :func:`~layerwise.explore.sentence.sentence_view`)."""
        if self.extractor is None:
            raise LookupError("no model is loaded for the sentence view")
        if is_blank(text):
            raise InputError(f"the text is {EMPTY_TEXT}; type a sentence")
        with self.model_lock:
            return sentence_view(self.extractor, text, site)

    def scores(self) -> dict:
        """Every layer view's scores: ``{"names", "knn", "probe", "silhouette"}`` lists (``null`` where undefined)."""
        if self.corpus is None:
            raise LookupError("no corpus is loaded: start the explorer with a store or --texts")
        views = [self.layer(k) for k in range(len(self.corpus.layer_names))]
        out: dict[str, Any] = {"names": self.corpus.layer_names}
        for name in ("knn", "probe", "silhouette"):
            out[name] = [v["scores"].get(name) for v in views]
        return out


def _finite(v: float) -> float | None:
    return None if v is None or math.isnan(v) else round(float(v), 4)


class SentenceRequest(BaseModel):
    """``POST /explorer/api/sentence``."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 1 is not true, "3" is not 3
    text: str = Field(..., json_schema_extra={"pattern": NON_BLANK}, description="A text (not blank).")
    site: str = "block"


def _static(name: str) -> Any:
    return resources.files("layerwise.explore") / "static" / name


def explorer_router(explorer: Explorer) -> APIRouter:
    """The page at ``/`` and its API under ``/explorer`` (mounted by :func:`create_explorer_app` and by the
    service's app)."""
    router = APIRouter()

    @router.get("/", response_class=HTMLResponse)
    def page() -> HTMLResponse:
        """The explorer's page (the TEI predict route is POST on the same path)."""
        return HTMLResponse(_static("index.html").read_text(encoding="utf-8"))

    @router.get("/explorer/static/{name}", include_in_schema=False)
    def static(name: str) -> Response:
        if name not in STATIC:
            raise HTTPException(404, f"no static file {name!r}")
        return Response(_static(name).read_bytes(), media_type=STATIC[name])

    @router.get("/explorer/api/info", responses=ERRORS)
    def info() -> dict:
        return explorer.info()

    @router.get("/explorer/api/layer/{k}", responses=ERRORS)
    def layer(k: int, method: str = "pca") -> dict:
        return _answer(lambda: explorer.layer(k, method))

    @router.get("/explorer/api/scores", responses=ERRORS)
    def scores() -> dict:
        return _answer(explorer.scores)

    @router.post("/explorer/api/sentence", dependencies=[Depends(_json_only)], responses={
        **ERRORS, 415: {"model": ErrorBody, "description": "A body that is not application/json."}})
    def sentence(req: SentenceRequest) -> dict:
        return _answer(lambda: explorer.sentence(req.text, req.site))

    @router.get("/explorer/api/probe/{index}", responses=ERRORS)
    def probe(index: int) -> dict:
        return _answer(lambda: explorer.probe(index))

    return router


def _json_only(request: Request) -> None:
    """415 for a body not sent as ``application/json`` (a web page may send the others to any server unasked; see
    :mod:`layerwise.serve.body`)."""
    from ..serve.body import check_json_type  # here, not at the top: layerwise.serve imports this module

    check_json_type(request)


def _answer(fn) -> dict:
    """``fn()``, with a user error as a 400 and "nothing loaded" as a 404, both saying what was wrong."""
    try:
        return fn()
    except LookupError as exc:
        raise HTTPException(404, str(exc.args[0])) from None
    except ValueError as exc:
        raise HTTPException(400, str(exc)) from None


def create_explorer_app(explorer: Explorer) -> FastAPI:
    """A FastAPI app serving only the explorer (``layerwise explore``; run it with uvicorn on 127.0.0.1)."""
    app = FastAPI(title="layerwise explorer", docs_url=None, redoc_url=None)
    app.include_router(explorer_router(explorer))
    return app


__all__ = ["Explorer", "SentenceRequest", "create_explorer_app", "explorer_router"]
