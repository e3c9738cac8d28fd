"""Prometheus metrics of the service (``GET /metrics``), in a registry of the app's own (no global state)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest


class Metrics:
    """Requests by status, latency, batches and how many requests each merged, tokens and tokens/s."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter("layerwise_requests", "Encode requests by HTTP status", ["status"], registry=r)
        self.latency = Histogram("layerwise_request_latency_seconds", "Encode request latency", registry=r,
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.batches = Counter("layerwise_batches", "Model calls (merged batches)", registry=r)
        self.batch_requests = Histogram("layerwise_batch_requests", "Requests merged into one model call", registry=r,
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.batch_texts = Histogram("layerwise_batch_texts", "Texts in one model call", registry=r,
                                     buckets=(1, 4, 16, 64, 256, 1024))
        self.batch_seconds = Histogram("layerwise_batch_seconds", "Model time per merged batch", registry=r)
        self.tokens_total = Counter("layerwise_tokens", "Tokens encoded (special tokens included)", registry=r)
        self.tokens_per_second = Gauge("layerwise_tokens_per_second", "Tokens/s of the last model call", registry=r)

    def request(self, status: str, seconds: float) -> None:
        self.requests.labels(status=status).inc()
        self.latency.observe(seconds)

    def batch(self, requests: int, texts: int, cost: int, seconds: float) -> None:
        self.batches.inc()
        self.batch_requests.observe(requests)
        self.batch_texts.observe(texts)
        self.batch_seconds.observe(seconds)

    def tokens(self, n: int, seconds: float) -> None:
        self.tokens_total.inc(n)
        if seconds > 0:
            self.tokens_per_second.set(n / seconds)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
