"""The HTTP service, called over real HTTP: served by uvicorn in a thread on the tiny BERT (one per module); the
real `layerwise serve` process where it is the point (--warm and /ready, a bad --warm refused)."""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import random
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import numpy as np
import pytest

import layerwise as lw
from conftest import SENTENCES as ALL_SENTENCES
from layerwise.serve import Limits, ServiceError, create_app

from tiny import serve_in_thread, wait_until

LIMITS = {"max_texts": 8, "max_text_chars": 400, "max_body_bytes": 4000}

SENTENCES = [t for t in ALL_SENTENCES if t.strip()]  # a blank text is refused (422): see test_blank_inputs


def _request(url, method, path, body=None, conn=None):
    """(status, parsed JSON or text); ``body`` is a dict (sent as JSON) or raw bytes."""
    c = conn or http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=120)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    c.request(method, path, body=data, headers={"Content-Type": "application/json"} if data else {})
    resp = c.getresponse()
    raw = resp.read()
    c.close() if conn is None else None
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw.decode("utf-8", "replace")


def _arr(obj, dtype=np.float32) -> np.ndarray:
    """Decode one packed array independently of the client: a base64 dict or nested JSON lists."""
    if isinstance(obj, dict):
        dt = np.dtype(np.float16 if obj["dtype"] == "float16" else np.float32).newbyteorder("<")
        return np.frombuffer(base64.b64decode(obj["base64"]), dtype=dt).reshape(obj["shape"]).astype(np.float32)
    return np.asarray(obj, dtype=dtype)


def _close(got, ref, fp16=False):
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    assert got.shape == ref.shape
    tol = np.abs(ref) * 2.0**-11 + 1e-5 if fp16 else 1e-5  # fp16: half an ulp (+ fp32 noise)
    assert np.all(np.abs(got - ref) <= tol), float(np.abs(got - ref).max())


@pytest.fixture(scope="module")
def server(tiny_dirs):
    """The service on the tiny BERT with small LIMITS, in a thread of this process (its own Extractor, as a served
    process has), as ``layerwise serve --model DIR --max-texts 8 ...`` builds it."""
    from layerwise.serve.security import default_allowed_hosts

    app = create_app(lw.Extractor(str(tiny_dirs["bert"]), device="cpu"), Limits(**LIMITS),
                     allowed_hosts=default_allowed_hosts("127.0.0.1", None))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def ex(tiny_extractors):
    return tiny_extractors["bert"]


def _assert_still_serving(url, ex):
    status, body = _request(url, "POST", "/v1/encode", {"texts": ["EU rejects German call", "a"], "layers": "-2:"})
    assert status == 200, body
    _close(_arr(body["vectors"]), ex.encode(["EU rejects German call", "a"], layers="-2:"))


SENTENCE_OPTIONS = [
    {"layers": -1, "pool": "mean"},
    {"layers": "-2:", "combine": "concat", "pool": "max"},
    {"layers": "all", "combine": "mean", "pool": "mean_max"},
    {"layers": [0, 2], "combine": "weighted", "weights": [0.3, 0.7], "pool": "last"},
    {"layers": 1, "pool": "pooler"},
    {"layers": "last", "pool": "cls", "site": "attention"},
    {"layers": [1, 2], "combine": "sum", "pool": "mean", "site": "intermediate", "skip_special_tokens": True},
]


