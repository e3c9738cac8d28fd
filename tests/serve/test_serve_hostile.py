"""Hostile requests of realistic size get a quick, clear refusal, and the server keeps answering: a 20 KB layer
spec, a request whose answer would be hundreds of MB, a 100 KB prompt."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from layerwise.serve import Limits, create_app

from tiny import serving


@pytest.fixture(scope="module")
def client(tiny_extractors):
    with TestClient(create_app(tiny_extractors["bert"], Limits(max_response_bytes=8 << 20))) as c:
        yield c


def test_a_20kb_layer_spec_is_answered_at_once(client):
    for size in (5_000, 200_000):  # "all,all,...": 20 KB, then 800 KB
        t0 = time.perf_counter()
        r = client.post("/v1/encode", json={"texts": ["hi"], "layers": ",".join(["all"] * size)})
        assert time.perf_counter() - t0 < 2 and r.status_code == 422, r.text
    assert client.get("/health").status_code == 200


@pytest.mark.parametrize("route,body", [
    ("/v1/encode", {"words": [["a"] * 9999], "level": "word", "layers": "all", "combine": "concat"}),
    ("/v1/encode", {"texts": ["word " * 3900] * 200, "level": "token", "layers": "all", "combine": "concat"}),
    ("/embed_all", {"inputs": ["word " * 3900] * 200, "layers": "all", "combine": "concat"}),
])
def test_an_answer_over_max_response_bytes_is_413_before_any_compute(client, route, body):
    t0 = time.perf_counter()
    r = client.post(route, json=body)
    assert r.status_code == 413 and "max_response_bytes" in r.text and "MB" in r.text, r.text
    assert time.perf_counter() - t0 < 2


def test_a_large_body_is_parsed_off_the_loop_with_the_same_errors(client):
    from layerwise.serve.body import INLINE_BYTES

    texts = ["a fairly long sentence about nothing in particular " * 6] * 300  # about 95 KB: over INLINE_BYTES
    body = {"model": "bert", "input": texts}
    assert len(str(body)) > INLINE_BYTES
    r = client.post("/v1/embeddings", json=body)
    assert r.status_code == 400 and "300 texts in one request" in r.json()["error"]["message"], r.text
    r = client.post("/v1/embeddings", json={**body, "input": texts[:200], "encoding_format": "bits"})
    assert r.status_code == 400 and "encoding_format" in r.json()["error"]["message"], r.text
    r = client.post("/v1/encode", content=b"[" * (INLINE_BYTES + 10), headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"][0]["type"] == "json_invalid", r.text
    r = client.post("/v1/embeddings", json={**body, "input": texts[:100]})
    assert r.status_code == 200 and len(r.json()["data"]) == 100


def test_the_prompt_counts_toward_max_text_chars(client):
    r = client.post("/v1/encode", json={"texts": ["hi"], "prompt": "x" * 100_000})
    assert r.status_code == 422 and "with the prompt" in r.text and "max_text_chars" in r.text, r.text
    r = client.post("/v1/embeddings", json={"model": "bert", "input": "hi", "prompt": "x" * 100_000})
    assert r.status_code == 400 and "max_text_chars" in r.json()["error"]["message"], r.text


def test_api_key_guards_every_route_but_health_in_each_protocols_shape(tiny_extractors):
    app = create_app(tiny_extractors["bert"], api_key="s3cret", allowed_hosts=["testserver"])
    with TestClient(app) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/embeddings", json={"model": "bert", "input": "hi"})
        assert r.status_code == 401 and "Authorization: Bearer" in r.json()["error"]["message"]
        r = c.post("/embed", json={"inputs": "hi"}, headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and "error_type" in r.json()
        assert c.get("/v1/model").status_code == 401
        ok = c.post("/embed", json={"inputs": "hi"}, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and len(ok.json()) == 1
        rebound = c.get("/health", headers={"Host": "evil.example"})  # DNS rebinding: a name we do not serve
        assert rebound.status_code == 400


def test_serve_warns_when_bound_beyond_loopback_without_a_key(tiny_dirs, tmp_path):
    from layerwise.serve.security import default_allowed_hosts, is_loopback

    log = tmp_path / "serve.log"
    with serving(tiny_dirs["bert"], log, "--host", "0.0.0.0"):
        pass
    assert "warning: serving on 0.0.0.0 without an API key" in " ".join(log.read_text().split()), log.read_text()

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.4")
    assert "localhost" in default_allowed_hosts("127.0.0.1", None) and default_allowed_hosts("0.0.0.0", None) == ["*"]


def test_a_full_queue_is_429_with_retry_after_and_a_gone_clients_work_is_never_computed():
    import asyncio
    import threading

    from layerwise.serve.batcher import Batcher, QueueFull
    from layerwise.serve.cost import CostModel

    release = threading.Event()
    seen: list[list] = []

    def run(jobs, segments, ragged):
        items = [item for job in jobs for item in job.items]
        seen.append(items)
        release.wait(10)
        yield [(j, i, item) for j, job in enumerate(jobs) for i, item in enumerate(job.items)]

    batcher = Batcher(run, CostModel.for_device("cpu", 1024), max_queue_tokens=100)

    async def scenario():
        first = asyncio.ensure_future(batcher.submit("g", 1, ["running"], "s", 10))
        deadline = time.monotonic() + 30
        while not seen:  # the worker has taken the first job and blocks in run
            assert time.monotonic() < deadline, "the worker never ran the first job"
            await asyncio.sleep(0.01)
        gone = asyncio.ensure_future(batcher.submit("g", 1, ["abandoned"], "s", 60))
        waiting = asyncio.ensure_future(batcher.submit("g", 1, ["waits"], "s", 30))
        await asyncio.sleep(0.05)
        with pytest.raises(QueueFull) as full:  # 90 queued + 20 > 100
            await batcher.submit("g", 1, ["refused"], "s", 20)
        assert full.value.retry_after >= 1
        gone.cancel()  # the client went away while it waited
        await asyncio.sleep(0.05)
        release.set()
        return await first, await waiting

    try:
        assert asyncio.run(scenario()) == (["running"], ["waits"])
    finally:
        batcher.close()
    assert ["abandoned"] not in seen and all("abandoned" not in batch for batch in seen), seen
    assert batcher.queued_tokens == 0


def test_the_service_answers_429_and_drops_a_disconnected_request(tiny_extractors):
    import asyncio
    import threading

    from layerwise.errors import ServiceError
    from layerwise.serve.service import Service

    service = Service(tiny_extractors["bert"], Limits(max_queue_tokens=10), threading.Lock())

    class Gone:  # a Starlette request whose client has gone: its next ASGI message is the disconnect
        async def receive(self):
            return {"type": "http.disconnect"}

    async def scenario():
        spec = service.spec({})
        with service.lock:  # the model is busy: the first request is taken and blocks, the next ones wait
            first = asyncio.ensure_future(service.encode(spec, ["hello there"], "text"))
            await asyncio.sleep(0.3)
            second = asyncio.ensure_future(service.encode(spec, ["hello there"], "text"))  # 5 tokens queued
            await asyncio.sleep(0.1)
            with pytest.raises(ServiceError) as busy:
                await service.encode(spec, ["a much longer text that costs more tokens"], "text")
            assert busy.value.status == 429 and int(busy.value.headers["Retry-After"]) >= 1
            with pytest.raises(ServiceError) as gone:
                await service.encode(spec, ["x"], "text", Gone())
            assert gone.value.status == 499
        return await first, await second

    try:
        (first, runtime), (second, _) = asyncio.run(asyncio.wait_for(scenario(), 60))
        assert len(first) == len(second) == 1 and runtime in ("torch", "onnx", "openvino")
    finally:
        service.batcher.close()
