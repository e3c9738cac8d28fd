"""``layerwise serve`` under real traffic (issue 39), over plain HTTP/1.1 against the service served by uvicorn in a
thread (as the command serves it; the command itself where a flag is the point):

* requests that differ only in pool, combine or precision, or in their layers, share one forward pass and each gets
  the answer it gets alone (``layerwise_batch_specs`` says the calls merged several specs); on ONNX Runtime, a server
  warmed at several depths runs mixed calls with each row leaving at its own depth (its one-layer graphs);
* a 200 KB request does not hold up a one-text request, a big request whose client gave up is dropped between
  batches, and one over ``max_request_tokens`` is refused before any compute;
* bodies a web page may send unasked (text/plain, forms, multipart) get 415 on every encoding route, in the route's
  protocol shape;
* CORS is off by default and approves only the ``--cors-origin`` origins; a bad origin stops ``layerwise serve``;
* every refusal is counted in ``layerwise_requests_total`` with its route and status;
* HEAD on the informational routes answers 200 with no body.

Three servers: ``server``, a small random BERT (hidden 128, 4 layers, 512 positions: slow enough on a CPU that a 200
KB request takes seconds) with the default limits, and ``guarded`` (the tiny BERT with an API key, a 20 kB body
limit and one CORS origin), and ``staged``, the small BERT on ONNX Runtime warmed at two depths. Time bounds are
generous: CI has 2 slow cores.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest

from tiny import CORPUS, free_port, serve_in_thread, wait_until, wordpiece

KEY = "k"
APP, EVIL = "https://app.example", "https://evil.example"
BODY_LIMIT = 20000
WORDS = sorted({w.strip(".,!?;") for line in CORPUS for w in line.lower().split() if w.isascii()} | {
    "transformer", "embedding", "batching", "latency", "throughput", "request", "server", "vector", "merged"})
SENTENCES = list(dict.fromkeys(CORPUS)) + ["a", "Paris", "EU rejects lamb", "the layer knows syntax"]


def _build_small_bert(directory: Path) -> Path:
    """A random BERT of hidden 128, 4 layers and 512 positions with the tiny WordPiece tokenizer (a CPU takes
    seconds over a 200 KB request)."""
    import torch
    from transformers import AutoModel, BertConfig, PreTrainedTokenizerFast

    tok, special = wordpiece()
    config = BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                        intermediate_size=512, max_position_embeddings=512, pad_token_id=tok.token_to_id("[PAD]"))
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **special).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def small_bert(tmp_path_factory) -> Path:
    return _build_small_bert(tmp_path_factory.mktemp("traffic") / "bert-128x4")


def _app(model: Path, limits=None, **options):
    """The service for the model directory ``model`` as ``layerwise serve --model MODEL --device cpu`` builds it
    (its own Extractor, loopback host names), to serve in a thread; ``options``: :func:`create_app`'s."""
    import layerwise as lw
    from layerwise.serve import create_app
    from layerwise.serve.security import default_allowed_hosts

    backend = options.pop("backend", "auto")
    return create_app(lw.Extractor(str(model), device="cpu", backend=backend), limits,
                      allowed_hosts=default_allowed_hosts("127.0.0.1", None), **options)


@pytest.fixture(scope="module")
def server(small_bert):
    with serve_in_thread(_app(small_bert, backend="torch")) as url:
        yield url


@pytest.fixture(scope="module")
def guarded(tiny_dirs):
    from layerwise.serve import Limits

    with serve_in_thread(_app(tiny_dirs["bert"], Limits(max_body_bytes=BODY_LIMIT), api_key=KEY,
                              cors_origins=[APP])) as url:
        yield url


# ---- helpers -------------------------------------------------------------------------------------------------------
def _connection(url: str, timeout: float = 120) -> http.client.HTTPConnection:
    parsed = urlparse(url)
    return http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout)


