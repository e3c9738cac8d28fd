"""What every protocol of the service shares: the limits, the batcher over one model, the spec of a request (its
model name or alias, its fields), the input checks, and the encoding of a request's items.

layerwise's own ``/v1/encode`` (:mod:`layerwise.serve.routes`), the OpenAI routes (:mod:`layerwise.serve.openai`)
and the TEI routes (:mod:`layerwise.serve.tei`) differ only in their bodies and error shapes: each answers through
:func:`layerwise.serve.respond.respond`, which turns a :class:`~layerwise.ServiceError` into its route's shape, so
one check says the same thing in every protocol.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal

import numpy as np

from ..encoding.precision import NUMPY_DTYPES, read_calibration
from ..encoding.spec import EncodeSpec
from ..encoding.tokenize import check_texts
from ..encoding.vocab import FLOAT_DTYPES
from ..encoding.windows import window_starts
from ..errors import LayerwiseError, ServiceError
from ..extractor import Extractor
from ..model.memory import parse_size
from .batcher import Batcher, BatchStats, Job, QueueFull, Step
from .ceilings import UNSENT_BYTES, Ceilings
from .cost import CostModel
from .inputs import blank_message, is_blank
from .metrics import Metrics

if TYPE_CHECKING:
    from ..model.backends.base import Plan

Kind = Literal["text", "words", "ids"]


@dataclass
class Limits:
    """Request limits of the service."""

    max_texts: int = 256
    max_text_chars: int = 20_000
    max_body_bytes: int = 4 << 20
    max_batch_tokens: int = 16384
    max_response_bytes: int = 64 << 20
    max_queue_tokens: int = 262144
    max_request_tokens: int = 131072
    max_unsent_bytes: int = UNSENT_BYTES
    max_memory: int | str | None = None  # None: a share of what the process may take (ceilings.default_max_memory)

    def __post_init__(self) -> None:
        for name in ("max_texts", "max_text_chars", "max_body_bytes", "max_batch_tokens", "max_response_bytes",
                     "max_queue_tokens", "max_request_tokens", "max_unsent_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayerwiseError(f"{name} must be a positive int, got {value!r} (CLI: --{name.replace('_', '-')})")
        if self.max_unsent_bytes < self.max_response_bytes:
            raise LayerwiseError(f"max_unsent_bytes ({self.max_unsent_bytes:,}) is below max_response_bytes "
                                 f"({self.max_response_bytes:,}): an answer of the largest size would always be shed; "
                                 f"raise --max-unsent-bytes or lower --max-response-bytes")
        if self.max_memory not in (None, 0):
            parse_size(self.max_memory, "--max-memory")  # refused now, with the units


OPENAI_DEFAULTS = {"normalize": True}  # OpenAI's embeddings are unit vectors (aliases are picked by OpenAI's model)


@dataclass(frozen=True)
class CalibrationTexts:
    """An alias's ``calibration=FILE`` of texts: the ranges depend on the request's whole spec, so they are computed
    per resolved spec (once) rather than at parse time."""

    source: str
    texts: tuple[str, ...]

    def __repr__(self) -> str:
        return f"<{len(self.texts)} calibration texts from {self.source}>"


class SpecCache:
    """``(layers, spec.to_dict(), header JSON)`` per resolved spec, built once (at most ``size`` specs kept).

    Requests repeat a handful of option sets; the cached values are only read, never changed.
    """

    def __init__(self, size: int = 256):
        self.size = size
        self._cache: dict[EncodeSpec, tuple[list[int], dict, str]] = {}

    def __call__(self, spec: EncodeSpec) -> tuple[list[int], dict, str]:
        hit = self._cache.get(spec)
        if hit is None:
            if len(self._cache) >= self.size:
                self._cache.pop(next(iter(self._cache)))
            d = spec.to_dict()
            head = dict(d)
            if spec.calibration is not None:  # the ranges are 2 x D numbers: the header names them by digest
                raw = json.dumps(d["calibration"], separators=(",", ":")).encode()
                head["calibration"] = f"sha256:{hashlib.sha256(raw).hexdigest()} ({len(spec.calibration[0])} ranges)"
            hit = self._cache[spec] = (list(spec.layer_indices), d, json.dumps(head, separators=(",", ":")))
        return hit


class Service:
    """One served model: its limits, batcher, metrics and aliases (named spec fields).

    Args:
        ex: the loaded model. limits: request limits. lock: serialises calls into the model (shared with the
            explorer's sentence view). aliases: model name -> :class:`~layerwise.EncodeSpec` fields, picked by a
            request's ``model`` (validated against the model here: a bad alias fails at start, not per request).
    """

    def __init__(self, ex: Extractor, limits: Limits, lock: threading.Lock,
                 aliases: dict[str, dict[str, Any]] | None = None):
        self.ex, self.limits, self.lock = ex, limits, lock
        self.metrics = Metrics()
        self.ceilings = Ceilings(limits.max_memory, limits.max_unsent_bytes, shed=self.metrics.shed)
        self.cost = CostModel.for_device(ex.backend.device.type, ex.batch_tokens)
        self.batcher = Batcher(self._run, self.cost, max_batch_tokens=limits.max_batch_tokens,
                               max_queue_tokens=limits.max_queue_tokens, on_batch=self._batch_done,
                               ragged=lambda site, depth: _ragged_offer(ex, depth, str(site)))
        self.metrics.watch(self.ceilings, self.batcher.open_work)
        self.specs = SpecCache()
        self.model_id = ex.loaded.name
        self._ranges: dict[tuple[EncodeSpec, str], EncodeSpec] = {}
        self.aliases = {name: self._calibrated(name, fields) for name, fields in (aliases or {}).items()}
        for name, fields in self.aliases.items():
            try:
                self.spec(OPENAI_DEFAULTS, fields)
            except (LayerwiseError, TypeError) as exc:
                raise LayerwiseError(f"alias {name!r} ({fields}) does not fit {self.model_id!r}: {exc}") from exc

    def _calibrated(self, name: str, fields: dict[str, Any]) -> dict[str, Any]:
        """An alias's fields with ``calibration=FILE`` read: ranges as they are, texts kept as
        :class:`CalibrationTexts` (encoded per resolved spec, once: see :meth:`spec`)."""
        source = fields.get("calibration")
        if not isinstance(source, str):
            return dict(fields)
        try:
            got = read_calibration(source)
        except LayerwiseError as exc:
            raise LayerwiseError(f"alias {name!r}: calibration {source!r}: {exc}") from exc
        if isinstance(got, list):
            texts = CalibrationTexts(source, tuple(got))
            return {**fields, "calibration": texts}  # calibrated for its own spec by the check in __init__
        return {**fields, "calibration": [list(row) for row in got]}

    def described_aliases(self) -> dict[str, dict[str, Any]]:
        """The aliases as JSON (calibration ranges and texts said in a few words, not listed)."""
        out = {}
        for name, fields in self.aliases.items():
            cal = fields.get("calibration")
            if isinstance(cal, CalibrationTexts):
                fields = {**fields, "calibration": f"{len(cal.texts)} texts from {cal.source}"}
            elif cal is not None:
                fields = {**fields, "calibration": f"{len(cal[0])} ranges"}
            out[name] = fields
        return out

    # ---- names --------------------------------------------------------------------------------------------
    def model_names(self) -> list[str]:
        """The names a request's ``model`` may take: the model's own name, its last path part, the aliases."""
        own = [self.model_id, self.model_id.rstrip("/").rsplit("/", 1)[-1]]
        return list(dict.fromkeys(own + list(self.aliases)))

    def alias_fields(self, model: str | None) -> dict[str, Any]:
        """The spec fields ``model`` names: an alias's, ``{}`` for the model itself (or no name).

        Raises:
            ServiceError: 404, an unknown name (listing the valid ones).
        """
        if model is None:
            return {}
        if model in self.aliases:
            return dict(self.aliases[model])
        if model in self.model_names():
            return {}
        raise ServiceError(404, f"model {model!r} is not served here; the served names are: "
                                f"{', '.join(self.model_names())} (aliases pick layers: layerwise serve --alias)",
                           "model", "model_not_found")

    def spec(self, *layers_of_fields: dict[str, Any]) -> EncodeSpec:
        """The resolved spec of fields given in layers (protocol defaults, then an alias, then the request's own
        fields: later ones win; ``None`` values are left out).

        Raises:
            ServiceError: 422 with the library's message (valid values or range) for an invalid or inapplicable
                option.
        """
        fields: dict[str, Any] = {}
        for layer in layers_of_fields:
            fields.update({k: v for k, v in layer.items() if v is not None})
        texts = fields.pop("calibration") if isinstance(fields.get("calibration"), CalibrationTexts) else None
        try:
            if texts is None:
                return EncodeSpec.from_dict(fields).resolve(self.ex)
            return self._calibrate(EncodeSpec.from_dict(fields), texts).resolve(self.ex)
        except (ValueError, TypeError) as exc:
            raise ServiceError(422, str(exc)) from None

    def _calibrate(self, spec: EncodeSpec, texts: CalibrationTexts) -> EncodeSpec:
        """``spec`` with the ranges of an alias's calibration texts for exactly this spec (its layers, pool,
        normalisation and dimensions), computed once per spec."""
        key = (spec, texts.source)
        if key not in self._ranges:
            if len(self._ranges) >= 64:
                self._ranges.pop(next(iter(self._ranges)))
            with self.lock:
                self._ranges[key] = self.ex.calibrate(list(texts.texts), spec)
        return self._ranges[key]

    # ---- inputs -------------------------------------------------------------------------------------------
    def check_items(self, items: Any, kind: Kind, prompt: str = "", field: str = "texts") -> list:
        """``items`` checked against the limits (the prompt counts toward every text's characters) and their types.

        Raises:
            ServiceError: 422 naming the item and the limit, or the wrong type.
        """
        if not isinstance(items, list) or not items:
            raise ServiceError(422, f"'{field}' is empty; give at least one input", field)
        if len(items) > self.limits.max_texts:
            raise ServiceError(422, f"{len(items)} texts in one request; the limit is {self.limits.max_texts} "
                                    f"(max_texts)", field)
        cap = self.limits.max_text_chars
        for i, item in enumerate(items):
            if kind == "ids":
                n = len(item)
                what = "token ids"
            else:
                n = len(prompt) + (len(item) if isinstance(item, str) else sum(len(w) + 1 for w in item))
                what = "characters" + (" with the prompt" if prompt else "")
            if n > cap:
                raise ServiceError(422, f"text {i} has {n} {what}; the limit is {cap} (max_text_chars)", field)
        if kind == "ids":
            vocab = len(self.ex.tokenizer)
            empty = next((i for i, ids in enumerate(items) if not ids), None)
            if empty is not None:
                raise ServiceError(422, f"input {empty} is an empty list of token ids; give at least one id", field)
            for i, ids in enumerate(items):
                bad = next((x for x in ids if not 0 <= x < vocab), None)
                if bad is not None:
                    raise ServiceError(422, f"token id {bad} in input {i} is outside the vocabulary of "
                                            f"{self.model_id!r} (0..{vocab - 1}); send text, or this model's own "
                                            f"token ids (if this is LangChain's OpenAIEmbeddings, pass "
                                            f"check_embedding_ctx_length=False: it sends tiktoken ids)", field)
            return [list(ids) for ids in items]
        try:
            check_texts(items, words=kind == "words")  # wrong types, lone surrogates: naming the index
        except (ValueError, TypeError) as exc:
            raise ServiceError(422, str(exc), field) from None
        for i, item in enumerate(items):  # the rule of `layerwise extract`: a blank text is a bad record
            if kind == "words" and not item:
                raise ServiceError(422, f"word list {i} is empty; give at least one word", field)
            blank = [w for w in ([item] if kind == "text" else item) if is_blank(w)]
            if blank:
                raise ServiceError(422, blank_message(i, "text" if kind == "text" else "a word of word list"), field)
        return list(items)

    def check_response(self, spec: EncodeSpec, items: list, kind: Kind, binary: bool = False,
                       itemsize: int | None = None) -> int:
        """The answer's estimated bytes, after refusing, before any compute, a request whose answer would pass
        ``max_response_bytes`` or whose tokens would pass ``max_request_tokens`` (:meth:`check_tokens`). The
        answer's size is
        estimated from the rows it asks for (texts: about 1 token per 3 characters plus the special tokens; word
        lists: their words; token ids: their count) times ``D``, at the bytes of one value in base64 (OpenAI's
        base64 is float32: ``itemsize=4``) or about 12 a float and 4 an integer in JSON.

        Raises:
            ServiceError: 413 with the estimate, the limit, and what to ask for instead.
        """
        width = int(np.prod(spec.feature_shape(self.ex.site_width(spec.site))))
        if spec.level == "sentence":
            rows = len(items)
        elif kind == "words" or spec.level == "word":
            rows = sum(len(w) if not isinstance(w, str) else len(w.split()) for w in items)
        else:
            rows = estimate_tokens(items, kind) + len(items) * (len(spec.prompt) // 3)
        integer = spec.output_dtype not in FLOAT_DTYPES
        if binary:
            per = itemsize if itemsize is not None else np.dtype(NUMPY_DTYPES[spec.output_dtype]).itemsize
        else:
            per = 4 if integer else 12
        estimate = rows * width * per * (4 / 3 if binary else 1)
        if estimate > self.limits.max_response_bytes:
            raise ServiceError(413, f"the answer would be about {estimate / 1e6:,.0f} MB ({rows:,} rows x {width:,} "
                                    f"numbers), over the limit of {self.limits.max_response_bytes / 1e6:,.0f} MB "
                                    f"(max_response_bytes): ask for fewer inputs or layers, a pooled level, or "
                                    f"base64 encoding")
        self.check_tokens(spec, items, kind)
        return int(estimate)

    def request_tokens(self, spec: EncodeSpec, items: list, kind: Kind) -> int:
        """The tokens ``items`` will run through the model, estimated before tokenising (:func:`estimate_tokens`,
        the prompt included), windows and their overlap included."""
        return estimate_tokens(items, kind, extra=len(spec.prompt) // 3,
                               window=None if spec.truncate else (self.ex.max_length, self.ex.stride))

    def working_bytes(self, spec: EncodeSpec, items: list, kind: Kind) -> int:
        """What computing a request holds besides its answer, estimated: its tokens' states at each requested layer
        and one more (float32), for the memory ceiling (:mod:`layerwise.serve.ceilings`)."""
        layers = len(spec.layer_indices) + 1
        return self.request_tokens(spec, items, kind) * self.ex.site_width(spec.site) * 4 * layers

    def check_tokens(self, spec: EncodeSpec, items: list, kind: Kind) -> None:
        """Refuse, before any compute, a request over ``max_request_tokens`` estimated tokens.

        Raises:
            ServiceError: 413 with the estimate, the limit and what to do.
        """
        tokens = self.request_tokens(spec, items, kind)
        if tokens > self.limits.max_request_tokens:
            raise ServiceError(413, f"the request would run about {tokens:,} tokens through the model (windows "
                                    f"included), over the limit of {self.limits.max_request_tokens:,} "
                                    f"(max_request_tokens): split it into smaller requests, or pass truncate")

    def prepare(self, spec: EncodeSpec, value: Any, field: str, binary: bool = False,
                itemsize: int | None = None) -> tuple[list, Kind, int]:
        """An OpenAI or TEI ``input(s)`` value as checked items, their kind and the answer's estimated bytes (see
        :func:`split_inputs`, :meth:`check_items`, :meth:`check_response`)."""
        items, kind = split_inputs(value, spec.prompt)
        items = self.check_items(items, kind, spec.prompt, field)
        return items, kind, self.check_response(spec, items, kind, binary, itemsize)

    # ---- encoding -----------------------------------------------------------------------------------------
    async def encode(self, spec: EncodeSpec, items: list, kind: Kind, request: Any = None) -> tuple[list, str]:
        """``([(vector ndarray [*D] or [n, *D], Tokenized)], runtime)`` for ``items``, sharing forward passes with
        other requests at the same site (whatever their layers, pooling or precision) as the batcher plans; the
        runtime that computed them as :func:`runtime_label` names it (the ``X-Layerwise-Runtime`` header). With the
        Starlette ``request``, a client that goes away while it waits is noticed the moment its disconnect arrives
        (even one that arrived while its body was checked): its work leaves the queue before it reaches the model,
        or its call stops between forward batches.

        Raises:
            ServiceError: 429 with ``Retry-After`` when the queue is full (``max_queue_tokens``); 499 when the
                client went away.
        """
        depth = max(spec.layer_indices) if spec.layer_indices else 0
        task = asyncio.ensure_future(self.batcher.submit(spec.site, depth, items, (spec, kind),
                                                         self.request_tokens(spec, items, kind)))
        # the body has been read, so the next ASGI message is the client's disconnect: waiting for it notices a
        # client that goes away at once (a poll would leave its job time to reach the model first)
        gone = asyncio.ensure_future(_disconnected(request)) if request is not None else None
        try:
            done, _ = await asyncio.wait({task} | ({gone} if gone else set()), return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                rows = task.result()
                return [(features, tokens) for features, tokens, _ in rows], rows[0][2] if rows else ""
            task.cancel()
            raise ServiceError(499, "the client went away; its request was dropped")
        except QueueFull as exc:
            raise ServiceError(429, f"the service is busy: {exc.queued:,} tokens are queued (max_queue_tokens "
                                    f"{exc.limit:,}); retry after {exc.retry_after} s", code="overloaded",
                               headers={"Retry-After": str(exc.retry_after)}) from None
        except ServiceError:
            raise
        except LayerwiseError as exc:  # e.g. inf/NaN features for an integer output_dtype
            raise ServiceError(422, str(exc)) from None
        finally:
            if gone is not None:
                gone.cancel()

    def _run(self, jobs: list[Job], segments: list[list[int]], ragged: bool | str) -> Iterator[Step]:
        """The worker's side of one merged call: each job's items tokenised as its spec says, then one pipeline of
        forward batches, each depth segment of jobs to its own deepest layer (``ragged``: each job's rows to their
        own, on the named runtime's chain where it is a name), a step per forward batch (the model lock held per step
        only, so the explorer's view can run between them). Each result is ``(features, tokens, runtime)``, the
        runtime as :func:`runtime_label` names it."""
        with self.lock:
            parts = [(toks, job.payload[0]) for job, toks in zip(jobs, self._tokenize(jobs))]
            specs = [job.payload[0] for job in jobs]
            layers = sorted({i for spec in specs for i in spec.layer_indices}) or [0]
            plan = self.ex.backend.plan(layers, specs[0].site)  # one runtime for every batch of the call
            if isinstance(ragged, str) and ragged != plan.ragged_runtime:
                plan = plan.chain(ragged)
            runtime = runtime_label(plan, bool(ragged))
            self.metrics.runtime_calls.labels(runtime=runtime).inc()
            steps = self.ex.encode_shared(parts, segments=segments, ragged=bool(ragged), plan=plan)
        while True:
            t0 = time.perf_counter()
            with self.lock:
                step = next(steps, None)
            if step is None:
                return
            self.metrics.tokens(sum(len(e.tokens.ids) for _, e in step), time.perf_counter() - t0)
            yield [(p, e.index, (e.features.numpy(), e.tokens, runtime)) for p, e in step]

    def _tokenize(self, jobs: list[Job]) -> list[list]:
        """Each job's items tokenised as its spec says, in one tokenizer call per set of tokenising options (the
        tokenizer's cost is mostly per call: a call per request cost as much as the forward pass of a merged batch of
        short requests)."""
        tokenizer = self.ex.text_tokenizer()
        together: dict[tuple, list[int]] = {}
        for j, job in enumerate(jobs):
            spec, kind = job.payload
            together.setdefault((kind, spec.truncate, spec.prompt, spec.add_eos), []).append(j)
        out: list[list] = [[] for _ in jobs]
        for (kind, truncate, prompt, add_eos), members in together.items():
            items = [item for j in members for item in jobs[j].items]
            if kind == "ids":
                toks = tokenizer.from_ids(items, truncate=truncate, add_eos=add_eos)
            else:
                toks = tokenizer(items, words=kind == "words", truncate=truncate, prompt=prompt, add_eos=add_eos)
            start = 0
            for j in members:
                out[j] = toks[start:start + len(jobs[j].items)]
                start += len(jobs[j].items)
        return out

    def _batch_done(self, stats: BatchStats) -> None:
        self.metrics.batch(stats, self.limits.max_batch_tokens,
                           (self.cost.overhead, self.cost.layer_overhead, self.cost.unit), self.batcher.corrections())


async def _disconnected(request: Any) -> None:
    """Return when the client of ``request`` (whose body has been read) disconnects."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _ragged_offer(ex: Extractor, depth: int, site: str) -> dict[str, float]:
    """The batcher's one offer for rows of mixed depths up to ``depth``: the chain the plan chose (the cheapest
    measured: see :meth:`AutoBackend.plan <layerwise.model.backends.router.AutoBackend.plan>`) and its price,
    ``{runtime: price}``, or none. Only that one is weighed against the cut: every runtime's chain offered to the
    batcher's per-call corrections ran OpenVINO's chain in 40-70% of the mixed calls on a 2-core EPYC (its calls
    looked no slower) at 0.95-1.04x the all-last throughput, against 1.22-1.36x on ONNX Runtime's chain, which the
    price timed on new shapes and mixed depths names."""
    plan = ex.backend.plan((depth,), site)
    price = plan.ragged_price(depth, site)
    return {} if price is None else {plan.ragged_runtime: price}