@pytest.mark.parametrize("encoding", ["json", "base64"])
@pytest.mark.parametrize("opts", SENTENCE_OPTIONS, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_sentence_level_equals_extractor(server, ex, opts, encoding):
    status, body = _request(server, "POST", "/v1/encode", {"texts": SENTENCES, **opts, "encoding": encoding})
    assert status == 200, body
    ref = ex.encode(SENTENCES, **opts)
    assert body["shape"] == list(ref.shape) and body["level"] == "sentence"
    assert body["layers"] == list(lw.resolve_layers(opts["layers"], ex.num_layers))
    assert body["spec"] == lw.EncodeSpec(**opts).resolve(ex).to_dict()  # the server's per-spec cache answers right
    _close(_arr(body["vectors"]), ref)


def _raw(url, body: dict) -> tuple[int, str, bytes]:
    conn = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=120)
    conn.request("POST", "/v1/encode", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, resp.getheader("content-type"), resp.read()
    conn.close()
    return out


@pytest.mark.parametrize("level", ["sentence", "token", "word"])
@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_response_is_compact_utf8_json_as_before(server, ex, level, encoding):
    # the bytes FastAPI's default response gave: json.dumps compact, UTF-8 (not ASCII-escaped), floats as repr
    texts = ["naïve cafés", "EU rejects German call"]
    status, ctype, raw = _raw(server, {"texts": texts, "level": level, "layers": "-2:", "encoding": encoding})
    assert status == 200 and ctype == "application/json"
    body = json.loads(raw)
    assert raw == json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    assert list(body)[:4] == ["model", "layers", "level", "spec"]
    vectors = body["vectors"] if level != "sentence" else [body["vectors"]]
    refs = ex.encode(texts, layers="-2:", pool=None) if level == "token" else (
        ex.encode_words([t.split() for t in texts], layers="-2:") if level == "word" else [ex.encode(texts, "-2:")])
    for vec, ref in zip(vectors, refs):
        _close(_arr(vec).reshape(ref.shape), ref)
    if encoding == "json":  # each float is the float32 result, exactly (float32 -> float64 -> repr round trip)
        got = np.asarray(vectors[0], dtype=np.float64)
        assert np.array_equal(got, got.astype(np.float32).astype(np.float64))


def test_options_alternating_between_requests_keep_their_own_spec(server, ex):
    # the per-spec part of the answers is cached: alternate two option sets and check each answer's spec
    a, b = {"layers": -1, "pool": "mean"}, {"layers": [0, 2], "combine": "mean", "pool": "max"}
    for opts in (a, b, a, b):
        status, body = _request(server, "POST", "/v1/encode", {"texts": ["a text"], **opts})
        assert status == 200, body
        assert body["spec"] == lw.EncodeSpec(**opts).resolve(ex).to_dict()
        assert body["layers"] == list(lw.resolve_layers(opts["layers"], ex.num_layers))


def test_keep_freed_memory_on_glibc():
    import platform

    from layerwise.serve import keep_freed_memory

    expected = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert keep_freed_memory() is expected
    assert keep_freed_memory() is expected  # idempotent


@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_token_level_with_tokens_and_offsets(server, ex, encoding):
    status, body = _request(
        server, "POST", "/v1/encode", {"texts": SENTENCES, "level": "token", "layers": "-2:", "encoding": encoding}
    )
    assert status == 200, body
    refs = ex.encode(SENTENCES, layers="-2:", pool=None)
    assert body["shapes"] == [list(r.shape) for r in refs]
    for text, vec, ref, tokens, offsets in zip(SENTENCES, body["vectors"], refs, body["tokens"], body["offsets"]):
        _close(_arr(vec).reshape(ref.shape), ref)
        enc = ex.tokenizer(text, return_offsets_mapping=True)  # plain Hugging Face tokenizer as the reference
        assert tokens == ex.tokenizer.convert_ids_to_tokens(enc["input_ids"])
        assert offsets == [list(o) for o in enc["offset_mapping"]]


WORDS = [["EU", "rejects", "German", "call"], ["naïve", "cafés"], ["Peter"], ["The", "quick", "brown", "fox", "!"]]


@pytest.mark.parametrize("subword", ["first", "mean", "first_last"])
@pytest.mark.parametrize("source", ["texts", "words"])
def test_word_level_equals_encode_words(server, ex, subword, source):
    words = [t.split() for t in SENTENCES] if source == "texts" else WORDS
    payload = {"texts": SENTENCES} if source == "texts" else {"words": WORDS}
    status, body = _request(
        server,
        "POST",
        "/v1/encode",
        {**payload, "level": "word", "layers": [0, 2], "subword": subword, "encoding": "base64"},
    )
    assert status == 200, body
    refs = ex.encode_words(words, layers=[0, 2], subword=subword)
    assert body["words"] == words and body["shapes"] == [list(r.shape) for r in refs]
    for vec, ref in zip(body["vectors"], refs):
        _close(_arr(vec), ref)


@pytest.mark.parametrize("encoding", ["json", "base64"])
def test_float16_within_rounding(server, ex, encoding):
    opts = {"layers": "-2:", "combine": "concat", "pool": "mean"}
    status, body = _request(
        server, "POST", "/v1/encode", {"texts": SENTENCES, **opts, "output_dtype": "float16", "encoding": encoding}
    )
    assert status == 200, body
    if encoding == "base64":
        assert body["vectors"]["dtype"] == "float16"
        assert len(base64.b64decode(body["vectors"]["base64"])) == 2 * np.prod(body["shape"])
    got, ref = _arr(body["vectors"]), ex.encode(SENTENCES, **opts)
    _close(got, ref, fp16=True)
    assert np.all(got == got.astype(np.float16).astype(np.float32))  # really rounded to fp16
    body = {"texts": SENTENCES[:2], "level": "token", "output_dtype": "float16", "encoding": encoding}
    status, body = _request(server, "POST", "/v1/encode", body)
    assert status == 200, body
    for vec, r in zip(body["vectors"], ex.encode(SENTENCES[:2], pool=None)):
        _close(_arr(vec).reshape(r.shape), r, fp16=True)


def test_client_model_health_and_docs(server, ex):
    client = lw.Client(server)
    assert client.health()
    X = client.encode(SENTENCES, layers="-2:", combine="concat", pool="max")
    assert isinstance(X, np.ndarray) and X.dtype == np.float32
    _close(X, ex.encode(SENTENCES, layers="-2:", combine="concat", pool="max"))
    for got, ref in zip(client.encode(SENTENCES[:3], layers=0, level="token"), ex.encode(SENTENCES[:3], 0, pool=None)):
        _close(got, ref)
    with pytest.raises(ServiceError) as err:
        client.encode(["a"], layers=9)
    assert err.value.status == 422 and "0..2" in err.value.detail
    info = client.model()
    assert (info["family"], info["num_layers"], info["hidden_size"]) == ("bert", 2, 32)
    assert info["sites"] == list(lw.SITES) and info["limits"]["max_texts"] == LIMITS["max_texts"]
    assert info["limits"]["max_body_bytes"] == LIMITS["max_body_bytes"]
    status, docs = _request(server, "GET", "/docs")
    assert status == 200 and "swagger" in docs.lower()
    status, spec = _request(server, "GET", "/openapi.json")
    assert status == 200 and {"/v1/encode", "/v1/model", "/health"} <= set(spec["paths"])


COMBOS = [
    {"layers": -1, "pool": "mean"},
    {"layers": "-2:", "combine": "concat", "pool": "max", "encoding": "base64"},
    {"layers": [0, 2], "combine": "mean", "pool": "cls"},
    {"layers": 1, "level": "token", "encoding": "base64"},
]


def test_concurrent_clients_batched_and_correct(server, ex):
    words = "the a of to and in model layer token paris EU rejects german call boycott british lamb quick fox".split()
    rng = random.Random(0)
    pool = SENTENCES + [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(34)]
    rngs = [random.Random(c) for c in range(64)]  # per client: 20 (combo index, texts)
    plan = [[((c + i) % len(COMBOS), r.sample(pool, r.randint(1, 3))) for i in range(20)] for c, r in enumerate(rngs)]
    refs = {}  # computed sequentially, one text at a time, before any client starts
    for k, t in sorted({(k, t) for reqs in plan for k, texts in reqs for t in texts}):
        o = COMBOS[k]
        refs[k, t] = ex.encode(
            [t],
            layers=o["layers"],
            combine=o.get("combine", "concat"),
            pool=None if o.get("level") == "token" else o["pool"],
        )[0]
    before = _request(server, "GET", "/metrics")[1]
    start = threading.Barrier(64)

    def client(reqs):
        conn = http.client.HTTPConnection("127.0.0.1", urlparse(server).port, timeout=120)
        start.wait()
        bad = []
        for k, texts in reqs:
            status, body = _request(server, "POST", "/v1/encode", {"texts": texts, **COMBOS[k]}, conn=conn)
            try:
                assert status == 200, body
                vecs = body["vectors"] if "shapes" in body else list(_arr(body["vectors"]))
                assert len(vecs) == len(texts)
                for t, v in zip(texts, vecs):
                    _close(_arr(v).reshape(refs[k, t].shape), refs[k, t])
            except AssertionError as exc:
                bad.append((k, texts, str(exc)[:200]))
        conn.close()
        return bad

    with ThreadPoolExecutor(64) as pool_:
        bad = [b for out in pool_.map(client, plan) for b in out]
    assert bad == [], bad[:5]
    after = _request(server, "GET", "/metrics")[1]
    n, ok = 64 * 20, 'layerwise_requests_total{route="/v1/encode",status="200"}'
    names = (ok, "layerwise_batches_total", "layerwise_batch_requests_sum", "layerwise_batch_requests_count")

    def value(text, m):
        return sum(float(v) for v in re.findall(rf"^{re.escape(m)} (\S+)$", text, flags=re.MULTILINE))

    delta = {m: value(after, m) - value(before, m) for m in names}
    assert delta[ok] == delta["layerwise_batch_requests_sum"] == n
    assert 0 < delta["layerwise_batches_total"] < n
    assert delta["layerwise_batch_requests_sum"] / delta["layerwise_batch_requests_count"] > 1


def _bad(**kw):
    return {"texts": ["a text"], **kw}


BAD = [  # (id, body, status, substrings of the detail)
    ("texts", {"texts": ["x"] * 9}, 422, ["9 texts", "limit is 8"]),
    ("chars", {"texts": ["ok", "y" * 401]}, 422, ["401 characters", "limit is 400"]),
    ("layer", _bad(layers=3), 422, ["0..2", "-3..-1"]),
    ("slice", _bad(layers="5:"), 422, ["0..2"]),
    ("pool", _bad(pool="median"), 422, ["median", *[p for p in lw.POOL_MODES if p != "attention"]]),
    ("site", _bad(site="mlp", layers=1), 422, ["mlp", *lw.SITES]),
    ("combine", _bad(combine="avg", layers="-2:"), 422, ["avg", *lw.COMBINE_MODES]),
    ("subword", _bad(level="word", subword="middle"), 422, ["middle", *lw.WORD_POOL_MODES]),
    ("weights", _bad(layers="-2:", combine="weighted", weights=[1.0]), 422, ["weights"]),
    ("pool-at-token-level", _bad(level="token", pool="max"), 422, ["pool='max' applies to level 'sentence' only"]),
    ("subword-at-sentence-level", _bad(subword="last"), 422, ["subword='last' applies to level 'word' only"]),
    ("unknown-field", {"texts": ["hi"], "pooling": "cls"}, 422, ["pooling", "Extra inputs are not permitted"]),
    ("both", {"texts": ["a"], "words": [["a"]], "level": "word"}, 422, ["exactly one"]),
    ("words-level", {"words": [["a"]]}, 422, ["level 'word'"]),
    ("empty", {"texts": []}, 422, ["empty"]),
    ("type", {"texts": "not a list"}, 422, ["texts"]),
    ("malformed", b'{"texts": ["a", ', 422, ["JSON"]),
    ("bool-layer", _bad(layers=True), 422, ["layers"]),
]


@pytest.mark.parametrize("name,body,status,needles", BAD, ids=[getattr(b, "values", b)[0] for b in BAD])
def test_bad_requests_get_clear_errors_and_server_keeps_serving(server, ex, name, body, status, needles):
    got, detail = _request(server, "POST", "/v1/encode", body)
    assert got == status, detail
    text = json.dumps(detail)
    for needle in needles:
        assert needle in text, (needle, text)
    _assert_still_serving(server, ex)


@pytest.mark.parametrize("extra", [{"weights": [1e38, 1e38]}, {"weights": [3e4, 3e4], "output_dtype": "float16"}])
def test_non_finite_result_is_not_a_server_error(server, ex, extra):
    status, body = _request(server, "POST", "/v1/encode", _bad(layers="-2:", combine="weighted", **extra))
    _assert_still_serving(server, ex)
    assert status < 500, body


def test_body_over_limit_413_by_content_length(server, ex):
    conn = http.client.HTTPConnection("127.0.0.1", urlparse(server).port, timeout=60)
    conn.putrequest("POST", "/v1/encode")
    conn.putheader("Content-Length", str(LIMITS["max_body_bytes"] + 1))
    conn.endheaders()  # no body sent: the server answers from the header
    resp = conn.getresponse()
    assert resp.status == 413 and "4000" in json.loads(resp.read())["detail"]
    conn.close()
    assert _request(server, "POST", "/v1/encode", {"texts": ["z" * 300] * 8})[0] == 200  # 2.5 kB: under the limit
    _assert_still_serving(server, ex)


def test_chunked_body_over_limit_413(server, ex):
    data = json.dumps({"texts": ["hello world " * 30] * 20}).encode()
    assert len(data) > LIMITS["max_body_bytes"]
    conn = http.client.HTTPConnection("127.0.0.1", urlparse(server).port, timeout=60)
    conn.request(
        "POST",
        "/v1/encode",
        body=iter([data[i : i + 500] for i in range(0, len(data), 500)]),
        headers={"Content-Type": "application/json"},
        encode_chunked=True,
    )
    resp = conn.getresponse()
    status, text = resp.status, resp.read().decode()
    _assert_still_serving(server, ex)
    assert status == 413 and "max_body_bytes" in text


def test_model_error_is_500_without_traceback(tiny_dirs, ex):
    patched = lw.Extractor(str(tiny_dirs["bert"]), device="cpu")
    real = patched.encode_shared
    boom = patched.tokenize(["BOOM"], words=False)[0].ids[1:-1]

    def encode_shared(parts, **kw):  # a model error for calls holding "BOOM", the real thing otherwise
        if any(t.ids[1:-1] == boom for toks, _ in parts for t in toks):
            raise RuntimeError("secret internal detail from deep inside torch")
        return real(parts, **kw)

    patched.encode_shared = encode_shared
    with serve_in_thread(create_app(patched)) as url:
        status, body = _request(url, "POST", "/v1/encode", {"texts": ["fine", "BOOM"]})
        assert status == 500, body
        text = json.dumps(body)
        assert "internal error" in text and "Traceback" not in text and "secret" not in text
        _assert_still_serving(url, ex)


def test_ready_says_when_the_warmed_depths_are_prepared(tiny_dirs, ex, tmp_path, monkeypatch):
    """A real server with a fresh cache under auto's timed choice: /health answers at once, requests are answered
    while the depths warm (PyTorch serves them), and /ready turns 200 once the default depth and --warm's are
    decided, naming each one's runtime; /ready needs no API key. A bad --warm is refused at start."""
    from tiny import cli_server

    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("LAYERWISE_API_KEY", "k")
    args = ["serve", "--model", str(tiny_dirs["bert"]), "--device", "cpu", "--log-level", "warning", "--warm", "1"]
    with cli_server(args, tmp_path / "server.log", "/health") as url:
        status, body = _request(url, "GET", "/ready")
        assert status in (200, 503) and set(body) == {"ready", "depths", "pending", "preparing", "error"}, body
        assert status == 200 or body["pending"], body
        c = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=120)
        c.request("POST", "/v1/encode", body=json.dumps({"texts": SENTENCES[:2], "layers": 1}).encode(),
                  headers={"Content-Type": "application/json", "Authorization": "Bearer k"})
        answered = c.getresponse()
        assert answered.status == 200 and "vectors" in json.loads(answered.read())
        with contextlib.suppress(AssertionError):  # then the assertion below says what it still waits for
            wait_until(lambda: _request(url, "GET", "/ready")[0] == 200, 120, "GET /ready answering 200", interval=0.2)
        status, body = _request(url, "GET", "/ready")
        assert status == 200 and body["ready"] and body["pending"] == [] and body["error"] is None, body
        assert set(body["depths"]) == {"1", "2"} and set(body["depths"].values()) <= {"onnx", "openvino", "torch"}
    done = subprocess.run([sys.executable, "-m", "layerwise.cli.main", *args[:-1], "7"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode != 0 and "layer 7" in done.stderr and "0..2" in done.stderr, done.stderr[-800:]


@pytest.mark.parametrize("route,body,where", [
    ("/v1/encode", {"texts": ["fine", " \t"]}, "text 1 is empty"),
    ("/v1/encode", {"texts": [""]}, "text 0 is empty"),
    ("/v1/encode", {"words": [["a"], []], "level": "word"}, "word list 1 is empty"),
    ("/v1/embeddings", {"model": "bert", "input": ["ok", ""]}, "text 1 is empty"),
    ("/v1/embeddings", {"model": "bert", "input": [[]]}, "input 0 is an empty list of token ids"),
    ("/embed", {"inputs": "\u3000"}, "text 0 is empty"),
])
def test_blank_inputs_are_refused_naming_the_index_as_extract_does(server, route, body, where):
    status, answer = _request(server, "POST", route, body)
    assert status in (400, 422) and where in json.dumps(answer), answer