def call(url: str, method: str, path: str, body=None, headers: dict | None = None, timeout: float = 120,
         conn: http.client.HTTPConnection | None = None) -> tuple[int, dict[str, str], bytes]:
    """``(status, headers with lower-case names, raw body)``; ``body`` is JSON-ready (sent as application/json)
    or bytes (sent with the ``headers`` given)."""
    own = conn is None
    conn = conn or _connection(url, timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        sent = {"Content-Type": "application/json"} if data is not None and not isinstance(body, bytes) else {}
        conn.request(method, path, body=data, headers={**sent, **(headers or {})})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw
    finally:
        if own:
            conn.close()


def encode(url: str, payload: dict, conn=None, timeout: float = 120) -> tuple[int, dict]:
    status, _, raw = call(url, "POST", "/v1/encode", payload, conn=conn, timeout=timeout)
    return status, json.loads(raw)


def metrics(url: str, headers: dict | None = None) -> dict[str, float]:
    """``GET /metrics`` as ``{sample name with its labels: value}`` (Prometheus text format)."""
    status, _, raw = call(url, "GET", "/metrics", headers=headers)
    assert status == 200, raw[:300]
    out = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def answered(route: str, status: int) -> str:
    return f'layerwise_requests_total{{route="{route}",status="{status}"}}'


def assert_same(got, ref, dtype: str) -> None:
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    tol = 2e-3 if dtype == "float16" else 1e-5  # float16: a rounding step of values up to ~4 (rtol covers larger)
    assert np.allclose(got, ref, rtol=tol, atol=tol), float(np.abs(got - ref).max())


def burst(url: str, payloads: list[dict]) -> list[tuple[int, dict]]:
    """Every payload at once: one thread and one open connection each, released together by a barrier."""
    start = threading.Barrier(len(payloads))
    out: list = [None] * len(payloads)

    def client(i: int) -> None:
        conn = _connection(url)
        try:
            conn.connect()
            start.wait(timeout=60)
            out[i] = encode(url, payloads[i], conn=conn)
        except Exception as exc:  # reported below with the request
            out[i] = (None, repr(exc))
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(payloads))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    return out


def words_text(chars: int, rng: random.Random) -> str:
    """Real-ish English words (some in the tiny vocabulary, some split into pieces), ``chars`` characters."""
    parts, n = [], 0
    while n < chars:
        word = rng.choice(WORDS)
        parts.append(word)
        n += len(word) + 1
    return " ".join(parts)[:chars]


def big_payload(n_texts: int = 10, chars: int = 20000, seed: int = 0) -> bytes:
    rng = random.Random(seed)
    return json.dumps({"texts": [words_text(chars, rng) for _ in range(n_texts)]}).encode()


SMALL = {"texts": ["I love Paris in the springtime"]}


# ---- 1. merged forward passes ----------------------------------------------------------------------------------
SAME_LAYERS = [
    {"layers": [1, 2], "combine": "concat", "pool": "mean", "output_dtype": "float32"},
    {"layers": [1, 2], "combine": "mean", "pool": "cls", "output_dtype": "float16"},
    {"layers": [1, 2], "combine": "concat", "pool": "max", "output_dtype": "float16"},
    {"layers": [1, 2], "combine": "mean", "pool": "mean", "output_dtype": "float32"},
]
DEEP = [  # layer 2 at the deepest
    {"layers": 2, "pool": "mean", "output_dtype": "float32"},
    {"layers": [0, 2], "combine": "sum", "pool": "max", "output_dtype": "float32"},
    {"layers": 2, "pool": "cls", "output_dtype": "float16"},
]
SHALLOW = [  # layer 1 at the deepest
    {"layers": 1, "pool": "mean", "output_dtype": "float32"},
    {"layers": [0, 1], "combine": "concat", "pool": "cls", "output_dtype": "float16"},
]


def _payloads(specs: list[dict], n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"texts": rng.sample(SENTENCES, rng.randint(1, 3)), **specs[i % len(specs)]} for i in range(n)]


def _lone_then_burst(url: str, payloads: list[dict]) -> tuple[dict, dict, dict]:
    """Each payload alone (in turn), then all at once; checks every burst answer against the lone one. Returns the
    metrics before the lone requests, after them and after the burst."""
    m0 = metrics(url)
    lone = [encode(url, p) for p in payloads]
    m1 = metrics(url)
    got = burst(url, payloads)
    m2 = metrics(url)
    for p, (status, ref), (burst_status, body) in zip(payloads, lone, got):
        assert status == 200, ref
        assert burst_status == 200, (p, body)
        assert body["spec"] == ref["spec"] and body["shape"] == ref["shape"] == [len(p["texts"]), body["shape"][1]]
        assert_same(body["vectors"], ref["vectors"], p["output_dtype"])
    n = len(payloads)
    # alone, each request was a model call of its own, of one spec
    assert delta(m1, m0, "layerwise_batch_requests_sum") == delta(m1, m0, "layerwise_batch_requests_count") == n
    assert delta(m1, m0, "layerwise_batch_specs_sum") == n
    # the burst: every request was answered once, through the batcher
    assert delta(m2, m1, answered("/v1/encode", 200)) == n
    assert delta(m2, m1, "layerwise_batch_requests_sum") == n
    return m0, m1, m2


