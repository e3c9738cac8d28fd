"""backend="auto" (the default): the fastest exact runtime (ONNX Runtime, OpenVINO, PyTorch) per depth, PyTorch
elsewhere; the race once per model, off the caller's path, kept per machine; quantize="int8"."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import layerwise as lw
import layerwise.model.backends.openvino as ovb
import layerwise.model.backends.ort as ob
from layerwise.model.backends import AutoBackend, TorchBackend
from layerwise.model.backends.auto import RaceRecord
from layerwise.model.backends.race import Racer

COMPILED = ("onnx", "openvino")

pytest.importorskip("onnxruntime")

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", ".", "naïve cafés " * 40]


def test_default_is_auto_and_exact_for_every_family(tiny_extractors, family):
    ex = lw.Extractor(tiny_extractors[family].loaded, max_length=24)  # a long text: windows
    reference = lw.Extractor(ex.loaded, backend="torch", max_length=24)
    assert ex.backend.name == "auto" and isinstance(ex.backend, AutoBackend)
    for got, want in zip(ex.encode(TEXTS, layers="all", pool=None), reference.encode(TEXTS, layers="all", pool=None)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert ex.backend.runtime_for([0, 2], "block") in COMPILED, ex.backend.runtime()  # a compiled runtime served it
    assert "for the block site at depths [2]" in ex.describe()["runtime"] and ex.describe()["precision"] == "float32"


def test_default_model_matches_hidden_states(default_extractor):
    ex = lw.Extractor(default_extractor.loaded)
    enc = ex.tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    with torch.no_grad():
        hs = ex.model(**enc, output_hidden_states=True).hidden_states
    got = ex.hidden_states(TEXTS[:2], layers="all")
    assert ex.backend.runtime_for(list(range(7)), "block") in COMPILED
    mask = enc["attention_mask"].bool()
    want = torch.stack(hs)
    assert float((got.tensor[:, mask] - want[:, mask]).abs().max()) <= 1e-5


def test_other_sites_run_on_torch(tiny_extractors):
    ex = lw.Extractor(tiny_extractors["bert"].loaded)
    reference = lw.Extractor(ex.loaded, backend="torch")
    for site in ("attention", "intermediate", "pre_ln"):
        got, want = ex.encode(TEXTS, layers=1, site=site), reference.encode(TEXTS, layers=1, site=site)
        np.testing.assert_array_equal(got, want)
    assert ex.backend.runtime_for([1], "attention") == "torch"


def test_inexact_graph_falls_back_to_torch(tiny_extractors, monkeypatch, eager_preparation):
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    ex = lw.Extractor(tiny_extractors["roberta"].loaded)
    real = ob.OnnxBackend.forward
    monkeypatch.setattr(ob.OnnxBackend, "forward", lambda self, *a: real(self, *a) + 1e-3)
    real_ov = ovb.OpenVinoBackend.forward
    monkeypatch.setattr(ovb.OpenVinoBackend, "forward", lambda self, *a: real_ov(self, *a) + 1e-3)
    reference = lw.Extractor(ex.loaded, backend="torch")
    np.testing.assert_array_equal(ex.encode(TEXTS, layers=-1), reference.encode(TEXTS, layers=-1))
    assert ex.backend.settle(timeout=120)
    assert ex.backend.runtime_for([2], "block") == "torch"
    np.testing.assert_array_equal(ex.encode(TEXTS, layers=-1), reference.encode(TEXTS, layers=-1))
    inexact = "ONNX Runtime, OpenVINO" if ex.backend.openvino is not None else "ONNX Runtime"
    assert f"torch at depths [2] ({inexact} not within 1e-05 of PyTorch there)" in ex.backend.runtime()


def test_fastest_exact_runtime_is_timed_once_per_model(tiny_extractors, monkeypatch, tiny_graph_cache,
                                                        eager_preparation):
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    ex = lw.Extractor(tiny_extractors["bert"].loaded, onnx_cache=tiny_graph_cache)
    times = ex.backend.racer.race(2)  # the real race: every available runtime ran
    assert set(times) == {"torch", *ex.backend.compiled_runtimes} and all(0 < s < 5 for s in times.values())
    calls = []

    def fake(self, depth, runtimes):  # ONNX Runtime fastest
        calls.append(depth)
        return {"torch": 0.002, "onnx": 0.001} | {r: 0.003 for r in runtimes if r != "onnx"}

    monkeypatch.setattr(Racer, "race", fake)
    reference = lw.Extractor(ex.loaded, backend="torch")
    for layers in (1, 2, 1, [0, 2]):
        np.testing.assert_allclose(ex.encode(TEXTS, layers=layers), reference.encode(TEXTS, layers=layers), atol=1e-5)
        assert ex.backend.settle(timeout=120)
    assert calls == [1]  # once per model, at the first depth asked for
    assert ex.backend.runtime_for([1], "block") == "onnx" and ex.backend.runtime_for([2], "block") == "onnx"
    said = ex.backend.runtime()
    assert "for the block site at depths [1] (exact; fastest here: 1.0 ms vs PyTorch's 2.0 ms" in said, said
    assert "raced at depth 1 once for the model" in said and "at depths [2] (exact; fastest here" in said, said
    # rows leave a batch early on PyTorch only: a token-layer there costs what the race measured against the winner
    assert ex.backend.ragged_price(2, "block") == pytest.approx(2.0)

    again = lw.Extractor(ex.loaded, onnx_cache=tiny_graph_cache)  # a later process on this machine: no race
    for layers in (2, 1):
        again.encode(TEXTS, layers=layers)
        assert again.backend.settle(timeout=120)
    assert calls == [1] and again.backend.runtime_for([2], "block") == "onnx"
    assert "(timed earlier on this machine)" in again.backend.runtime()
    record = json.loads((tiny_graph_cache / "races.json").read_text())
    assert len(record) == 1 and all(set(t) == {"torch", *ex.backend.compiled_runtimes} for t in record.values())


def test_when_pytorch_wins_no_later_depth_is_exported(tiny_extractors, monkeypatch, tiny_graph_cache,
                                                       eager_preparation):
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    monkeypatch.setattr(Racer, "race", lambda self, depth, runtimes: {"torch": 0.001} | {r: 0.002 for r in
                                                                                                runtimes})
    built = []
    real = ob.OnnxBackend.build
    monkeypatch.setattr(ob.OnnxBackend, "build", lambda self, depth: built.append(depth) or real(self, depth))
    ex = lw.Extractor(tiny_extractors["bert"].loaded, onnx_cache=tiny_graph_cache)
    for layers in (1, 2, 0):
        ex.encode(TEXTS, layers=layers)
        assert ex.backend.settle(timeout=120)
    assert built == [1] and ex.backend.runtime_for([2], "block") == "torch"
    assert ex.backend.ragged_price(2, "block") == 1.0  # PyTorch serves: rows leave early at its own price
    assert "torch at depths [2] (PyTorch fastest here: 1.0 ms" in ex.backend.runtime()


def test_the_first_call_never_waits_for_the_race(tiny_extractors, monkeypatch, tiny_graph_cache, eager_preparation):
    """A fresh cache: the first vector comes back while the race is still running (held here until the test lets
    it go); then the winner takes over and gives the same states."""
    import threading
    import time

    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    release, when = threading.Event(), {}
    real = Racer.race

    def held(self, depth, runtimes):
        when["race started"] = time.monotonic()
        assert release.wait(120)
        times = real(self, depth, runtimes)
        when["race finished"] = time.monotonic()
        return {name: (0.0 if name == "onnx" else s) for name, s in times.items()}  # ONNX Runtime wins

    monkeypatch.setattr(Racer, "race", held)
    ex = lw.Extractor(tiny_extractors["bert"].loaded, onnx_cache=tiny_graph_cache)
    reference = lw.Extractor(ex.loaded, backend="torch")
    first = ex.encode(TEXTS, layers=-1)
    when["first vector"] = time.monotonic()
    try:
        assert ex.backend.pending() == [2] and ex.backend.runtime_for([2], "block") == "torch"
        assert "torch at depths [2] (while the compiled runtimes are prepared in the background)" in \
            ex.backend.runtime()
        np.testing.assert_array_equal(first, reference.encode(TEXTS, layers=-1))
    finally:
        release.set()
    assert ex.backend.settle(timeout=120) and ex.backend.runtime_for([2], "block") == "onnx"
    assert when["first vector"] < when["race finished"]
    np.testing.assert_allclose(ex.encode(TEXTS, layers=-1), first, atol=1e-5, rtol=0)
    assert ex.backend.prepared[2] > 0


def test_a_job_too_short_to_pay_back_starts_no_conversion(tiny_extractors, monkeypatch, tiny_graph_cache):
    """The default path: a script's few texts run on PyTorch and touch no graph (even where the cache holds them);
    the caller's work at a depth counts, and once it says a compiled runtime pays back (a job runs about as long again
    as it has), the depth is prepared."""
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")

    def cache():
        return {p.name: p.stat().st_mtime_ns for p in tiny_graph_cache.iterdir()}

    before = cache()
    ex = lw.Extractor(tiny_extractors["bert"].loaded, onnx_cache=tiny_graph_cache)
    for _ in range(3):
        ex.encode(TEXTS, layers=-1)
    assert ex.backend.settle(timeout=10) and ex.backend.pending() == [] and ex.backend.prepared == {}
    assert ex.backend.runtime_for([2], "block") == "torch" and cache() == before
    busy = ex.backend.decisions.preparation_seconds(2)
    assert busy > 0
    ex.backend.decisions.spent(2, busy * 100)  # a long job's work at depth 2 so far
    assert ex.backend.pending() == [2] and ex.backend.settle(timeout=120)
    assert ex.backend.runtime_for([2], "block") in COMPILED and ex.backend.prepared[2] > 0


def test_race_record_is_keyed_by_what_decides_a_race(tmp_path):
    w, v, pair, cpu, versions = "w" * 64, "v" * 64, ["torch", "onnx"], "EPYC", {"torch": "2", "onnx": "1"}
    key = RaceRecord.key(w, 2, pair, cpu, versions)
    others = [RaceRecord.key(w, 4, pair, cpu, versions), RaceRecord.key(v, 2, pair, cpu, versions),
              RaceRecord.key(w, 2, [*pair, "openvino"], cpu, versions), RaceRecord.key(w, 2, pair, "Xeon", versions),
              RaceRecord.key(w, 2, pair, cpu, {**versions, "onnx": "2"})]  # threads, weights, runtimes, CPU, versions
    assert len({key, *others}) == 6 and RaceRecord.key(w, 2, pair[::-1], cpu, versions) == key
    record = RaceRecord(tmp_path)
    assert record.get(key) is None
    record.put(key, {"torch": 0.2, "onnx": 0.1})
    RaceRecord(tmp_path).put("other", {"torch": 1.0})  # another process adds its own: both kept
    assert record.get(key) == {"torch": 0.2, "onnx": 0.1} and record.get("other") == {"torch": 1.0}
    (tmp_path / "races.json").write_text("{not json")  # a damaged cache reads as empty and is rewritten
    assert record.get(key) is None
    record.put(key, {"torch": 0.2})
    assert record.get(key) == {"torch": 0.2}


def test_runtime_choice_from_environment(tiny_extractors, monkeypatch):
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "torch")
    ex = lw.Extractor(tiny_extractors["bert"].loaded)
    ex.encode(TEXTS, layers=-1)
    assert ex.backend.runtime_for([2], "block") == "torch" and "(LAYERWISE_AUTO_RUNTIME=torch)" in ex.backend.runtime()
    for choice in COMPILED:
        monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", choice)
        ex = lw.Extractor(tiny_extractors["bert"].loaded)
        ex.encode(TEXTS, layers=-1)
        if choice in ex.backend.compiled_runtimes:
            assert ex.backend.runtime_for([2], "block") == choice
            assert f"exact; LAYERWISE_AUTO_RUNTIME={choice})" in ex.backend.runtime()
            assert ex.backend.ragged_price(2, "block") is None  # a runtime named: rows never move to PyTorch
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "gpu")
    with pytest.raises(ValueError, match="LAYERWISE_AUTO_RUNTIME='gpu' is not a choice. Valid values are: fastest, "
                                         "onnx, openvino, torch"):
        lw.Extractor(tiny_extractors["bert"].loaded).encode(TEXTS, layers=-1)


def test_torch_when_onnx_cannot_serve(arch_extractors, tiny_extractors):
    llama = lw.Extractor(arch_extractors["llama"].loaded)  # layers discovered at load: not exported
    assert llama.backend.onnx is None and "family table" in llama.backend.runtime()
    left = lw.Extractor(tiny_extractors["bert"].loaded, padding_side="left")
    assert left.backend.onnx is None and "pads on the right, not 'left'" in left.backend.runtime()
    assert isinstance(left.backend.torch, TorchBackend) and left.backend.torch.padding_side == "left"


def test_one_export_per_model_every_depth_a_cut_of_it(tiny_extractors, tmp_path, monkeypatch, capfd):
    """The model is exported once, whole; each depth is a graph cut from it (milliseconds) that reads the exported
    weights (one copy on disk); layer choices with one deepest layer share a graph, and so do processes; a cut whose
    exported graph the cache evicted is rebuilt."""
    calls = []
    real = ob.export
    monkeypatch.setattr(ob, "export", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    loaded = tiny_extractors["electra"].loaded
    first = lw.Extractor(loaded, onnx_cache=tmp_path)
    reference = lw.Extractor(loaded, backend="torch")
    first.encode(TEXTS, layers=2)
    first.encode(TEXTS, layers=[0, 1, 2], combine="concat")  # same deepest layer: same graph
    assert calls == [2]
    assert "to ONNX once for every depth" in capfd.readouterr().err  # the first-use export time is said
    assert set(first.backend.onnx.export_seconds) == {2}
    np.testing.assert_allclose(first.encode(TEXTS, layers=1), reference.encode(TEXTS, layers=1), atol=1e-5)
    assert calls == [2] and "cut layers 0..1" in capfd.readouterr().err  # a new depth: a cut, no export
    lw.Extractor(loaded, onnx_cache=tmp_path).encode(TEXTS, layers=[2, 0])  # a new process reads the cache
    assert calls == [2]
    assert len(list(tmp_path.glob("*-all2-*.onnx"))) == 1 and len(list(tmp_path.glob("*-all2-*.onnx.data"))) == 1
    cuts = sorted(tmp_path.glob("*-d[12]-*.onnx"))
    assert len(cuts) == 2 and all(c.stat().st_size < 200_000 for c in cuts)  # no weights in a cut
    for base in tmp_path.glob("*-all2-*"):  # evicted by the cache
        base.unlink()
    again = lw.Extractor(loaded, onnx_cache=tmp_path)
    np.testing.assert_allclose(again.encode(TEXTS, layers=1), reference.encode(TEXTS, layers=1), atol=1e-5)
    assert calls == [2, 2]


def test_cache_directory_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path))
    assert ob.cache_dir() == tmp_path / "onnx"
    assert ob.cache_dir(tmp_path / "mine") == tmp_path / "mine"


def test_int8_dynamic_on_onnx_runtime(default_extractor):
    fp32 = lw.Extractor(default_extractor.loaded, backend="torch")
    q = lw.Extractor(default_extractor.loaded, quantize="int8", backend="onnx")
    assert q.describe()["precision"] == "int8" and q.sites == ("block",)
    a, b = q.encode(TEXTS, layers=-1), fp32.encode(TEXTS, layers=-1)
    cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cos.min() > 0.95 and np.abs(a - b).max() > 1e-4  # close, and really quantised
    import onnx

    graph = onnx.load(str(q.backend.path_for(6, "int8"))).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulInteger") == 36  # the 6 x (q, k, v, out, up, down) weight products
    assert ops.count("MatMul") == 12  # attention scores and context stay float32


def test_quantize_errors(tiny_extractors, arch_extractors):
    loaded = tiny_extractors["bert"].loaded
    with pytest.raises(ValueError, match=r"unknown quantize 'int4'. Valid values are: none, int8"):
        lw.Extractor(loaded, quantize="int4")
    with pytest.raises(ValueError, match=r"quantize='int8' runs through OpenVINO or ONNX Runtime: use backend='auto' "
                       r"\(the default\), 'openvino' or 'onnx', not backend='torch'"):
        lw.Extractor(loaded, backend="torch", quantize="int8")
    with pytest.raises(ValueError, match=r"quantize='int8' runs through OpenVINO or ONNX Runtime, which exports the "
                                         r"BERT-family"):
        lw.Extractor(arch_extractors["llama"].loaded, quantize="int8")
    q = lw.Extractor(loaded, quantize="int8")
    with pytest.raises(ValueError, match=r"site 'attention' is not available .* it offers block"):
        q.encode(["x"], layers=1, site="attention")


def test_store_refuses_to_mix_precisions(tiny_extractors, tmp_path, tiny_graph_cache):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(f"sentence number {i}" for i in range(6)) + "\n")
    loaded = tiny_extractors["bert"].loaded
    spec = lw.EncodeSpec(layers=-1, pool="mean")
    lw.extract(src, tmp_path / "s", spec, model=lw.Extractor(loaded, quantize="int8", onnx_cache=tiny_graph_cache))
    runtime = lw.open_store(tmp_path / "s").manifest["runtime"]
    assert runtime["name"] in COMPILED and "quantize='int8' runs on" in runtime["why"]  # what computed it, named
    assert {e["runtime"] for e in lw.open_store(tmp_path / "s").manifest["shards"]} == {runtime["name"]}
    with pytest.raises(Exception, match="precision"):
        lw.extract(src, tmp_path / "s", spec, model=lw.Extractor(loaded))


def test_auto_int8_keeps_the_layers_on_openvino_where_installed(default_extractor, monkeypatch):
    """quantize="int8" under auto: OpenVINO's int8 weights where the extra is installed (precision "int8-weights"),
    else ONNX Runtime's dynamic int8 (precision "int8"): the recipe is said, and a store never mixes them."""
    q = lw.Extractor(default_extractor.loaded, quantize="int8")
    if q.backend.openvino is None:
        assert q.describe()["precision"] == "int8" and "dynamic" in q.describe()["runtime"]
        return
    assert q.describe()["precision"] == "int8-weights" and "with int8 weights (nncf" in q.describe()["runtime"]
    monkeypatch.setattr("layerwise.model.backends.policy.openvino_available", lambda: False)
    assert lw.Extractor(default_extractor.loaded, quantize="int8").describe()["precision"] == "int8"