def runtime_label(plan: Plan, ragged: bool) -> str:
    """What computed a call, for the ``X-Layerwise-Runtime`` header: the runtime (``"torch"``, ``"onnx"``,
    ``"openvino"``), and ``"; ragged"`` where each row left its batch at its own depth (on that runtime's chain of
    one-layer graphs, or PyTorch's ragged forward), e.g. ``"openvino"``, ``"onnx; ragged"``."""
    return f"{plan.ragged_runtime}; ragged" if ragged else plan.runtime


def estimate_tokens(items: list, kind: Kind, extra: int = 0, window: tuple[int, int] | None = None) -> int:
    """Tokens ``items`` will take, before tokenising: token ids and the special tokens, else about one token per 3
    characters (a word list: its words and their separators) and the special tokens, plus ``extra`` per item (a
    prompt's). With ``window=(max_length, stride)``, an item longer than ``max_length`` counts every window it is cut
    into (each ``max_length`` tokens, overlapping by ``stride``)."""
    total = 0
    for item in items:
        if kind == "ids":
            n = len(item) + 2
        else:
            n = (len(item) if isinstance(item, str) else sum(len(w) + 1 for w in item)) // 3 + 2 + extra
        if window is not None and n > window[0]:
            length, stride = window  # as the windows will be cut (two special tokens around each)
            n = len(window_starts(n - 2, max(length - 2, 1), min(stride, max(length - 3, 0)))) * length
        total += n
    return total


def split_inputs(value: Any, prompt: str = "") -> tuple[list, Kind]:
    """OpenAI's ``input`` and TEI's ``inputs``: a text, a list of texts, a list of token ids or a list of lists of
    ids, as ``(items, kind)``.

    Raises:
        ServiceError: 422, a prompt with token ids.
    """
    if isinstance(value, str):
        return [value], "text"
    items = list(value)
    kind: Kind = "text"
    if items and all(isinstance(x, int) for x in items):
        items, kind = [items], "ids"
    elif items and all(isinstance(x, list) for x in items):
        kind = "ids"
    if kind == "ids" and prompt:
        raise ServiceError(422, "a prompt goes before text; with token ids, put its ids first", "prompt")
    return items, kind


__all__ = ["CalibrationTexts", "Kind", "Limits", "OPENAI_DEFAULTS", "Service", "SpecCache", "estimate_tokens",
           "split_inputs"]