def test_requests_differing_in_pool_combine_or_precision_share_one_forward(server):
    payloads = _payloads(SAME_LAYERS, 48, seed=1)
    _, m1, m2 = _lone_then_burst(server, payloads)
    names = ("layerwise_batch_specs_count", 'layerwise_batch_specs_bucket{le="1.0"}', "layerwise_batch_specs_sum",
             "layerwise_layer_tokens_computed_total", "layerwise_layer_tokens_requested_total")
    calls, one_spec, specs, computed, requested = (delta(m2, m1, name) for name in names)
    assert 0 < calls < len(payloads), calls
    assert calls - one_spec >= 1 and specs > calls, f"no model call merged several specs ({calls} calls, {specs} specs)"
    assert computed == requested, (computed, requested)  # one depth: no request ran deeper than it asked


def test_requests_for_different_layers_share_a_forward_and_each_runs_only_its_own_layers(server):
    # a few one-word requests for layer 1 among many for layer 2 share the forward batches of one call; on PyTorch
    # each row leaves its batch at its own request's depth (layerwise.model.ragged), so the layers computed are the
    # layers requested (a runtime without early exit would run them through layer 2 where that is cheaper than a
    # batch of their own: tests/serve/test_serve_batcher.py)
    payloads = _payloads(DEEP, 48, seed=2)
    for j, word in enumerate(["a", "Paris", "EU", "lamb", "fox", "dog", "a", "call"]):
        payloads[6 * j] = {"texts": [word], **SHALLOW[j % 2]}
    m0, m1, m2 = _lone_then_burst(server, payloads)
    names = ("layerwise_layer_tokens_computed_total", "layerwise_layer_tokens_requested_total",
             "layerwise_batch_specs_sum", "layerwise_batch_specs_count", "layerwise_batches_ragged_total")
    alone = [delta(m1, m0, name) for name in names]
    merged = [delta(m2, m1, name) for name in names]
    assert alone[0] == alone[1], alone
    # layer-1 and layer-2 requests shared calls (more specs than calls, calls of two depths), and none ran deeper than
    # it asked (the rows that ran each layer are counted in tests/model/test_ragged.py)
    assert alone[4] == 0 and merged[4] >= 1, merged
    assert merged[2] > merged[3] and merged[0] == merged[1], merged
    # what each way's calls took against their prediction is exported (1 for a way not run yet)
    corrections = {k: v for k, v in m2.items() if k.startswith("layerwise_cost_correction")}
    assert set(corrections) == {f'layerwise_cost_correction{{site="block",way="{way}"}}'
                                for way in ("cut", "ragged:torch")}  # a ragged way names the runtime running it
    assert all(v > 0 for v in corrections.values()), corrections
    # ... and every call is counted under what ran it (the X-Layerwise-Runtime header)
    assert delta(m2, m1, 'layerwise_runtime_calls_total{runtime="torch; ragged"}') >= 1, m2


@pytest.fixture(scope="module")
def staged(small_bert):
    with serve_in_thread(_app(small_bert, backend="onnx", warm=[1, 2])) as url:
        # the depths' graphs and the one-layer stages prepared
        with contextlib.suppress(AssertionError):  # then the assertion below says what it still waits for
            wait_until(lambda: call(url, "GET", "/ready")[0] == 200, 180, "GET /ready answering 200", interval=0.2)
        status, _, raw = call(url, "GET", "/ready")
        assert status == 200, raw[:300]
        yield url


