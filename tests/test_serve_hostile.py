"""Hostile requests of realistic size get a quick, clear refusal, and the server keeps answering: a 20 KB layer
spec, a request whose answer would be hundreds of MB, a 100 KB prompt."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from layerwise.serve import Limits, create_app


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
    ("/v1/encode", {"words": [[""] * 19999], "level": "word", "layers": "all", "combine": "concat"}),
    ("/v1/encode", {"texts": ["word " * 3900] * 200, "level": "token", "layers": "all", "combine": "concat"}),
    ("/embed_all", {"inputs": ["word " * 3900] * 200, "layers": "all", "combine": "concat"}),
])
def test_an_answer_over_max_response_bytes_is_413_before_any_compute(client, route, body):
    t0 = time.perf_counter()
    r = client.post(route, json=body)
    assert r.status_code == 413 and "max_response_bytes" in r.text and "MB" in r.text, r.text
    assert time.perf_counter() - t0 < 2


def test_the_prompt_counts_toward_max_text_chars(client):
    r = client.post("/v1/encode", json={"texts": ["hi"], "prompt": "x" * 100_000})
    assert r.status_code == 422 and "with the prompt" in r.text and "max_text_chars" in r.text, r.text
    r = client.post("/v1/embeddings", json={"model": "bert", "input": "hi", "prompt": "x" * 100_000})
    assert r.status_code == 400 and "max_text_chars" in r.json()["error"]["message"], r.text
