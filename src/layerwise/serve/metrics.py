"""Prometheus metrics of the service (``GET /metrics``), in a registry of the app's own (no global state).

Every answer is counted by route and status, refusals included (a missing key, a wrong ``Host:``, a body over the
limit or of the wrong type, a body that does not fit the schema): :class:`CountAnswers` wraps the whole app, and the
connection limits (:mod:`layerwise.serve.connections`) count what they answer below it (route ``connection``: 503
past the cap, 408 on a deadline, 400 for a request that does not parse). The
batcher's calls say how full they were and what they computed against what their requests needed.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, MutableMapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .errors import route_of

if TYPE_CHECKING:
    from .batcher import BatchStats
    from .ceilings import Ceilings

UNMATCHED = "unmatched"  # the route label of a path no route answers (not the path itself: unbounded labels)
CONNECTION = "connection"  # the route label of an answer given on the connection, before any request reached the app


class Metrics:
    """Answers by route and status, latency by route, merged calls (requests, texts, specs, occupancy), tokens,
    tokens/s, and the layers computed against the layers requested."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("layerwise_requests", "Answers by route and HTTP status, refusals included",
                                ["route", "status"], registry=r)
        self.latency = Histogram("layerwise_request_latency_seconds", "Answer latency by route", ["route"], registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.batches = Counter("layerwise_batches", "Model calls (merged batches)", registry=r)
        self.batch_requests = Histogram("layerwise_batch_requests", "Requests merged into one model call", registry=r,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_specs = Histogram("layerwise_batch_specs", "Distinct specs (layers, pool, combine, precision, "
                                     "...) sharing one model call", registry=r, buckets=(1, 2, 3, 4, 6, 8, 12, 16, 32))
        self.batch_segments = Histogram("layerwise_batch_segments", "Depth segments of one model call (each run "
                                        "to its own deepest layer, in one pipeline)", registry=r,
                                        buckets=(1, 2, 3, 4, 6, 8, 16, 32))
        self.batches_ragged = Counter("layerwise_batches_ragged", "Model calls of several depths whose rows each "
                                      "left their forward batches at their own request's depth", registry=r)
        self.runtime_calls = Counter("layerwise_runtime_calls", "Model calls by what ran them (the "
                                     "X-Layerwise-Runtime header: e.g. openvino, or onnx; ragged)", ["runtime"],
                                     registry=r)
        self.batch_texts = Histogram("layerwise_batch_texts", "Texts in one model call", registry=r,
                                     buckets=(1, 4, 16, 64, 256, 1024))
        self.batch_occupancy = Histogram("layerwise_batch_occupancy", "Estimated tokens of a model call over "
                                         "max_batch_tokens", registry=r,
                                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 8.0))
        self.batch_seconds = Histogram("layerwise_batch_seconds", "Model time per merged batch", registry=r)
        self.layers_computed = Counter("layerwise_layer_tokens_computed", "Estimated tokens x layers run (each "
                                       "depth segment of a call to its deepest request's layer)", registry=r)
        self.layers_requested = Counter("layerwise_layer_tokens_requested", "Estimated tokens x layers the requests "
                                        "needed (each to its own deepest layer)", registry=r)
        self.cost_batch = Gauge("layerwise_cost_batch_seconds", "The cost model's price of one forward batch "
                                "(refit on every model call)", registry=r)
        self.cost_batch_layer = Gauge("layerwise_cost_batch_layer_seconds", "The cost model's price of one forward "
                                      "batch through one layer (refit on every model call)", registry=r)
        self.cost_token_layer = Gauge("layerwise_cost_token_layer_seconds", "The cost model's price of one token "
                                      "through one layer (refit on every model call)", registry=r)
        self.cost_correction = Gauge("layerwise_cost_correction", "Seconds the model calls of several depths run "
                                     "each way (cut: into depth segments; whole: one segment to the deepest depth; "
                                     "ragged:RUNTIME: each row to its own depth on that runtime's chain) took "
                                     "over the cost model's prediction (fading sums; 1 before any), by site",
                                     ["site", "way"], registry=r)
        self.tokens_total = Counter("layerwise_tokens", "Tokens encoded (special tokens included)", registry=r)
        self.tokens_per_second = Gauge("layerwise_tokens_per_second", "Tokens/s of the last model step", registry=r)
        self.shed_total = Counter("layerwise_shed", "Requests shed with 503 at a memory ceiling, by reason (memory: "
                                  "--max-memory; answers: --max-unsent-bytes)", ["reason"], registry=r)
        self.resident = Gauge("layerwise_resident_bytes", "The server process's resident memory (RSS)", registry=r)
        self.max_memory = Gauge("layerwise_max_memory_bytes", "The memory ceiling (--max-memory; 0: none)",
                                registry=r)
        self.unsent = Gauge("layerwise_unsent_answer_bytes", "Bytes of answers held for clients: being made, or "
                            "waiting in send buffers", registry=r)
        self.send_timeouts = Gauge("layerwise_send_timeouts_total", "Connections dropped because their client read "
                                   "nothing of an answer for --send-timeout seconds", registry=r)
        self.open_work = Gauge("layerwise_open_work", "Requests queued for the model, model calls open, and 1 while "
                               "a model step runs (0: the model is idle)", registry=r)

    def request(self, route: str, status: int, seconds: float) -> None:
        """Count one answer."""
        self.requests.labels(route=route, status=str(status)).inc()
        self.latency.labels(route=route).observe(seconds)

    def shed(self, reason: str) -> None:
        """Count a request shed at a ceiling (``"memory"`` or ``"answers"``; :mod:`layerwise.serve.ceilings`)."""
        self.shed_total.labels(reason=reason).inc()

    def watch(self, ceilings: "Ceilings", open_work: Callable[[], int] | None = None) -> None:
        """Report ``ceilings``' numbers and ``open_work()`` (the batcher's), read at each scrape."""
        if open_work is not None:
            self.open_work.set_function(open_work)
        from ..model.memory import resident_bytes

        self.resident.set_function(resident_bytes)
        self.max_memory.set(ceilings.max_memory)
        self.unsent.set_function(ceilings.unsent)
        self.send_timeouts.set_function(lambda: ceilings.send_timeouts)

    def refused(self, status: int) -> None:
        """Count an answer given below the app, on the connection (503 past the cap, 408, h11's 400): route
        ``connection``."""
        self.requests.labels(route=CONNECTION, status=str(status)).inc()

    def batch(self, stats: "BatchStats", max_batch_tokens: int, prices: tuple[float, float, float],
              corrections: dict[tuple[str, str], float] | None = None) -> None:
        """Record one finished model call, the cost model's ``prices`` (per batch, per batch and layer, per token and
        layer) after it, and the ``corrections`` of its predictions by ``(site, way)``
        (:class:`~layerwise.serve.cost.WayCorrections`)."""
        for (site, way), factor in (corrections or {}).items():
            self.cost_correction.labels(site=site, way=way).set(factor)
        self.cost_batch.set(prices[0])
        self.cost_batch_layer.set(prices[1])
        self.cost_token_layer.set(prices[2])
        self.batches.inc()
        self.batch_requests.observe(stats.requests)
        self.batch_specs.observe(stats.specs)
        self.batch_texts.observe(stats.texts)
        self.batch_occupancy.observe(stats.tokens / max_batch_tokens)
        self.batch_seconds.observe(stats.seconds)
        self.batch_segments.observe(stats.segments)
        if stats.ragged:
            self.batches_ragged.inc()
        self.layers_computed.inc(stats.computed)
        self.layers_requested.inc(stats.needed)

    def tokens(self, n: int, seconds: float) -> None:
        self.tokens_total.inc(n)
        if seconds > 0:
            self.tokens_per_second.set(n / seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class CountAnswers:
    """ASGI middleware (outermost): every HTTP answer counted in :class:`Metrics` with its route (the path template
    of the route that answered, or the route its path matches for a refusal before routing; ``unmatched`` for none)
    and its status."""

    def __init__(self, app, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = 500  # an answer that never started (the app raised) is counted as the 500 the server sends

        async def sending(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.request(route_label(scope), status, time.perf_counter() - t0)


def route_label(scope: MutableMapping[str, Any]) -> str:
    """The route label of ``scope`` (see :class:`CountAnswers`)."""
    route = scope.get("route") or route_of(scope)
    return getattr(route, "path", None) or UNMATCHED


__all__ = ["CONNECTION", "CountAnswers", "Metrics", "UNMATCHED", "route_label"]
