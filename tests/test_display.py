"""Rich display in notebooks: the HTML of ``Extractor``, ``EncodeSpec``, ``LayerStack``, ``FeatureStore`` and a
head's ``TrainResult`` (probe results: ``tests/probe/test_probe.py``). Every text and label is escaped: ``<script>``
in a text, a prompt, a path or a label shows as text and never enters the markup."""

from __future__ import annotations

import numpy as np

import layerwise as lw
from layerwise.display import svg_curve, table
from layerwise.heads.train import TrainResult

from tiny import extract

HOSTILE = '<script>alert("x")</script>'
SAFE = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"


def test_an_extractor_shows_its_model_card(tiny_extractors):
    page = tiny_extractors["bert"]._repr_html_()
    for fact in ("Extractor", "0 = embeddings", "block", "positions", "backend"):
        assert fact in page
    assert "<script" not in page


def test_a_spec_and_a_stack(tiny_extractors):
    spec = lw.EncodeSpec(layers="-2:", prompt=HOSTILE)
    page = spec._repr_html_()
    assert SAFE in page and "<script" not in page and "concat" in page
    stack = tiny_extractors["bert"].hidden_states([HOSTILE, "a short one"], layers="all")
    page = stack._repr_html_()
    assert "<svg" in page and page.count("<tr>") >= len(stack) and "<script" not in page
    norms = stack.norms()
    mask = stack.attention_mask.bool()
    want = [float(np.linalg.norm(stack.numpy()[k][mask.numpy()], axis=-1).mean()) for k in range(len(stack))]
    np.testing.assert_allclose(norms, want, rtol=1e-5)  # padding excluded
    assert f"{norms[-1]:.3f}" in page


def test_a_store_shows_its_manifest(tiny_extractors, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text(f"{HOSTILE}\nplain text\n", encoding="utf-8")
    out = tmp_path / HOSTILE.replace("/", "|")
    extract(src, out, model=tiny_extractors["bert"], layers="-1")
    page = lw.open_store(out)._repr_html_()
    assert "FeatureStore" in page and "2" in page and "<script" not in page and "&lt;script&gt;" in page


def test_a_head_result_and_the_helpers():
    result = TrainResult(classifier=None, log=[{"epoch": 1, "dev_accuracy": 0.5}, {"epoch": 2, "dev_accuracy": 0.75}],
                         best_epoch=2, dev={"accuracy": 0.75, HOSTILE: 1.0}, layers=[{"layer": 3, "weight": 0.4}])
    page = result._repr_html_()
    assert "<svg" in page and "0.7500" in page and SAFE in page and "<script" not in page
    assert svg_curve(["a", "b"], [float("nan"), float("inf")], title="t") == ""
    assert "&lt;b&gt;" in table(["<b>"], [[1]]) and "... 2 more" in table(["x"], [[1], [2], [3]], max_rows=1)
