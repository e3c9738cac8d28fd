"""Decoder models through everything above the pipeline, unchanged: extraction to a store, heads, the probe, the
service. The decoder is the tiny random Llama of ``tests/archs.py`` (rotary positions, final norm, BOS, no pad
token in its tokenizer)."""

from __future__ import annotations

import json
import urllib.request

import numpy as np
import pytest
import torch

import layerwise as lw
from layerwise.heads import HeadConfig, TrainOptions, load, train
from layerwise.probe import ProbeConfig, run
from layerwise.store import open_store

from tiny import extract, serving, toy

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naïve cafés in Paris", "a"]


@pytest.fixture(scope="module")
def llama(arch_dirs, arch_extractors):
    return arch_dirs["llama"], arch_extractors["llama"]


def test_extract_a_store_from_a_decoder(llama, tmp_path):
    path, ex = llama
    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    extract(src, tmp_path / "store", model=ex, layers="-2:", combine="concat", pool="last")
    store = open_store(tmp_path / "store")
    want = ex.encode(TEXTS, layers="-2:", combine="concat", pool="last")
    assert np.abs(np.asarray(store[0 : len(TEXTS)]) - want).max() <= 1e-6
    assert store.manifest["model"]["family"] == "llama"


def test_a_frozen_head_on_a_decoder_trains_saves_and_predicts(llama, tmp_path):
    path, ex = llama
    tr, dv = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    toy(tr, 48, 0), toy(dv, 24, 1)
    cfg = HeadConfig(model=str(path), layers="-2:", combine="scalar_mix", pool="last")
    opts = TrainOptions(epochs=8, lr=1e-2, batch_size=16, cache_dir=tmp_path / "cache", progress=False)
    result = train(cfg, tr, dv, model=ex, options=opts, output=tmp_path / "head", log=lambda line: None)
    assert result.dev["accuracy"] >= 0.75, result.dev  # the toy set is separable by one keyword (chance: 0.5)
    clf = load(tmp_path / "head", model=ex)
    texts = [t for t, _ in toy(tmp_path / "again.tsv", 8, 5)]
    want = [y for _, y in toy(tmp_path / "again.tsv", 8, 5)]
    assert sum(a == b for a, b in zip(clf.predict(texts), want)) >= 6


def test_the_probe_runs_every_layer_of_a_decoder(llama, tmp_path):
    path, ex = llama
    data = tmp_path / "s.tsv"
    toy(data, 40, 3)
    res = run(data, data, config=ProbeConfig(task="sentence", epochs=2), model=ex, output=tmp_path / "probe",
              log=lambda line: None, progress=False)
    names = [row["name"] for row in res.rows]
    assert {"embeddings", "layer 1", "layer 2", "last"} <= set(names)
    assert (tmp_path / "probe" / "results.csv").exists()


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_service_serves_a_decoder(llama, tmp_path):
    path, ex = llama
    with serving(path, tmp_path / "log", "--device", "cpu") as base:
        with urllib.request.urlopen(f"{base}/v1/model", timeout=30) as resp:
            info = json.loads(resp.read())
        assert info["architecture"] == "llama" and "rotary" in info["positions"]
        status, body = _post(f"{base}/v1/encode", {"texts": TEXTS, "layers": "-2:", "pool": "last"})
        assert status == 200, body
        got = np.asarray(body["vectors"], dtype=np.float32)
        assert np.abs(got - ex.encode(TEXTS, layers="-2:", pool="last")).max() <= 1e-5
        status, body = _post(f"{base}/v1/encode", {"texts": TEXTS, "layers": -1, "site": "pre_ln"})
        assert status == 422 and "site 'pre_ln' is not available for this model" in json.dumps(body)


def test_add_eos_appends_the_token_last_pooling_reads(llama, arch_extractors):
    path, ex = llama
    tok = ex.tokenizer
    texts = ["Peter Blackburn", "EU rejects German call"]
    got = ex.encode(texts, layers=-1, pool="last", add_eos=True)
    for text, vec in zip(texts, got):  # independently: the tokenizer's ids + eos, through transformers
        ids = torch.tensor([tok(text)["input_ids"] + [tok.eos_token_id]])
        with torch.inference_mode():
            ref = ex.model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
        assert np.abs(vec - ref.hidden_states[-1][0, -1].numpy()).max() <= 1e-5
    left = lw.Extractor(ex.loaded, padding_side="left")  # the Qwen3-Embedding convention: same vectors
    assert np.abs(left.encode(texts, layers=-1, pool="last", add_eos=True) - got).max() <= 1e-5
    (tokens,) = ex.encode(["Peter"], layers=-1, pool=None, add_eos=True)
    assert tokens.shape[0] == len(tok("Peter")["input_ids"]) + 1
    t5 = arch_extractors["t5"]  # its tokenizer ends every text with </s> already: nothing is added twice
    (t5_tokens,) = t5.encode(["Peter"], layers=-1, pool=None, add_eos=True)
    assert t5_tokens.shape[0] == len(t5.tokenizer("Peter")["input_ids"])


def test_prompt_is_put_before_every_text(llama):
    path, ex = llama
    texts = ["Peter Blackburn", "naïve cafés"]
    prompt = "Instruct: find the name\nQuery: "
    got = ex.encode(texts, layers=-1, pool="mean", prompt=prompt)
    assert np.abs(got - ex.encode([prompt + t for t in texts], layers=-1, pool="mean")).max() == 0
    spec = lw.EncodeSpec(layers=-1, pool="last", prompt=prompt, add_eos=True)
    assert lw.EncodeSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="prompt applies to levels 'sentence' and 'token'"):
        lw.EncodeSpec(level="word", prompt="query: ")
    with pytest.raises(ValueError, match="add_eos must be True or False, got 'yes'"):
        lw.EncodeSpec(add_eos="yes")
