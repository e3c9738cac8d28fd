"""``lw.Client``: input checks before any request, every option of ``POST /v1/encode``, numpy options (issue 25).

The service is the real one over HTTP (``llama_service``: uvicorn in a thread) on the tiny random Llama of
``tests/archs.py``: a decoder whose
tokenizer does not end texts with its end-of-sequence token, so ``add_eos`` changes the vectors.
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import numpy as np
import pytest

import layerwise as lw
from layerwise import InputError, LayerwiseError, ServiceError

from tiny import free_port

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naïve cafés in Paris", "a"]
WORDS = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"], ["a"]]


@pytest.fixture(scope="module")
def llama(arch_dirs, arch_extractors):
    return arch_dirs["llama"], arch_extractors["llama"]


@pytest.fixture(scope="module")
def client(llama_service):
    return lw.Client(llama_service)


@pytest.fixture
def no_network(monkeypatch):
    """Any request fails the test: what is checked here must be refused before one is sent."""

    def urlopen(*args, **kwargs):
        raise AssertionError("the client sent a request")

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return lw.Client(f"http://127.0.0.1:{free_port()}")


def _sent(monkeypatch, client: lw.Client) -> list[dict]:
    """The JSON bodies ``client`` sends from now on (each answered with one zero vector, never sent)."""
    bodies: list[dict] = []

    def call(method, path, body=None):
        bodies.append(json.loads(json.dumps(body, default=lw.client._jsonable)))
        return {"vectors": [[0.0]] if body.get("level") == "sentence" else [[[0.0]]]}

    monkeypatch.setattr(client, "_call", call)
    return bodies


def _close(got, want, tol=1e-5):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= tol


# ---- refused before any request -----------------------------------------------------------------------------------
def test_bare_string_texts_refused_before_any_request(no_network):
    with pytest.raises(InputError) as info:
        no_network.encode("I love Paris")
    msg = str(info.value)
    assert "texts is a single string ('I love Paris')" in msg and "pass a list: encode(['I love Paris'])" in msg
    assert isinstance(info.value, LayerwiseError)
    with pytest.raises(InputError, match=r"texts is bytes \(b'I love Paris'\).*decode it and pass a list"):
        no_network.encode(b"I love Paris")
    with pytest.raises(InputError, match=r"texts must be a list of strings, got int"):
        no_network.encode(3)
    with pytest.raises(InputError, match=r"text 1 must be a string, got bytes: b'x' \(decode it"):
        no_network.encode(["ok", b"x"])


def test_bare_string_or_flat_list_of_words_refused_before_any_request(no_network):
    with pytest.raises(InputError) as info:
        no_network.encode_words("EU rejects")
    msg = str(info.value)
    assert "words must be a list of word lists, got a single str ('EU rejects')" in msg
    assert "encode_words([['EU', 'rejects']])" in msg
    with pytest.raises(InputError) as info:
        no_network.encode_words(["EU", "rejects"])
    assert "got a list of strings (['EU', 'rejects']); wrap it for one text: encode_words([['EU', 'rejects']])" in str(
        info.value
    )
    with pytest.raises(InputError, match=r"item 1 is a str \('b'\), not a list of words"):
        no_network.encode_words([["a"], "b"])
    with pytest.raises(InputError, match=r"word 1 of item 0 must be a string, got int: 1"):
        no_network.encode_words([["a", 1]])


def test_options_that_cannot_be_json_refused_before_any_request(no_network):
    with pytest.raises(InputError, match=r"an option of type object .* cannot be sent to the service as JSON"):
        no_network.encode(["a"], layers=object())


def test_unreachable_service_is_a_service_error_with_status_0():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(ServiceError) as info:
        lw.Client(url, timeout=5).health()
    assert info.value.status == 0 and f"could not reach the layerwise service at {url}" in info.value.detail


def test_importing_the_client_needs_no_numpy():
    code = "import sys, layerwise.client; assert 'numpy' not in sys.modules, 'numpy imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- what is sent ---------------------------------------------------------------------------------------------------
def test_numpy_options_become_plain_json(monkeypatch):
    client = lw.Client("http://127.0.0.1:1")
    bodies = _sent(monkeypatch, client)
    client.encode(np.array(["a", "b"]), layers=np.int64(-1))
    client.encode(["a"], layers=[np.int64(0), np.int32(2)], combine="weighted",
                  weights=np.array([0.25, 0.75], dtype=np.float32))
    client.encode(["a"], layers="-2:", combine="weighted", weights=[np.float32(0.5), np.float16(0.5)])
    client.encode_words(WORDS, layers=[np.int64(-1)], add_eos=True)
    assert bodies[0]["texts"] == ["a", "b"] and bodies[0]["layers"] == -1
    assert bodies[1]["layers"] == [0, 2] and bodies[1]["weights"] == [0.25, 0.75]
    assert bodies[2]["weights"] == [0.5, 0.5]
    assert bodies[3]["words"] == WORDS and bodies[3]["layers"] == [-1] and bodies[3]["add_eos"] is True
    assert all(type(v) is int for v in bodies[1]["layers"])


def test_new_options_sent_only_when_set(monkeypatch):
    client = lw.Client("http://127.0.0.1:1")
    bodies = _sent(monkeypatch, client)
    client.encode(["a"])
    client.encode(["a"], normalize=True, prompt="query: ", add_eos=True)
    assert not {"normalize", "prompt", "add_eos"} & set(bodies[0])  # a service of an older layerwise takes it
    assert (bodies[1]["normalize"], bodies[1]["prompt"], bodies[1]["add_eos"]) == (True, "query: ", True)


# ---- against a real service -----------------------------------------------------------------------------------------
def test_normalize_gives_the_extractors_unit_vectors(client, llama):
    _, ex = llama
    got = client.encode(TEXTS, layers="-2:", combine="concat", normalize=True)
    _close(got, ex.encode(TEXTS, layers="-2:", combine="concat", normalize=True))
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() <= 1e-5
    plain = client.encode(TEXTS, layers="-2:", combine="concat")
    assert np.abs(np.linalg.norm(plain, axis=1) - 1).min() > 1e-2  # without it the vectors are not unit length
    with pytest.raises(ServiceError, match="normalize applies to level 'sentence' only") as info:
        client.encode(TEXTS, level="token", normalize=True)
    assert info.value.status == 422


def test_prompt_changes_the_vectors_as_the_extractor_does(client, llama):
    _, ex = llama
    prompt = "Instruct: find the name\nQuery: "
    got = client.encode(TEXTS, layers=-1, pool="mean", prompt=prompt)
    _close(got, ex.encode(TEXTS, layers=-1, pool="mean", prompt=prompt))
    assert np.abs(got - client.encode(TEXTS, layers=-1, pool="mean")).max() > 1e-3
    tokens = client.encode(TEXTS[:2], layers=-1, level="token", prompt=prompt)
    for g, w in zip(tokens, ex.encode(TEXTS[:2], layers=-1, pool=None, prompt=prompt)):
        _close(g, w)


def test_add_eos_changes_the_vectors_as_the_extractor_does(client, llama):
    _, ex = llama
    got = client.encode(TEXTS, layers=-1, pool="last", add_eos=True)
    _close(got, ex.encode(TEXTS, layers=-1, pool="last", add_eos=True))
    assert np.abs(got - client.encode(TEXTS, layers=-1, pool="last")).max() > 1e-3
    (tokens,) = client.encode(["Peter"], layers=-1, level="token", add_eos=True)
    assert tokens.shape[0] == len(ex.tokenizer("Peter")["input_ids"]) + 1


def test_numpy_layers_and_weights_work_against_the_service(client, llama):
    _, ex = llama
    _close(client.encode(TEXTS, layers=np.int64(-1)), ex.encode(TEXTS, layers=-1))
    layers = [np.int64(0), np.int64(2)]
    weights = np.array([0.25, 0.75], dtype=np.float32)
    got = client.encode(TEXTS, layers=layers, combine="weighted", weights=weights)
    _close(got, ex.encode(TEXTS, layers=[0, 2], combine="weighted", weights=[0.25, 0.75]))
    words = client.encode_words(WORDS, layers=np.arange(1, 3))
    for g, w in zip(words, ex.encode_words(WORDS, layers=[1, 2])):
        _close(g, w)


def test_pool_none_means_token_vectors_as_the_extractor_gives_them(client, llama):
    _, ex = llama
    got = client.encode(TEXTS[:2], layers=-1, pool=None)
    want = ex.encode(TEXTS[:2], layers=-1, pool=None)
    assert isinstance(got, list) and [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        _close(g, w)
    _close(client.encode(TEXTS, layers=-1), ex.encode(TEXTS, layers=-1))  # the default: mean, as the Extractor's