def test_int8_is_timed_against_float32_once_and_said_when_slower(tiny_extractors, monkeypatch, tiny_graph_cache,
                                                                 capfd):
    """quantize="int8": the int8 runtimes are timed against each other and float32 once, off the caller's path;
    where every one is slower (here: timings that say so), one line says it and names the faster exact path, and
    describe() records the measurement. The real timing runs too: its numbers are recorded whatever they are."""
    ex = lw.Extractor(tiny_extractors["bert"].loaded, quantize="int8", onnx_cache=tiny_graph_cache)
    ex.encode(TEXTS, layers=-1)
    assert ex.backend.settle(timeout=300)
    real = ex.describe()["int8_timing"]
    assert set(real["ms_per_batch"]) >= {"int8 ONNX Runtime", "float32 PyTorch", "float32 ONNX Runtime"}, real
    assert all(t > 0 for t in real["ms_per_batch"].values()) and isinstance(real["slower"], bool)
    monkeypatch.setattr("layerwise.model.backends.quantized.timed", lambda loaded, depth, contestants, *rest: {
        name: (0.002 if name.startswith("int8") else 0.001 if name == "float32 ONNX Runtime" else 0.003)
        for name in contestants})
    slow = lw.Extractor(tiny_extractors["bert"].loaded, quantize="int8", onnx_cache=tiny_graph_cache)
    capfd.readouterr()
    slow.encode(TEXTS, layers=-1)
    assert slow.backend.settle(timeout=300)
    said = capfd.readouterr().err
    assert "quantize='int8' is slower than float32 on this CPU" in said and "against float32 ONNX Runtime 1.0 " \
        "ms a batch; drop quantize for the faster, exact path" in said, said
    assert slow.describe()["int8_timing"]["slower"] is True