def test_a_compiled_runtime_warmed_at_several_depths_lets_rows_leave_at_their_own_depth(staged):
    """``--backend onnx --warm 1 --warm 2``: /ready waits for ONNX Runtime's one-layer graphs, and then mixed calls
    run as one batch whose rows leave at their own depth (``layerwise_batches_ragged_total``; the batcher runs the
    way it predicts cheaper, and each other way, cut or whole or ragged, within its first six mixed calls), each
    answer equal to a lone request's. Without the stages no call of a compiled runtime is ragged."""
    payloads = _payloads(DEEP, 24, seed=3)
    for j in range(0, 24, 3):
        payloads[j] = {"texts": [SENTENCES[j % len(SENTENCES)]], **SHALLOW[j % 2]}
    ragged = 0.0
    for _ in range(10):  # bursts until a mixed call ran ragged (the first calls may run cut or whole)
        _, m1, m2 = _lone_then_burst(staged, payloads)
        ragged += delta(m2, m1, "layerwise_batches_ragged_total")
        if ragged:
            break
    assert ragged >= 1, "no mixed call ran its rows to their own depths"


# ---- 2. big requests --------------------------------------------------------------------------------------------
def _wait_for_compute(url: str, before: float, limit: float = 60) -> None:
    """Return once the model has encoded tokens past ``before`` (the big request is running)."""
    wait_until(lambda: metrics(url).get("layerwise_tokens_total", 0.0) > before, limit,
               "the big request reaching the model")


def test_a_200kb_request_does_not_hold_up_a_one_text_request(server):
    body = big_payload()
    assert 190_000 < len(body) < 210_000
    m0 = metrics(server)
    big: dict = {}

    def send_big() -> None:
        try:
            status, _, raw = call(server, "POST", "/v1/encode", body, {"Content-Type": "application/json"},
                                  timeout=600)
            big.update(status=status, body=json.loads(raw))
        finally:
            big["done"] = time.monotonic()

    thread = threading.Thread(target=send_big)
    thread.start()
    _wait_for_compute(server, m0.get("layerwise_tokens_total", 0.0))  # the small request comes while it computes
    t0 = time.monotonic()
    status, small = encode(server, SMALL)
    took, small_done = time.monotonic() - t0, time.monotonic()
    thread.join(timeout=600)
    assert status == 200 and len(small["vectors"]) == 1, small
    assert took < 2.0, f"a one-text request took {took:.2f} s beside a 200 KB one"
    assert big.get("status") == 200, big
    assert big["body"]["shape"][0] == 10 and len(big["body"]["vectors"]) == 10
    assert big["done"] > small_done, "the big request ended before the small one: it was too small to hold anything up"


def test_a_big_request_whose_client_gave_up_is_dropped_between_batches(server):
    # the client waits 3 s, or less on a machine fast enough to encode the 10 texts in less than 6 s: one of them,
    # alone, takes about a tenth of the whole
    t0 = time.monotonic()
    assert call(server, "POST", "/v1/encode", big_payload(n_texts=1, seed=5), {"Content-Type": "application/json"}
                )[0] == 200
    wait = min(3.0, 5 * (time.monotonic() - t0))
    body = big_payload(seed=3)
    m0 = metrics(server)
    conn = _connection(server, timeout=wait)
    try:
        conn.request("POST", "/v1/encode", body=body, headers={"Content-Type": "application/json"})
        with pytest.raises(TimeoutError):  # the 200 KB request takes longer than the client waits
            conn.getresponse()
    finally:
        conn.close()  # the client goes away
    t0 = time.monotonic()
    status, small = encode(server, SMALL)
    took = time.monotonic() - t0
    assert status == 200 and len(small["vectors"]) == 1, small
    assert took < 2.0, f"a one-text request took {took:.2f} s after a dropped 200 KB one"
    # the server noticed (a 499 for the request nobody reads) and stopped computing it
    deadline = time.monotonic() + 20
    while delta(metrics(server), m0, answered("/v1/encode", 499)) < 1:
        assert time.monotonic() < deadline, "the dropped request was never counted as 499"
        time.sleep(0.1)
    # the forward batch running when the client went away ends; then nothing is open: no model work is left
    deadline = time.monotonic() + 20
    while metrics(server)["layerwise_open_work"] > 0:
        assert time.monotonic() < deadline, "the model still has work open after the dropped request"
        time.sleep(0.1)
    m1 = metrics(server)
    m2 = metrics(server)
    assert m1["layerwise_open_work"] == 0
    assert m2["layerwise_tokens_total"] == m1["layerwise_tokens_total"], "the model still computes the dropped request"
    counted = {name: delta(m2, m0, name) for name in (answered("/v1/encode", 499), answered("/v1/encode", 200),
                                                      "layerwise_batches_total")}
    # one call finished: the small request's (the big one's never did)
    assert list(counted.values()) == [1, 1, 1], counted
    assert call(server, "GET", "/health")[0] == 200


