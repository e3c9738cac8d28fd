"""One runtime per store, on ``auto``'s default path (no ``$LAYERWISE_AUTO_RUNTIME``): decided before the first
record, named in the manifest and each shard, kept by a resume (its graph rebuilt when the cache lost it), and the
same bytes for the same command and cache state."""

from __future__ import annotations

import numpy as np
import pytest

import layerwise as lw
from layerwise.cli.main import app
from layerwise.model.backends.ort import cache_dir

pytest.importorskip("onnxruntime")

SPEC = lw.EncodeSpec(layers=[1, 2], combine="concat", pool="mean")


@pytest.fixture
def corpus(tmp_path):
    words = "eu rejects german call to boycott british lamb peter blackburn went brussels monday".split()
    rng = np.random.default_rng(1)
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(" ".join(rng.choice(words, size=int(rng.integers(2, 14)))) for _ in range(40)) + "\n")
    return path


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """The default path with a cache of this test's own."""
    monkeypatch.delenv("LAYERWISE_AUTO_RUNTIME", raising=False)
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "cache"))
    return cache_dir()


def _features(store):
    st = lw.open_store(store)
    return st.to_numpy(), st.manifest


def _record_race(ex, winner):
    """A race recorded on this machine for ``ex``'s model (as a finished earlier run leaves it)."""
    names = ["torch", *ex.backend.compiled_runtimes]
    times = {n: (0.001 if n == winner else 0.002) for n in names}
    ex.backend.races.put(ex.backend.racer.key(names), times)


def test_a_recorded_race_picks_the_store_runtime_and_a_resume_keeps_it(tiny_dirs, fresh, corpus, tmp_path, capfd):
    ex = lw.Extractor(tiny_dirs["bert"])
    _record_race(ex, "onnx")
    store = tmp_path / "s"
    opts = dict(shard_records=8, batch_tokens=64, progress=False)
    first = lw.extract(corpus, store, SPEC, model=ex, options=lw.ExtractOptions(max_records=16, **opts))
    assert first.status == "partial"
    said = capfd.readouterr().err
    assert "ONNX Runtime computes this store (fastest here: 1.0 ms vs " in said and "PyTorch's 2.0 ms" in said, said
    with pytest.raises(lw.LayerwiseError, match=r"this store was computed by 'onnx', and this run would compute "
                                                r"with 'torch': resume with --backend onnx"):
        lw.extract(corpus, store, SPEC, model=lw.Extractor(tiny_dirs["bert"], backend="torch"),
                   options=lw.ExtractOptions(**opts, max_records=64))
    for graph in fresh.glob("*.onnx*"):  # the cache lost the graphs: the resume rebuilds them first
        graph.unlink()
    again = lw.Extractor(tiny_dirs["bert"])
    done = lw.extract(corpus, store, SPEC, model=again, options=lw.ExtractOptions(**opts))
    assert done.status == "complete" and done.resumed_from == 16
    assert "a resume continues on it" in capfd.readouterr().err
    feats, manifest = _features(store)
    assert manifest["runtime"]["name"] == "onnx" and manifest["runtime"]["label"].startswith("onnxruntime ")
    assert [e["runtime"] for e in manifest["shards"]] == ["onnx"] * 5
    clean = tmp_path / "clean"
    lw.extract(corpus, clean, SPEC, model=lw.Extractor(tiny_dirs["bert"], backend="onnx"),
               options=lw.ExtractOptions(**opts))
    np.testing.assert_array_equal(feats, _features(clean)[0])  # bit for bit: one runtime, the same batches


def test_a_small_corpus_runs_on_pytorch_and_the_same_command_gives_the_same_bytes(tiny_dirs, fresh, corpus,
                                                                                  tmp_path, capfd):
    outs = []
    for run in range(2):
        store = tmp_path / f"run{run}"
        lw.extract(corpus, store, SPEC, model=lw.Extractor(tiny_dirs["bert"]),
                   options=lw.ExtractOptions(shard_records=8, progress=False))
        outs.append(_features(store))
    said = capfd.readouterr().err
    assert "PyTorch computes this store (40 records of about" in said and "not worth the wait" in said, said
    (a, ma), (b, mb) = outs
    assert ma["runtime"]["name"] == mb["runtime"]["name"] == "torch"
    np.testing.assert_array_equal(a, b)
    assert not list(fresh.glob("*.onnx")), "a job too small to pay back exported nothing"


def test_a_large_corpus_waits_for_the_compiled_runtime(tiny_dirs, fresh, corpus, tmp_path, monkeypatch, capfd):
    monkeypatch.setattr("layerwise.extraction.runtime.torch_seconds_per_token", lambda ex, depth: 1.0)  # a slow CPU
    ex = lw.Extractor(tiny_dirs["bert"])
    lw.extract(corpus, tmp_path / "s", SPEC, model=ex, options=lw.ExtractOptions(progress=False))
    said = capfd.readouterr().err
    runtime = lw.open_store(tmp_path / "s").manifest["runtime"]
    assert "prepared first" in runtime["why"] and "computes this store" in said, said
    assert ex.backend.races.read(), "the race it ran is recorded for the next job"
    assert runtime["name"] == ex.backend.decisions.decided()[2].runtime


def test_verify_and_inspect_name_the_runtime(tiny_dirs, fresh, corpus, tmp_path, capfd):
    from typer.testing import CliRunner

    store = tmp_path / "s"
    lw.extract(corpus, store, SPEC, model=lw.Extractor(tiny_dirs["bert"], backend="torch"),
               options=lw.ExtractOptions(shard_records=8, progress=False))
    runner = CliRunner()
    ok = runner.invoke(app, ["verify", str(store)])
    assert ok.exit_code == 0 and "computed by torch" in ok.output, ok.output
    shown = runner.invoke(app, ["inspect", str(store)])
    assert "runtime" in shown.output and "torch" in shown.output
    import json

    manifest = json.loads((store / "manifest.json").read_text())
    manifest["shards"][2]["runtime"] = "onnx"  # a store that mixed runtimes is damaged
    (store / "manifest.json").write_text(json.dumps(manifest))
    bad = runner.invoke(app, ["verify", str(store)])
    assert bad.exit_code == 1 and "computed by 'onnx', the store by 'torch'" in bad.output, bad.output
