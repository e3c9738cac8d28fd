"""TensorFlow and Keras encoders through the same API (the ``[tf]`` extra, installed by ``./dev setup``: these tests
run wherever the suite runs, never skipped).

Fixtures are written here, offline: the embedded all-MiniLM-L6-v2 converted to keras-hub, a SavedModel in the TF Hub
BERT interface built from it, and a keras-hub preset and a SavedModel (with ``embedding_output``) of the tiny BERT.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import layerwise as lw
from layerwise.heads import HeadConfig, TrainOptions, train
from layerwise.model.backends.keras import KerasBackend
from layerwise.probe import ProbeConfig, run
from layerwise.store import open_store
from tfhub import keras_preset, tfhub_saved_model

from tiny import extract, serving, toy

WORDS = ("the EU rejects German call to boycott British lamb Peter Blackburn went Brussels Monday quick brown fox "
         "jumps over lazy dog naïve cafés émigrés 1996 2,000 tokens layer probing shows which knows what syntax "
         "meaning ! ? , . ; ( ) - Paris springtime said tourist").split()


def varied(n: int = 100, seed: int = 0) -> list[str]:
    """``n`` sentences of 1 to 60 words (two of them far longer than the 256-token window), punctuation, accents."""
    rng = random.Random(seed)
    out = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))) for _ in range(n - 2)]
    return out + [" ".join(rng.choice(WORDS) for _ in range(400)), "a"]


@pytest.fixture(scope="module")
def keras_ex():
    return lw.Extractor(backend="keras")  # the embedded model's Hugging Face directory, converted by keras-hub


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return tfhub_saved_model(Path(lw.default_model_path()), tmp_path_factory.mktemp("tfhub") / "minilm")


@pytest.fixture(scope="module")
def tf_ex(saved_model):
    # a SavedModel directory: backend "tf" without saying so. TF Hub models carry no sentence-transformers window:
    # use the 256 tokens the PyTorch directory's sentence_bert_config.json gives, so long texts window alike
    return lw.Extractor(str(saved_model), max_length=256)


def _agree(torch_ex, other, texts, layers):
    """(max abs difference over real tokens, worst cosine of mean-pooled vectors) for ``layers``."""
    a = torch_ex.encode(texts, layers=layers, combine="stack", pool=None)
    b = other.encode(texts, layers=layers, combine="stack", pool=None)
    worst = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    va = torch_ex.encode(texts, layers=-1, pool="mean")
    vb = other.encode(texts, layers=-1, pool="mean")
    cos = (va * vb).sum(1) / np.linalg.norm(va, axis=1) / np.linalg.norm(vb, axis=1)
    return worst, float(cos.min())


def test_keras_converted_default_model_equals_pytorch(default_extractor, keras_ex):
    assert keras_ex.backend.name == "keras" and keras_ex.num_layers == 6 and keras_ex.max_length == 256
    worst, cos = _agree(default_extractor, keras_ex, varied(), "all")
    assert worst <= 2e-3 and cos >= 0.9999, (worst, cos)
    assert worst <= 1e-4  # with the checkpoint's exact GELU restored, far inside the tolerance


def test_tfhub_saved_model_equals_the_model_it_was_built_from(default_extractor, tf_ex):
    assert tf_ex.backend.name == "tf" and tf_ex.first_layer == 1
    worst, cos = _agree(default_extractor, tf_ex, varied(seed=1), "1:")
    assert worst <= 2e-3 and cos >= 0.9999, (worst, cos)
    assert worst <= 1e-4  # built with the exact GELU: the same computation


def test_tfhub_layer_0_is_refused_unless_the_model_returns_it(tf_ex, tiny_dirs, tiny_extractors, tmp_path):
    with pytest.raises(ValueError, match=r"layer 0 \(the embeddings\) is not an output of this model's backend "
                                         r"\(its layers are 1\.\.6: a TF Hub BERT SavedModel returns encoder_outputs"):
        tf_ex.encode(["I love Paris"], layers="all")
    with pytest.raises(ValueError, match=r"layer 0 \(the embeddings\) is not an output"):
        tf_ex.hidden_states(["I love Paris"], layers=0)
    with_embeddings = lw.Extractor(str(tfhub_saved_model(tiny_dirs["bert"], tmp_path / "sm", embeddings=True)))
    assert with_embeddings.first_layer == 0
    want = tiny_extractors["bert"].hidden_states(["EU rejects German call", "."], layers="all").tensor
    got = with_embeddings.hidden_states(["EU rejects German call", "."], layers="all").tensor
    assert float((want - got).abs().max()) <= 1e-4 * max(1.0, float(want.abs().max()))


def test_keras_layer_k_computes_no_block_after_k(keras_ex):
    backend = keras_ex.backend
    calls: dict[int, int] = {}
    originals = []
    for i, block in enumerate(backend.blocks):  # count real calls of every block
        originals.append(block.call)

        def counted(*args, _i=i, _call=block.call, **kw):
            calls[_i] = calls.get(_i, 0) + 1
            return _call(*args, **kw)

        block.call = counted
    try:
        for k in range(1, keras_ex.num_layers + 1):
            names = [layer.name for layer in backend.submodel((k,)).layers if layer.name.startswith("transformer_")]
            assert names == [f"transformer_layer_{i}" for i in range(k)]
            calls.clear()
            backend._runners.clear()  # traced afresh: the graph holds exactly the blocks that run while tracing
            keras_ex.encode(["I love Paris", "EU rejects German call"], layers=k)
            assert sorted(calls) == list(range(k)), (k, calls)
    finally:
        for block, call in zip(backend.blocks, originals):
            block.call = call


def test_keras_preset_directory_is_detected_and_loads(tiny_dirs, tmp_path):
    preset = keras_preset(tiny_dirs["bert"], tmp_path / "preset")
    ex = lw.Extractor(str(preset))
    assert ex.backend.name == "keras" and ex.describe()["architecture"] == "BertBackbone"
    converted = lw.Extractor(KerasBackend.load(lw.ModelOptions(str(tiny_dirs["bert"])), exact_gelu=False))  # the same
    # approximation
    texts = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "."]
    a = ex.encode(texts, layers="all", combine="concat", pool=None)
    b = converted.encode(texts, layers="all", combine="concat", pool=None)
    assert all(np.abs(x - y).max() <= 1e-5 for x, y in zip(a, b))
    assert ex.tokenizer(["Peter"])["input_ids"] == converted.tokenizer(["Peter"])["input_ids"]


def test_extract_cli_with_backend_keras_writes_the_pytorch_store(default_extractor, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(varied(40, seed=2)) + "\n", encoding="utf-8")
    extract(src, tmp_path / "torch", model=default_extractor, layers="-4:", combine="concat", pool="mean")
    cmd = [sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / "keras"), "--backend",
           "keras", "--layers", "-4:", "--combine", "concat", "--pool", "mean", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    a, b = open_store(tmp_path / "torch"), open_store(tmp_path / "keras")
    assert len(a) == len(b) == 40 and b.manifest["model"]["backend"] == "keras"
    assert np.abs(np.asarray(a[0:40]) - np.asarray(b[0:40])).max() <= 2e-3


def test_heads_and_probe_take_a_keras_encoder(keras_ex, tmp_path):
    tr, dv = tmp_path / "train.tsv", tmp_path / "dev.tsv"
    toy(tr, 40, 0), toy(dv, 20, 1)
    opts = TrainOptions(epochs=6, lr=1e-2, batch_size=16, cache_dir=tmp_path / "cache", progress=False)
    result = train(HeadConfig(model=lw.default_model_path(), layers="-2:", pool="mean"), tr, dv, model=keras_ex,
                   options=opts, output=tmp_path / "head", log=lambda line: None)
    assert result.dev["accuracy"] >= 0.75
    res = run(tr, dv, config=ProbeConfig(task="sentence", epochs=2), model=keras_ex, output=tmp_path / "probe",
              log=lambda line: None, progress=False)
    assert [r["name"] for r in res.rows][:2] == ["embeddings", "layer 1"]


def test_the_service_serves_a_saved_model(saved_model, tf_ex, tmp_path):
    texts = ["I love Paris", "EU rejects German call to boycott British lamb ."]
    with serving(saved_model, tmp_path / "log") as base:  # a SavedModel directory: backend "tf" by itself
        body = json.dumps({"texts": texts, "layers": "-2:", "combine": "mean"}).encode()
        req = urllib.request.Request(f"{base}/v1/encode", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            got = np.asarray(json.loads(resp.read())["vectors"], dtype=np.float32)
        assert np.abs(got - tf_ex.encode(texts, layers="-2:", combine="mean")).max() <= 1e-5


def test_without_the_extra_the_error_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "keras_hub", None)
    with pytest.raises(lw.MissingExtraError, match=r"backend='keras' needs the optional extra \[tf\] \(TensorFlow, "
                                                   r"Keras 3 and keras-hub\): pip install 'layerwise\[tf\]'") as info:
        lw.Extractor(backend="keras")
    assert info.value.extra == "tf" and isinstance(info.value.__cause__, ImportError)
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(lw.MissingExtraError, match=r"backend='tf' needs the optional extra \[tf\] .*: "
                                                   r"pip install 'layerwise\[tf\]'"):
        from layerwise.model.backends.savedmodel import require_tf

        require_tf()
    assert torch.is_tensor(lw.Extractor(device="cpu").hidden_states(["x"], layers=-1).tensor)  # the rest works


def test_tf_backends_refuse_what_they_cannot_do(tiny_dirs, saved_model):
    with pytest.raises(ValueError, match=r"backend='keras' runs float32 on the CPU .* compute_dtype='float16'"):
        lw.Extractor(backend="keras", compute_dtype="float16")
    with pytest.raises(lw.ModelLoadError, match=r"keras-hub cannot load .*deberta-v2.* as a backbone .*no converter.*"
                                                r"use backend='torch' for this one"):
        lw.Extractor(str(tiny_dirs["deberta-v2"]), backend="keras")
    with pytest.raises(lw.ModelLoadError, match=r"backend='tf' loads a TensorFlow SavedModel directory"):
        lw.Extractor(str(tiny_dirs["bert"]), backend="tf")
    with pytest.raises(ValueError, match=r"backend='tf' loads its own model: pass the SavedModel directory"):
        lw.Extractor(lw.Extractor().loaded, backend="tf")
    with pytest.raises(ValueError, match=r"tokenizer= goes with backend='tf'"):
        lw.Extractor(str(tiny_dirs["bert"]), tokenizer=str(tiny_dirs["bert"]))
    with pytest.raises(ValueError, match=r"site 'attention' is not available for this model with this backend"):
        lw.Extractor(str(saved_model)).encode(["x"], layers=1, site="attention")