def test_a_request_over_max_request_tokens_is_refused_before_any_compute(server):
    body = big_payload(n_texts=40, seed=4)  # 800 kB: under max_body_bytes (4 MiB), about 370k tokens (limit 131072)
    m0 = metrics(server)
    t0 = time.monotonic()
    status, headers, raw = call(server, "POST", "/v1/encode", body, {"Content-Type": "application/json"})
    took = time.monotonic() - t0
    m1 = metrics(server)
    assert status == 413, raw[:300]
    detail = json.loads(raw)["detail"]
    assert "max_request_tokens" in detail and "131,072" in detail, detail
    assert took < 2.0, took
    assert m1["layerwise_tokens_total"] == m0["layerwise_tokens_total"]
    assert delta(m1, m0, "layerwise_batches_total") == 0


# ---- 3. only application/json --------------------------------------------------------------------------------
NOT_JSON = ["text/plain", "text/plain; charset=utf-8", "application/x-www-form-urlencoded",
            "multipart/form-data; boundary=x"]
ROUTES = [  # path, protocol, a valid body
    ("/v1/encode", "layerwise", {"texts": ["I love Paris"]}),
    ("/v1/embeddings", "openai", {"input": "I love Paris", "model": None}),
    ("/embed", "tei", {"inputs": "I love Paris"}),
    ("/", "tei", {"inputs": "I love Paris"}),
    ("/embed_all", "tei", {"inputs": "I love Paris"}),
    ("/tokenize", "tei", {"inputs": "I love Paris"}),
    ("/explorer/api/sentence", "layerwise", {"text": "I love Paris"}),
]


def _error_message(protocol: str, body: dict) -> str:
    """The message of an error body, after checking the body has the protocol's shape."""
    if protocol == "openai":
        assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"]), body
        return body["error"]["message"]
    if protocol == "tei":
        assert set(body) == {"error", "error_type"} and isinstance(body["error_type"], str), body
        return body["error"]
    assert set(body) == {"detail"}, body
    return body["detail"]


@pytest.mark.parametrize("path, protocol, payload", ROUTES, ids=[r[0] for r in ROUTES])
def test_bodies_a_web_page_may_send_unasked_get_415(server, path, protocol, payload):
    if "model" in payload:
        payload = {**payload, "model": json.loads(call(server, "GET", "/v1/models")[2])["data"][0]["id"]}
    data = json.dumps(payload).encode()
    for content_type in NOT_JSON:
        status, _, raw = call(server, "POST", path, data, {"Content-Type": content_type})
        assert status == 415, (content_type, raw[:300])
        message = _error_message(protocol, json.loads(raw))
        assert "application/json" in message and content_type.split(";")[0] in message, message
    for content_type in ("application/json", "application/json; charset=utf-8"):
        status, _, raw = call(server, "POST", path, data, {"Content-Type": content_type})
        assert status == 200, (content_type, raw[:300])


