"""The clients people already use, unchanged, against the real service over HTTP (uvicorn in a thread): the
official ``openai`` client (sync and async, float and base64, ``dimensions``, layers by ``extra_body`` and by an
alias, token ids), ``huggingface_hub.InferenceClient.feature_extraction`` (TEI's protocol) and LangChain's
``OpenAIEmbeddings``.

Every vector equals ``Extractor.encode`` with the same spec (cosine >= 0.99999).
"""

from __future__ import annotations

import asyncio
import base64
import json
import urllib.error
import urllib.request

import numpy as np
import pytest

from tiny import serve_in_thread

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
hub = pytest.importorskip("huggingface_hub")

TEXTS = ["I love Paris", "EU rejects German call to boycott British lamb", "hello"]
ALIASES = ["mid=layers=1;pool=cls", "last2=layers=-2:;combine=concat"]  # as --alias gives them


@pytest.fixture(scope="module")
def server(tiny_dirs):
    """The service on the tiny BERT with two aliases, in a thread of this process (its own Extractor)."""
    import layerwise as lw
    from layerwise.serve import create_app
    from layerwise.serve.aliases import parse_alias

    app = create_app(lw.Extractor(str(tiny_dirs["bert"]), device="cpu"), aliases=dict(map(parse_alias, ALIASES)))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def ex(tiny_extractors):
    return tiny_extractors["bert"]


def assert_close(got, want) -> None:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cos.min() >= 0.99999, cos
    assert np.abs(np.linalg.norm(got, axis=-1) - np.linalg.norm(want, axis=-1)).max() < 1e-4


def post(url: str, body: dict) -> tuple[int, object, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers)


def test_openai_client_float_and_base64(server, ex):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    want = ex.encode(TEXTS, layers=-1, pool="mean", normalize=True)
    for fmt in ("float", None):  # None: the openai client asks for base64 itself, and decodes it
        got = client.embeddings.create(model="bert", input=TEXTS, **({"encoding_format": fmt} if fmt else {}))
        assert [d.index for d in got.data] == [0, 1, 2] and got.object == "list"
        assert_close([d.embedding for d in got.data], want)
        assert got.usage.prompt_tokens == got.usage.total_tokens > len(TEXTS)
    asked = client.embeddings.create(model="bert", input=TEXTS, encoding_format="base64")  # left to the caller
    assert_close([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in asked.data], want)
    single = client.embeddings.create(model="bert", input="I love Paris")
    assert_close([single.data[0].embedding], want[:1])


def test_openai_dimensions_layers_by_extra_body_and_by_alias(server, ex):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    full = ex.encode(TEXTS, layers=-1, pool="mean")
    cut = full[:, :8] / np.linalg.norm(full[:, :8], axis=-1, keepdims=True)
    got = client.embeddings.create(model="bert", input=TEXTS, dimensions=8)
    assert_close([d.embedding for d in got.data], cut)
    got = client.embeddings.create(model="bert", input=TEXTS, extra_body={"layers": 1, "pool": "cls"})
    assert_close([d.embedding for d in got.data], ex.encode(TEXTS, layers=1, pool="cls", normalize=True))
    got = client.embeddings.create(model="mid", input=TEXTS)  # the alias: layers=1;pool=cls
    assert_close([d.embedding for d in got.data], ex.encode(TEXTS, layers=1, pool="cls", normalize=True))
    raw = client.embeddings.with_raw_response.create(model="last2", input=TEXTS, extra_body={"normalize": False})
    spec = json.loads(raw.headers["x-layerwise-spec"])
    assert spec["layers"] == [1, 2] and spec["combine"] == "concat" and spec["normalize"] is False
    assert raw.headers["x-layerwise-runtime"] in ("torch", "onnx", "openvino")  # what computed the answer
    assert_close([d.embedding for d in raw.parse().data], ex.encode(TEXTS, layers="-2:", combine="concat"))
    assert {m.id for m in client.models.list().data} >= {"mid", "last2", "bert"}


