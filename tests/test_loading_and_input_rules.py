"""Loading and input rules: model loading, text checks, word rules, the layer grammar, the default window
(sentence-transformers' length)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.encoding.spec import EncodeSpec
from layerwise.serve import EncodeRequest


@pytest.fixture
def bert_copy(tiny_dirs, tmp_path):
    return shutil.copytree(tiny_dirs["bert"], tmp_path / "bert")


def test_a_model_without_tokenizer_files_is_refused(bert_copy):
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        (bert_copy / name).unlink(missing_ok=True)
    with pytest.raises(lw.ModelLoadError) as info:
        lw.Extractor(str(bert_copy))
    text = str(info.value)
    assert "has weights but no tokenizer files" in text and "tokenizer.json" in text and "save_pretrained" in text
    res = CliRunner().invoke(app, ["encode", "a b", "--model", str(bert_copy)])
    assert res.exit_code == 2 and "no tokenizer files" in res.stderr


def test_a_corrupt_weights_file_is_one_clear_error(bert_copy):
    (bert_copy / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(lw.ModelLoadError, match="not a readable safetensors file .* corrupt or truncated"):
        lw.Extractor(str(bert_copy))
    res = CliRunner().invoke(app, ["encode", "a b", "--model", str(bert_copy)])
    assert res.exit_code == 2 and "corrupt or truncated" in res.stderr and "Traceback" not in res.stderr


def test_revision_is_refused_where_there_are_no_revisions(tiny_dirs):
    with pytest.raises(lw.ModelLoadError, match="revision='v2' selects a version of a hub repository; the embedded"):
        lw.Extractor(revision="v2")
    with pytest.raises(lw.ModelLoadError, match="has no revisions"):
        lw.Extractor(str(tiny_dirs["bert"]), revision="main")


def test_the_default_window_is_the_sentence_transformers_length(default_extractor, tiny_extractors):
    assert default_extractor.max_length == 256 and default_extractor.loaded.max_length == 512
    assert lw.Extractor(max_length=512).max_length == 512  # the position limit stays reachable
    assert tiny_extractors["bert"].max_length == tiny_extractors["bert"].loaded.max_length  # no such file


def test_normalize_gives_unit_vectors_and_only_at_sentence_level(tiny_extractors):
    ex = tiny_extractors["bert"]
    x = ex.encode(["a b c", "EU rejects"], layers="-2:", normalize=True)
    assert np.allclose(np.linalg.norm(x, axis=1), 1, atol=1e-6)
    raw = ex.encode(["a b c", "EU rejects"], layers="-2:")
    assert np.allclose(x, raw / np.linalg.norm(raw, axis=1, keepdims=True), atol=1e-6)
    with pytest.raises(ValueError, match="normalize applies to level 'sentence' only, not level 'token'"):
        EncodeSpec(level="token", normalize=True)


def test_an_empty_word_is_refused_naming_its_place_in_every_family(tiny_extractors, family):
    """A blank word would have no token and so no vector (it used to be a silent zero row): refused, naming it."""
    ex = tiny_extractors[family]
    for words, where in ((["EU", "", "call"], "word 1 of item 0"), (["EU", "  ", "call"], "word 1 of item 0"),
                         ([""], "word 0 of item 0")):
        with pytest.raises(lw.InputError, match=rf"{where} is empty"):
            ex.encode_words([words], layers=-1)


def test_lone_surrogates_name_the_text(tiny_extractors):
    ex = tiny_extractors["bert"]
    with pytest.raises(ValueError, match=r"text 1 holds a lone surrogate '\\ud800' at character 4 \(invalid UTF-8"):
        ex.encode(["ok", "bad \ud800"])
    with pytest.raises(ValueError, match="word 1 of item 0 holds a lone surrogate"):
        ex.encode_words([["ok", "b\udcff"]])
    with pytest.raises(ValueError, match="text 4097 holds a lone surrogate"):  # the index counts across chunks
        list(ex.stream(["a"] * 4097 + ["\ud800"], EncodeSpec()))


def test_minus_zero_is_refused_as_ambiguous(tiny_extractors):
    ex = tiny_extractors["bert"]
    for spec in ("-0", "-0:", "1,-0"):
        with pytest.raises(ValueError, match="holds -0, which is ambiguous: use 0 for the embeddings or -1"):
            ex.encode(["a"], layers=spec)
    assert ex.encode(["a"], layers=0).shape == ex.encode(["a"], layers="embeddings").shape


def test_comma_layer_specs_work_everywhere(tiny_extractors):
    ex = tiny_extractors["bert"]
    a = ex.encode(["EU rejects German call"], layers="0,2")
    b = ex.encode(["EU rejects German call"], layers=[0, 2])
    assert np.array_equal(a, b)
    assert EncodeSpec(layers="0, -1:").resolve(ex).layers == (0, 2)
    assert EncodeRequest(texts=["x"], layers="0,2").spec().resolve(ex).layers == (0, 2)  # HTTP
    assert lw.EncodeSpec.from_json(json.dumps({"layers": "0,1"})).resolve(ex).layers == (0, 1)
    with pytest.raises(ValueError, match="has an empty item between commas"):
        EncodeSpec(layers="0,,2").resolve(ex)
    with pytest.raises(ValueError, match=r"names layer\(s\) \[2\] more than once"):
        EncodeSpec(layers="2,-1").resolve(ex)


def test_nan_weights_are_refused_in_python_and_the_cli(tiny_dirs, tiny_extractors):
    with pytest.raises(ValueError, match="weight 0 is nan; layer weights must be finite"):
        tiny_extractors["bert"].encode(["a"], layers="-2:", combine="weighted", weights=[float("nan"), 1.0])
    for value in ("nan,1", "inf,1"):
        res = CliRunner().invoke(
            app,
            [
                "encode",
                "a",
                "--model",
                str(tiny_dirs["bert"]),
                "--layers=-2:",
                "--combine",
                "weighted",
                "--weights",
                value,
            ],
        )
        assert res.exit_code == 2 and "layer weights must be finite" in res.stderr and res.stdout == ""