# ---- 4. CORS ---------------------------------------------------------------------------------------------------
def _preflight(url: str, origin: str, path: str = "/v1/encode") -> tuple[int, dict[str, str]]:
    status, headers, _ = call(url, "OPTIONS", path, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"})
    return status, headers


def test_cors_is_off_by_default(server):
    status, headers, _ = call(server, "POST", "/v1/encode", SMALL, {"Origin": EVIL})
    assert status == 200 and "access-control-allow-origin" not in headers, headers
    for origin in (EVIL, APP):
        status, headers = _preflight(server, origin)
        assert not 200 <= status < 300, (status, headers)
        assert not any(h.startswith("access-control-") for h in headers), headers


def test_cors_approves_only_the_given_origin(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    status, headers = _preflight(guarded, APP)  # a browser's preflight carries no key
    assert status == 200, headers
    assert headers.get("access-control-allow-origin") == APP, headers
    assert "POST" in headers.get("access-control-allow-methods", ""), headers
    assert "content-type" in headers.get("access-control-allow-headers", "").lower(), headers
    status, headers = _preflight(guarded, EVIL)
    assert status != 200 and "access-control-allow-origin" not in headers, (status, headers)
    status, headers, _ = call(guarded, "POST", "/v1/encode", SMALL, {**auth, "Origin": APP})
    assert status == 200 and headers.get("access-control-allow-origin") == APP, headers
    exposed = headers.get("access-control-expose-headers", "").lower()
    assert "x-layerwise-spec" in exposed and "x-layerwise-runtime" in exposed, headers
    status, headers, _ = call(guarded, "POST", "/v1/encode", SMALL, {**auth, "Origin": EVIL})
    assert status == 200 and "access-control-allow-origin" not in headers, headers


def test_a_bad_cors_origin_stops_serve_naming_the_flag(tiny_dirs):
    cmd = [sys.executable, "-m", "layerwise.cli.main", "serve", "--model", str(tiny_dirs["bert"]), "--device", "cpu",
           "--port", str(free_port()), "--cors-origin", "not-an-origin"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    output = res.stdout + res.stderr
    assert res.returncode == 2, output
    assert "--cors-origin" in output and "not-an-origin" in output and "error:" in output, output


@pytest.mark.parametrize("origin, ok", [("https://app.example", True), ("http://localhost:3000", True), ("*", True),
                                        ("not-an-origin", False), ("https://app.example/path", False),
                                        ("ftp://app.example", False), ("https://", False),
                                        ("https://app.example?x=1", False)])
def test_cors_origin_values(origin, ok):
    from layerwise.cli.serve import check_origins
    from layerwise.errors import LayerwiseError

    if ok:
        assert check_origins([origin]) == [origin]
    else:
        with pytest.raises(LayerwiseError, match="--cors-origin"):
            check_origins([origin])


# ---- 5. every refusal counted ----------------------------------------------------------------------------------
def test_every_refusal_is_counted_with_its_route_and_status(guarded):
    auth = {"Authorization": f"Bearer {KEY}"}
    json_type = {"Content-Type": "application/json"}
    good = json.dumps(SMALL).encode()
    sends = [  # (times, expected status, route label, method, path, body, headers)
        (2, 401, "/v1/encode", "POST", "/v1/encode", good, json_type),
        (1, 401, "/v1/embeddings", "POST", "/v1/embeddings", b'{"input": "a", "model": "bert"}', json_type),
        (2, 400, "/v1/encode", "POST", "/v1/encode", good, {**auth, **json_type, "Host": "evil.example"}),
        (3, 413, "/v1/encode", "POST", "/v1/encode", json.dumps({"texts": ["paris " * 1000] * 4}).encode(),
         {**auth, **json_type}),
        (4, 415, "/v1/encode", "POST", "/v1/encode", good, {**auth, "Content-Type": "text/plain"}),
        (2, 422, "/v1/encode", "POST", "/v1/encode", json.dumps({**SMALL, "colour": "red"}).encode(),
         {**auth, **json_type}),
        (2, 404, "unmatched", "GET", "/no/such/route", None, auth),
        (3, 200, "/v1/encode", "POST", "/v1/encode", good, {**auth, **json_type}),
    ]
    assert len(sends[3][5]) > BODY_LIMIT
    before = metrics(guarded, auth)
    for times, status, _, method, path, body, headers in sends:
        for _ in range(times):
            got, _, raw = call(guarded, method, path, body, headers)
            assert got == status, (method, path, headers, raw[:300])
    expected: dict[str, int] = {}
    for times, status, route, *_ in sends:
        expected[answered(route, status)] = expected.get(answered(route, status), 0) + times

    def counted() -> dict[str, float]:
        after = metrics(guarded, auth)
        return {name: delta(after, before, name) for name in expected}

    # the count is taken as each answer ends: give the server a moment, then the assertion says what differs
    with contextlib.suppress(AssertionError):
        wait_until(lambda: counted() == expected, 10, "every answer counted", interval=0.1)
    assert counted() == expected


# ---- 6. HEAD ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["/health", "/ready", "/v1/model", "/info", "/v1/models", "/metrics"])
def test_head_answers_200_without_a_body(server, path):
    # the depths to warm are prepared (in a moment)
    wait_until(lambda: call(server, "GET", "/ready")[0] == 200, 60, "GET /ready answering 200", interval=0.2)
    parsed = urlparse(server)
    with socket.create_connection((parsed.hostname, parsed.port), timeout=30) as sock:
        sock.sendall(f"HEAD {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    head, sep, rest = got.partition(b"\r\n\r\n")
    assert sep and head.startswith(b"HTTP/1.1 200"), got[:300]
    assert rest == b"", rest[:300]
    status, _, raw = call(server, "GET", path)
    assert status == 200 and raw  # the same route answers GET with a body