def test_openai_async_client_and_token_ids(server, ex):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused")
        return await asyncio.gather(*(client.embeddings.create(model="bert", input=[t]) for t in TEXTS))

    got = asyncio.run(run())
    assert_close([r.data[0].embedding for r in got], ex.encode(TEXTS, normalize=True))
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    ids = [ex.tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    by_ids = client.embeddings.create(model="bert", input=ids)
    assert_close([d.embedding for d in by_ids.data], ex.encode(TEXTS, normalize=True))


def test_openai_errors_in_openais_shape(server):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length=False"):
        client.embeddings.create(model="bert", input=[[10**7, 5]])  # a tiktoken id: outside this vocabulary
    with pytest.raises(openai.NotFoundError, match="served names are: .*mid"):
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    with pytest.raises(openai.BadRequestError, match="layers"):
        client.embeddings.create(model="bert", input="hi", extra_body={"layers": 99})
    status, body, _ = post(f"{server}/v1/embeddings", {"model": "bert", "input": []})
    assert status == 400 and set(body["error"]) == {"message", "type", "param", "code"}, body
    status, body, _ = post(f"{server}/v1/embeddings", {"model": "bert", "input": "hi", "colour": "red"})
    assert status == 400 and "colour" in body["error"]["message"], body


def test_huggingface_hub_feature_extraction(server, ex, monkeypatch):
    # the suite runs with HF_HUB_OFFLINE=1 (nothing may download), which huggingface_hub applies to every URL; a user
    # calling their own server has no reason to set it
    monkeypatch.setattr(hub.constants, "is_offline_mode", lambda: False)
    client = hub.InferenceClient(model=server)
    got = client.feature_extraction("I love Paris")
    assert got.shape == (1, ex.hidden_size)
    assert_close(got, ex.encode(["I love Paris"], normalize=True))
    raw = client.feature_extraction("I love Paris", normalize=False)
    assert_close(raw, ex.encode(["I love Paris"]))


def test_tei_routes(server, ex):
    status, vecs, headers = post(f"{server}/embed", {"inputs": TEXTS, "layers": 1, "pool": "cls"})
    assert status == 200 and json.loads(headers["x-layerwise-spec"])["layers"] == [1]
    assert_close(vecs, ex.encode(TEXTS, layers=1, pool="cls", normalize=True))
    status, tokens, _ = post(f"{server}/embed_all", {"inputs": "I love Paris"})
    want = ex.encode(["I love Paris"], pool=None)[0]
    assert status == 200 and len(tokens) == 1
    assert_close(tokens[0], want)
    status, toks, _ = post(f"{server}/tokenize", {"inputs": ["I love Paris"]})
    assert status == 200 and toks[0][0]["special"] and toks[0][1]["start"] == 0 and toks[0][1]["stop"] == 1
    info = json.loads(urllib.request.urlopen(f"{server}/info").read())
    assert info["max_input_length"] > 0 and "mid" in info["layerwise"]["aliases"]
    status, body, _ = post(f"{server}/embed", {"inputs": "hi", "truncation_direction": "Left"})
    assert status == 422 and body["error_type"] == "Validation" and "Left" in body["error"]
    status, body, _ = post(f"{server}/embed", {"inputs": "hi", "prompt_name": "query"})
    assert status == 422 and "prompt_name 'query'" in body["error"]


def test_langchain_openai_embeddings(server, ex):
    lc = pytest.importorskip("langchain_openai", reason="langchain-openai is in the test extra")
    emb = lc.OpenAIEmbeddings(model="mid", base_url=f"{server}/v1", api_key="unused",
                              check_embedding_ctx_length=False)
    assert_close(emb.embed_documents(TEXTS), ex.encode(TEXTS, layers=1, pool="cls", normalize=True))
    assert_close([emb.embed_query("hello")], ex.encode(["hello"], layers=1, pool="cls", normalize=True))
