"""The layer explorer's server side: corpus from a store or texts, projections, scores, the sentence view, probe
directories, the JSON API (FastAPI TestClient) and the command line's errors. The page itself: test_explore_page.py.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from fastapi.testclient import TestClient

from layerwise.explore import (
    Explorer,
    corpus_from_store,
    corpus_from_texts,
    create_explorer_app,
    layer_scores,
    project,
    read_probe_dir,
    sentence_view,
)
from layerwise.explore.corpus import corpus_from_file, layer_views, sample_rows
from layerwise.explore.scores import knn_accuracy

from tiny import extract, toy


@pytest.fixture(scope="module")
def labelled(tmp_path_factory, tiny_extractors):
    """A toy labelled TSV and three stores of it: every layer stacked, the last two concatenated, their mean."""
    root = tmp_path_factory.mktemp("explore")
    rows = toy(root / "toy.tsv", 60, seed=1)
    ex = tiny_extractors["bert"]
    stores = {}
    for name, kw in {"stack": dict(layers="all", combine="stack"), "concat": dict(layers="-2:", combine="concat"),
                     "mean": dict(layers="-2:", combine="mean")}.items():
        stores[name] = root / name
        extract(root / "toy.tsv", stores[name], model=ex, keep=["label"], progress=False, **kw)
    return root, rows, stores, ex


def test_corpus_from_stacked_store(labelled):
    root, rows, stores, ex = labelled
    c = corpus_from_store(stores["stack"], labels="label")
    assert c.vectors.shape == (60, 3, 32) and c.layer_names == ["embeddings", "layer 1", "layer 2"]
    assert c.texts == [t for t, _ in rows] and c.labels == [y for _, y in rows]  # texts re-read from the input
    assert c.note == "all 60 records"
    want = ex.encode([t for t, _ in rows], layers="all", combine="stack", pool="mean")
    np.testing.assert_allclose(c.vectors, want, atol=1e-5)


def test_concat_store_splits_into_layers_and_mean_is_one_view(labelled):
    _, _, stores, _ = labelled
    concat = corpus_from_store(stores["concat"], labels="label")
    stack = corpus_from_store(stores["stack"], labels="label")
    assert concat.layer_names == ["layer 1", "layer 2"]
    np.testing.assert_allclose(concat.vectors, stack.vectors[:, 1:], atol=1e-6)
    mean = corpus_from_store(stores["mean"])
    assert mean.layer_names == ["mean of layers 1-2"] and mean.labels is None and mean.vectors.shape == (60, 1, 32)
    assert layer_views([0, 3], "sum", (32,)) == ([-1], ["sum of layers 0, 3"])


def test_sample_is_seeded_and_stated(labelled):
    _, rows, stores, _ = labelled
    c = corpus_from_store(stores["stack"], labels="label", sample=25)
    assert len(c.texts) == 25 and c.total == 60 and c.note == "25 of 60 records (random sample, seed 0)"
    np.testing.assert_array_equal(c.rows, sample_rows(60, 25))
    assert c.texts == [rows[i][0] for i in c.rows] and c.labels == [rows[i][1] for i in c.rows]
    with pytest.raises(ValueError, match="sample must be a positive number of records, got 0"):
        sample_rows(10, 0)


def test_store_errors_say_how_to_fix(labelled, tmp_path):
    root, _, stores, ex = labelled
    with pytest.raises(ValueError, match=r"column 'topic' was not kept .* extract with --keep topic"):
        corpus_from_store(stores["stack"], labels="topic")
    tokens = tmp_path / "tok"
    extract(root / "toy.tsv", tokens, model=ex, level="token", progress=False)
    with pytest.raises(ValueError, match="needs sentence vectors; .* is a token-level store. Extract with --level "
                                         "sentence"):
        corpus_from_store(tokens)


def test_corpus_from_texts_and_file(labelled):
    root, rows, _, ex = labelled
    c = corpus_from_file(ex, root / "toy.tsv", labels="label", sample=20)
    assert c.vectors.shape == (20, 3, 32) and c.total == 60 and len(set(c.labels)) == 2
    with pytest.raises(ValueError, match="got 1 labels for 2 texts"):
        corpus_from_texts(ex, ["a", "b"], ["x"])


def test_scores_by_hand():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 1, (30, 6)), rng.normal(0, 1, (30, 6))])
    y = np.array(["a"] * 30 + ["b"] * 30)
    x[:30, 1] += 8  # two directions: separable by cosine too
    x[30:, 0] += 8
    s = layer_scores(x, y)
    assert s["knn"] == 1.0 and s["probe"] == 1.0 and 0.2 < s["silhouette"] <= 1
    # kNN against a brute-force leave-one-out vote
    noisy = rng.normal(size=(40, 5))
    ny = rng.choice(["p", "q", "r"], size=40)
    unit = noisy / np.linalg.norm(noisy, axis=1, keepdims=True)
    sim = unit @ unit.T
    np.fill_diagonal(sim, -np.inf)
    hits = 0
    for i in range(40):
        near = np.argsort(-sim[i])[:5]
        values, counts = np.unique(ny[near], return_counts=True)
        hits += values[counts.argmax()] == ny[i]
    assert knn_accuracy(noisy, ny, k=5) == pytest.approx(hits / 40)
    one = layer_scores(x, ["a"] * 60)
    assert np.isnan(one["probe"]) and np.isnan(one["silhouette"])


def test_pca_projection():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 5)) * np.array([5, 2, 0.1, 0.1, 0.1])
    xy, info = project(x, "pca")
    assert xy.shape == (100, 2) and info["explained"][0] > info["explained"][1] > 0.1
    np.testing.assert_allclose(np.abs(np.corrcoef(xy[:, 0], x[:, 0])[0, 1]), 1, atol=1e-2)
    with pytest.raises(ValueError, match="unknown projection 'tsne'. Valid values are: pca, umap"):
        project(x, "tsne")


def test_umap_projection():
    pytest.importorskip("umap")
    rng = np.random.default_rng(0)
    xy, info = project(rng.normal(size=(40, 5)), "umap")
    assert xy.shape == (40, 2) and info["method"] == "umap" and np.isfinite(xy).all()


def test_sentence_view_matches_hidden_states(tiny_extractors):
    ex = tiny_extractors["bert"]
    v = sentence_view(ex, "peter blackburn went brussels")
    stack = ex.hidden_states(["peter blackburn went brussels"], layers="all")
    h = stack.tensor[:, 0].double().numpy()
    assert v["layers"] == [0, 1, 2] and len(v["tokens"]) == h.shape[1]
    np.testing.assert_allclose(v["norm"], np.linalg.norm(h, axis=-1), rtol=1e-3, atol=1e-3)
    cos = lambda a, b: (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)  # noqa: E731
    np.testing.assert_allclose(v["change"][2], 1 - cos(h[2], h[1]), atol=1e-3)
    np.testing.assert_allclose(v["cos_last"][0], cos(h[0], h[2]), atol=1e-3)
    assert np.allclose(np.diagonal(np.array(v["similarity"]), axis1=1, axis2=2), 1, atol=1e-3)
    att = sentence_view(ex, "peter blackburn", site="attention")
    assert att["layers"] == [1, 2] and att["layer_names"] == ["layer 1", "layer 2"]
    with pytest.raises(ValueError, match="site 'mlp' is not recorded for this model. Valid sites are: block"):
        sentence_view(ex, "x", site="mlp")
    with pytest.raises(ValueError, match="the text is empty"):
        sentence_view(ex, "  ")


def test_probe_directory(tmp_path):
    with pytest.raises(ValueError, match="is not a layerwise probe output directory \\(no results.json\\)"):
        read_probe_dir(tmp_path)
    (tmp_path / "results.json").write_text(json.dumps({"task_title": "t"}))
    with pytest.raises(ValueError, match="lacks metric_name, rows, cka: not written by layerwise probe"):
        read_probe_dir(tmp_path)


def test_api(labelled):
    _, rows, stores, ex = labelled
    explorer = Explorer(corpus=corpus_from_store(stores["stack"], labels="label"), extractor=ex)
    client = TestClient(create_explorer_app(explorer))
    page = client.get("/")
    assert page.status_code == 200 and "layerwise explorer" in page.text
    assert "http" not in page.text.replace("http://www.w3.org", "")  # nothing from another host
    assert client.get("/explorer/static/explorer.js").status_code == 200
    assert client.get("/explorer/static/../app.py").status_code == 404
    info = client.get("/explorer/api/info").json()
    assert info["corpus"]["layer_names"] == ["embeddings", "layer 1", "layer 2"] and info["model"]["sites"]
    layer = client.get("/explorer/api/layer/2").json()
    assert len(layer["points"]) == 60 and set(layer["scores"]) == {"knn", "probe", "silhouette"}
    assert client.get("/explorer/api/layer/2").json() is not layer  # cached: same content
    scores = client.get("/explorer/api/scores").json()
    assert scores["names"] == info["corpus"]["layer_names"] and scores["probe"][2] == layer["scores"]["probe"]
    bad = client.get("/explorer/api/layer/7")
    assert bad.status_code == 400 and "views 0..2 (embeddings, layer 1, layer 2)" in bad.json()["detail"]
    assert client.get("/explorer/api/layer/0?method=tsne").status_code == 400
    sent = client.post("/explorer/api/sentence", json={"text": "peter went", "site": "block"}).json()
    assert len(sent["norm"]) == 3 and len(sent["norm"][0]) == len(sent["tokens"])
    assert client.post("/explorer/api/sentence", json={"text": "x", "site": "nope"}).status_code == 400
    empty = TestClient(create_explorer_app(Explorer()))
    assert empty.get("/explorer/api/layer/0").status_code == 404
    assert empty.post("/explorer/api/sentence", json={"text": "x"}).status_code == 404


def test_service_serves_the_page(tiny_extractors):
    from layerwise.serve import create_app

    with TestClient(create_app(tiny_extractors["bert"])) as client:
        assert "layerwise explorer" in client.get("/").text
        info = client.get("/explorer/api/info").json()
        assert info["corpus"] is None and info["model"]["num_layers"] == 2
        assert client.post("/explorer/api/sentence", json={"text": "peter"}).status_code == 200
        assert client.post("/v1/encode", json={"texts": ["peter"]}).status_code == 200


def test_cli_errors(labelled, tmp_path):
    from typer.testing import CliRunner

    from layerwise.cli.main import app

    _, _, stores, _ = labelled
    runner = CliRunner()
    out = runner.invoke(app, ["explore", str(stores["stack"]), "--texts", "x.txt"])
    assert out.exit_code != 0 and "give a STORE or --texts FILE, not both" in out.output
    out = runner.invoke(app, ["explore", str(stores["stack"]), "--probe", str(tmp_path)])
    assert out.exit_code != 0 and "not a layerwise probe output directory" in out.output
    out = runner.invoke(app, ["explore", str(stores["stack"]), "--labels", "topic"])
    assert out.exit_code != 0 and "extract with --keep topic" in out.output


def test_explore_inline_in_a_notebook(tiny_extractors, tmp_path):
    """``lw.explore(...)`` starts the explorer on a free local port and displays as an iframe on it; ``stop()`` (or
    leaving ``with``) ends it. Texts with labels, and a store, both work; a wrong call says what it takes."""
    import json
    import urllib.error
    import urllib.request

    import pytest

    import layerwise as lw

    ex = tiny_extractors["bert"]
    texts = [f"good film {i}" for i in range(6)] + [f"bad film {i}" for i in range(6)]
    with lw.explore(texts, labels=["pos"] * 6 + ["neg"] * 6, model=ex) as shown:
        page = shown._repr_html_()
        assert page.startswith("<iframe") and f'src="{shown.url}"' in page and shown.url.startswith("http://127.0.0.1:")
        info = json.loads(urllib.request.urlopen(shown.url + "explorer/api/info", timeout=30).read())
        assert info["corpus"]["labels"][:1] == ["pos"] and len(info["corpus"]["texts"]) == 12
        assert b"layerwise explorer" in urllib.request.urlopen(shown.url, timeout=30).read().lower()
    assert not shown.running
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(shown.url + "explorer/api/info", timeout=5)
    with pytest.raises(lw.LayerwiseError, match="a store directory, a FeatureStore or a list of texts"):
        lw.explore(42, model=ex)


def test_export_reports_each_step_in_order(labelled, tmp_path):
    """``export_page(progress=)`` is told of every view and the scores before each runs, and once when done."""
    from layerwise.explore.export import export_page
    from layerwise.explore.projection import available_methods

    _, _, stores, ex = labelled
    explorer = Explorer(corpus=corpus_from_store(stores["stack"], labels="label"), extractor=ex)
    seen = []
    export_page(explorer, tmp_path / "page.html", progress=lambda done, total, what: seen.append((done, total, what)))
    views = len(available_methods()) * 3  # the tiny BERT: embeddings and 2 layers
    assert [s[0] for s in seen] == list(range(views + 2)) and {s[1] for s in seen} == {views + 1}
    assert seen[0][2] == "embeddings (pca)" and seen[-2][2] == "scores" and seen[-1][2] == "done"


def test_export_from_the_shell_shows_progress_and_no_third_party_noise(labelled, tmp_path):
    """``explore --texts FILE --export page.html`` in a real process (TensorFlow's C++ logs bypass Python): stderr says
    what it computes and where it wrote, and nothing of TensorFlow, absl, UMAP or numba; ``-q`` says only the last
    line. umap-learn imports TensorFlow where it is installed."""
    import subprocess
    import sys

    root, _, _, ex = labelled
    base = [sys.executable, "-m", "layerwise.cli.main", "explore", "--texts", str(root / "toy.tsv"), "--labels",
            "label", "--model", ex.options.model, "--device", "cpu", "--sample", "40"]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    # both runs at once (each mostly imports and JIT-compiles on one core)
    runs = {quiet: subprocess.Popen([*base, "--export", str(tmp_path / f"page-{quiet}.html"), *(["-q"] * quiet)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for quiet in (False, True)}
    for quiet, proc in runs.items():
        out, err = proc.communicate(timeout=600)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        assert done.returncode == 0, done.stderr[-3000:]
        assert (tmp_path / f"page-{quiet}.html").is_file() and done.stdout == ""
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        noise = [line for line in lines if re.search(r"tensorflow|absl|oneDNN|cuda|umap|numba|warn|I0000|W0000|E0000",
                                                     line, re.I)]
        assert not noise, noise
        said = " ".join(done.stderr.split())
        assert "exported the explorer" in said
        assert ("computing" in said) is (not quiet), said
        if not quiet:
            n_views = 2 * (ex.num_layers + 1) if __import__("importlib").util.find_spec("umap") else ex.num_layers + 1
            assert f"explore: computing {n_views + 1} parts of the page" in said, said


def test_the_held_back_lines_are_tensorflow_s_only():
    """The lines TensorFlow's import writes on its own are held back; anything else written meanwhile is not."""
    from layerwise.explore.projection import TF_IMPORT_NOISE

    noise = ["WARNING: All log messages before absl::InitializeLog() is called are written to STDERR\n",
             "I0000 00:00:1795693390.045304   18901 cudart_stub.cc:31] Could not find cuda drivers on your machine, "
             "GPU will not be used.\n",
             "I0000 00:00:1795693390.150613   18901 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to "
             "use available CPU instructions in performance-critical operations.\n",
             "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow with the "
             "appropriate compiler flags.\n"]
    kept = ["layerwise: exported bert (layers 0..2) to ONNX in 3.1 s\n", "Traceback (most recent call last):\n",
            "F0000 00:00:1795693390.0 1 x.cc:1] fatal\n"]
    assert all(TF_IMPORT_NOISE.match(line) for line in noise)
    assert not any(TF_IMPORT_NOISE.match(line) for line in kept)
