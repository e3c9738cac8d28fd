"""backend="openvino": the export converted once per depth with float32 weights, an explicit precision hint (fp32
exact, bf16 when asked), the batch across async infer requests, and what it refuses."""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch

import layerwise as lw
import layerwise.model.backends.openvino as ovb
from layerwise.model.hardware import PrecisionWarning, native_on_cpu

pytest.importorskip("openvino")

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", ".", "naïve cafés " * 40, "a b c"]


def test_exact_for_every_family_at_every_layer(tiny_extractors, family, tmp_path):
    ex = lw.Extractor(tiny_extractors[family].loaded, backend="openvino", onnx_cache=tmp_path, max_length=24)
    reference = lw.Extractor(ex.loaded, backend="torch", max_length=24)
    for got, want in zip(ex.encode(TEXTS, layers="all", pool=None), reference.encode(TEXTS, layers="all", pool=None)):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    assert ex.describe()["precision"] == "float32" and ex.sites == ("block",)


def test_default_model_equals_output_hidden_states(default_extractor, tmp_path):
    ex = lw.Extractor(default_extractor.loaded, backend="openvino", onnx_cache=tmp_path)
    enc = ex.tokenizer(TEXTS[:3], padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.stack(ex.model(**enc, output_hidden_states=True).hidden_states)
    got = ex.hidden_states(TEXTS[:3], layers="all").tensor
    mask = enc["attention_mask"].bool()
    assert float((got[:, mask] - want[:, mask]).abs().max()) <= 1e-5
    settings = ex.backend.settings(list(range(7)))
    assert settings["precision"] == "f32" and settings["hint"] == "THROUGHPUT" and settings["streams"] >= 1
    assert settings["threads"] == torch.get_num_threads()


BF16_CPU = native_on_cpu(torch.bfloat16)  # OpenVINO honours the bf16 hint only where the CPU has bf16


def bf16_openvino(loaded, cache):
    """OpenVINO asked for bf16: on a CPU without bf16 it says it runs float32 (a PrecisionWarning) and does."""
    if BF16_CPU:
        return ovb.OpenVinoBackend(loaded, precision="bfloat16", cache=cache)
    with pytest.warns(PrecisionWarning, match=r"OpenVINO runs float32, not bfloat16, on this CPU: it has none of "
                                              r"avx512_bf16, amx_bf16.*a store records precision 'float32'"):
        return ovb.OpenVinoBackend(loaded, precision="bfloat16", cache=cache)


def test_precision_is_always_explicit(default_extractor, tmp_path):
    """fp32 means fp32 (OpenVINO would pick bf16 by itself on a bf16 CPU); bf16 only when asked, and it is close;
    on a CPU without bf16 the backend says it runs float32, records float32, and its states are exact."""
    fp32 = lw.Extractor(default_extractor.loaded, backend="openvino", onnx_cache=tmp_path)
    bf16 = bf16_openvino(default_extractor.loaded, tmp_path)
    ran = "bfloat16" if BF16_CPU else "float32"
    assert bf16.precision == ran and bf16.settings([6])["precision"] == ovb.PRECISION_HINTS[ran]
    enc = fp32.tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    a, b = fp32.backend.forward(ids, mask, [6], "block")[0], bf16.forward(ids, mask, [6], "block")[0]
    cos = torch.nn.functional.cosine_similarity(a[mask.bool()], b[mask.bool()], dim=-1)
    gap = float((a - b).abs().max())
    assert float(cos.min()) > 0.99 and (gap > 1e-4 if BF16_CPU else gap <= 1e-5)  # really bf16, or really exact
    # compiled from the float32 ONNX graph, no IR copy of its weights (none in float16): the blob is all it adds
    assert fp32.backend.path_for(6).exists() and fp32.backend.path_for(6).suffix == ".blob"
    assert not list(tmp_path.glob("*.xml")) and not list(tmp_path.glob("*.bin"))


def test_a_compiled_precision_other_than_the_one_asked_is_refused(tiny_extractors, tmp_path, monkeypatch):
    """Should OpenVINO ever compile in another precision than the hint (a plugin's own choice), the backend
    refuses rather than record a precision that did not run."""
    backend = ovb.OpenVinoBackend(tiny_extractors["bert"].loaded, cache=tmp_path)
    real = backend.ov.Core

    class Reports:  # the compiled model as OpenVINO gives it, but reporting f16 inference
        def __init__(self, compiled):
            self.compiled = compiled

        def __getattr__(self, name):
            return getattr(self.compiled, name)

        def get_property(self, name):
            return backend.ov.Type.f16 if name == "INFERENCE_PRECISION_HINT" else self.compiled.get_property(name)

    class Core:
        def __init__(self):
            self.core = real()

        def __getattr__(self, name):
            return getattr(self.core, name)

        def compile_model(self, *args):
            return Reports(self.core.compile_model(*args))

        def import_model(self, *args):
            return Reports(self.core.import_model(*args))

    monkeypatch.setattr(backend.ov, "Core", Core)
    with pytest.raises(lw.ModelLoadError, match=r"OpenVINO compiled layers 0..2 in f16, not the f32 asked for "
                                                r"\(compute_dtype='float32'\) on this CPU"):
        backend.settings([2])


def test_load_runs_bfloat16_through_the_hint_and_a_store_records_it(tmp_path):
    ran = "bfloat16" if BF16_CPU else "float32"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        ex = lw.Extractor(backend="openvino", compute_dtype="bfloat16", onnx_cache=tmp_path / "cache")
    assert BF16_CPU or any("OpenVINO runs float32, not bfloat16" in str(w.message) for w in said)
    assert ex.backend.precision == ran and ex.backend.loaded.dtype == torch.float32  # converted from fp32
    src = tmp_path / "in.txt"
    src.write_text("I love Paris\nEU rejects German call\n")
    lw.extract(src, tmp_path / "s", lw.EncodeSpec(layers=-1, pool="mean"), model=ex)
    assert lw.open_store(tmp_path / "s").manifest["model"]["precision"] == ran


def test_converted_once_per_depth_and_read_from_the_cache(tiny_extractors, tmp_path, monkeypatch, capfd):
    calls = []
    real = ovb.OpenVinoBackend.build
    monkeypatch.setattr(ovb.OpenVinoBackend, "build", lambda self, depth: calls.append(
        (depth, self.path_for(depth).exists())) or real(self, depth))
    loaded = tiny_extractors["bert"].loaded
    first = lw.Extractor(loaded, backend="openvino", onnx_cache=tmp_path)
    first.encode(TEXTS, layers=2)
    first.encode(TEXTS, layers=[0, 1, 2], combine="concat")  # the same graph, compiled once
    assert calls == [(2, False)] and "to OpenVINO in" in capfd.readouterr().err
    lw.Extractor(loaded, backend="openvino", onnx_cache=tmp_path).encode(TEXTS, layers=2)  # a new process
    assert calls == [(2, False), (2, True)] and "to OpenVINO in" not in capfd.readouterr().err
    assert len(list(tmp_path.glob("*-openvino-*.blob"))) == 1 and not list(tmp_path.glob("*.xml"))  # no IR copy


def test_a_batch_larger_or_smaller_than_the_streams(tiny_extractors, tmp_path):
    ex = lw.Extractor(tiny_extractors["roberta"].loaded, backend="openvino", onnx_cache=tmp_path)
    reference = lw.Extractor(ex.loaded, backend="torch")
    for texts in (TEXTS[:1], TEXTS * 7):
        np.testing.assert_allclose(ex.encode(texts, layers=[2, 0], combine="concat"),
                                   reference.encode(texts, layers=[2, 0], combine="concat"), atol=1e-5, rtol=0)


def test_what_it_refuses(tiny_extractors, arch_extractors):
    loaded = tiny_extractors["bert"].loaded
    with pytest.raises(ValueError, match=r"backend='openvino' exports the BERT-family encoders of the family table; "
                                         r"this llama model's layers were discovered at load: use backend='torch'"):
        lw.Extractor(arch_extractors["llama"].loaded, backend="openvino")
    with pytest.raises(ValueError, match=re.escape("backend='openvino' runs compute_dtype 'float16', which it does not "
                                                   "offer. Valid values are: float32, bfloat16")):
        lw.Extractor(backend="openvino", compute_dtype="float16")
    with pytest.raises(ValueError, match=r"site 'attention' is not available .* it offers block"):
        lw.Extractor(loaded, backend="openvino").encode(["x"], layers=1, site="attention")
    with pytest.raises(ValueError, match=r"unknown quantize 'int4'. Valid values are: none, int8"):
        lw.Extractor(loaded, backend="openvino", quantize="int4")


def test_auto_races_openvino_where_installed(tiny_extractors, tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "openvino")
    ex = lw.Extractor(tiny_extractors["deberta-v2"].loaded, onnx_cache=tmp_path)
    reference = lw.Extractor(ex.loaded, backend="torch")
    np.testing.assert_allclose(ex.encode(TEXTS, layers="all", combine="mean"),
                               reference.encode(TEXTS, layers="all", combine="mean"), atol=1e-5, rtol=0)
    assert ex.backend.runtime_for([2], "block") == "openvino"
    assert ex.describe()["runtime"].startswith("openvino ")


def test_int8_weights_keep_the_layers(default_extractor, tmp_path, capfd):
    """quantize="int8": every weight product's weights in int8 (NNCF), close to float32 at every layer, faster to
    load (a quarter of the weights' bytes), and NNCF's progress display never on stdout."""
    pytest.importorskip("nncf")
    fp32 = lw.Extractor(default_extractor.loaded, backend="torch")
    q = lw.Extractor(default_extractor.loaded, backend="openvino", quantize="int8", onnx_cache=tmp_path)
    assert q.describe()["precision"] == "int8-weights" and q.sites == ("block",)
    for layer in (1, 3, 6):
        a, b = q.encode(TEXTS, layers=layer), fp32.encode(TEXTS, layers=layer)
        cos = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
        assert cos.min() > 0.99 and np.abs(a - b).max() > 1e-5, layer  # close, and really quantised
    out = capfd.readouterr().out
    assert out == "", out
    xml = q.backend.ir_path(6).read_text()
    assert xml.count('element_type="u8"') >= 36  # the 6 x (q, k, v, out, up, down) weights, compressed
    fp32_weights = q.backend.onnx.export_files(6)[1]  # the float32 export's weights
    assert q.backend.ir_path(6).with_suffix(".bin").stat().st_size < 0.4 * fp32_weights.stat().st_size
    assert q.backend.path_for(6).stat().st_size < 0.4 * fp32_weights.stat().st_size  # its compiled blob too
    settings = q.backend.compiled([6])[0]
    assert int(settings.get_property("DYNAMIC_QUANTIZATION_GROUP_SIZE")) == ovb.DYNAMIC_QUANTIZATION_GROUP


def test_auto_bfloat16_races_pytorch_and_openvino_bf16(tiny_extractors, tiny_dirs, tmp_path, monkeypatch,
                                                       eager_preparation):
    """compute_dtype="bfloat16" under auto: PyTorch bf16 and OpenVINO's bf16 hint, each checked against the other
    token by token (cosine >= BF16_AGREE) and timed; the precision is bfloat16 whichever serves."""
    from layerwise.model.backends.auto import BF16_AGREE

    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    if not BF16_CPU:  # OpenVINO would run float32 here: PyTorch bf16 alone serves, and the load said it is slow
        with pytest.warns(PrecisionWarning, match="has none of avx512_bf16, amx_bf16, so bfloat16 runs emulated"):
            ex = lw.Extractor(str(tiny_dirs["bert"]), device="cpu", compute_dtype="bfloat16", onnx_cache=tmp_path)
        assert ex.backend.openvino is None and ex.backend.onnx is None and ex.describe()["precision"] == "bfloat16"
        ex.encode(TEXTS, layers=-1)
        assert ex.backend.runtime_for([2], "block") == "torch" and ex.describe()["runtime"].startswith("torch ")
        pytest.skip("the race of PyTorch bf16 and OpenVINO bf16 needs a CPU with avx512_bf16 or amx_bf16; "
                    "on this one PyTorch bf16 alone serving is what was checked")
    ex = lw.Extractor(str(tiny_dirs["bert"]), device="cpu", compute_dtype="bfloat16", onnx_cache=tmp_path)
    assert ex.backend.openvino is not None and ex.backend.onnx is None and ex.describe()["precision"] == "bfloat16"
    torch_bf16 = lw.Extractor(ex.loaded, backend="torch")
    got, want = ex.encode(TEXTS, layers="all", combine="mean"), torch_bf16.encode(TEXTS, layers="all", combine="mean")
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1) + 1e-12)
    assert cos[np.linalg.norm(want, axis=1) > 0].min() >= BF16_AGREE
    assert ex.backend.settle(timeout=120)  # the race ran in the background
    said = ex.describe()["runtime"]
    assert "at depths [2] (exact; " in said and "a batch on batches of 64x16, 32x32, 16x64, 8x128" in said, said
    assert ex.backend.runtime_for([2], "block") in ("torch", "openvino")
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "openvino")
    chosen = lw.Extractor(ex.loaded, onnx_cache=tmp_path)
    chosen.encode(TEXTS, layers=-1)
    assert chosen.backend.runtime_for([2], "block") == "openvino"
    assert chosen.describe()["runtime"].startswith("openvino ") and " bf16 " in chosen.describe()["runtime"]
    assert chosen.backend.openvino.settings([2])["precision"] == "bf16"


def test_reduced_precision_measures_its_fidelity_once_and_says_when_it_misses(default_extractor, tmp_path,
                                                                               monkeypatch):
    """The first use of a depth compares the quantised runtime with PyTorch float32 on the sample sentences; a miss
    of the precision's target is a PrecisionWarning with the numbers, once; describe() shows the measurement."""
    pytest.importorskip("nncf")
    from layerwise.model import fidelity
    from layerwise.model.hardware import PrecisionWarning

    q = lw.Extractor(default_extractor.loaded, backend="openvino", quantize="int8", onnx_cache=tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)  # int8 weights keep the default model's layers: no warning
        q.encode(TEXTS, layers=3)
    measured = q.describe()["fidelity"]["3"]
    assert measured["precision"] == "int8-weights" and len(measured["min_cosine"]) == 4
    assert min(measured["min_cosine"]) > 0.99 and measured["texts"] == len(fidelity.sample_texts())

    monkeypatch.setitem(fidelity.TARGETS, "int8-weights", 0.999999)
    strict = lw.Extractor(default_extractor.loaded, backend="openvino", quantize="int8", onnx_cache=tmp_path)
    with pytest.warns(PrecisionWarning, match=r"int8-weights on .* keeps a minimum cosine of 0\.9\d+ to float32 at "
                                              r"layer 2 on layerwise's 9 sample sentences \(target 0\.999999; per "
                                              r"layer: "):
        strict.encode(TEXTS, layers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PrecisionWarning)
        strict.encode(TEXTS, layers=2)  # said once per depth
    assert "fidelity" not in lw.Extractor(default_extractor.loaded, backend="openvino").describe()


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_int8_full_quantizes_activations_and_states_its_fidelity(default_extractor, tmp_path, capfd):
    """quantize="int8-full": weights and activations in int8 (FakeQuantize on the products' inputs), calibrated on
    texts of the bundled sample (its first 64 here: the calibration's cost is per text and product, and the whole
    sample of 256 is what a user gets by default); the calibration's measured error and the products kept in float
    are in describe(), beside the fidelity on the sample sentences; auto serves it through OpenVINO, and nothing
    reaches stdout."""
    pytest.importorskip("nncf")
    from layerwise.model.backends.openvino_int8 import calibration_texts

    assert len(calibration_texts()) == 256  # the default: the bundled sample
    sample = tmp_path / "calibration.txt"
    sample.write_text("\n".join(calibration_texts()[:64]), encoding="utf-8")
    q = lw.Extractor(default_extractor.loaded, quantize="int8-full", quantize_calibration=str(sample),
                     onnx_cache=tmp_path)  # auto
    fp32 = lw.Extractor(default_extractor.loaded, backend="torch")
    assert q.describe()["precision"] == "int8-full" and q.sites == ("block",)
    a, b = q.encode(TEXTS, layers=-1), fp32.encode(TEXTS, layers=-1)
    cos = _cosines(a, b)
    assert cos.min() > 0.9 and np.abs(a - b).max() > 1e-4  # close, and really quantised
    measured = q.describe()["fidelity"]["6"]
    report = measured["calibration"]
    assert measured["precision"] == "int8-full" and len(measured["min_cosine"]) == 7
    assert report["calibration_texts"] == 64 and report["matmuls"] >= 36
    assert 0 < report["error"] <= report["error_all_int8"] < 0.05
    shares = [s["share"] for s in report["most_sensitive"]]
    assert shares == sorted(shares, reverse=True) and len(shares) == 5
    assert "int8 weights and activations" in q.describe()["runtime"]
    assert q.backend.runtime_for([6], "block") == "openvino"
    xml = q.backend.openvino.ir_path(6).read_text()
    assert xml.count('type="FakeQuantize"') >= 36 - len(report["kept_in_float"])
    assert capfd.readouterr().out == ""


def test_int8_full_keeps_the_measured_most_sensitive_products_in_float(tiny_extractors, tmp_path, monkeypatch):
    """The products kept in float are those whose quantiser alone carries the most measured error: with the share
    threshold at 0 the ranking's head is kept, up to a quarter of the products, and the graph has no quantiser on
    them; a calibration file of the user's own texts is a different graph (its sha256 is in the cache key)."""
    pytest.importorskip("nncf")
    import layerwise.model.backends.openvino_int8 as int8

    monkeypatch.setattr(int8, "KEEP_SHARE", -1.0)
    texts = tmp_path / "mine.txt"
    topics = ["cats", "tax law", "GPUs"] * 20
    texts.write_text("\n".join(f"sentence number {i} about {w}" for i, w in enumerate(topics)), encoding="utf-8")
    loaded = tiny_extractors["bert"].loaded
    q = lw.Extractor(loaded, backend="openvino", quantize="int8-full", quantize_calibration=str(texts),
                     onnx_cache=tmp_path)
    q.encode(TEXTS, layers=2)
    report = q.describe()["fidelity"]["2"]["calibration"]
    assert report["calibration_texts"] == 60 and report["calibration_sha256"] == int8.texts_digest(
        int8.calibration_texts(str(texts)))
    kept = report["kept_in_float"]
    assert 0 < len(kept) <= int8.MAX_KEPT_SHARE * report["matmuls"]
    assert set(report["most_sensitive"][0]["matmuls"]) <= set(kept)  # the measured head of the ranking
    import openvino as ov

    graph = ov.Core().read_model(str(q.backend.ir_path(2)))
    still = {name for _, names in int8.activation_quantizers(graph) for name in names}
    assert not still & set(kept) and still
    bundled = lw.Extractor(loaded, backend="openvino", quantize="int8-full", onnx_cache=tmp_path)
    assert bundled.backend.ir_path(2) != q.backend.ir_path(2) and bundled.backend.path_for(2) != q.backend.path_for(2)


def test_int8_full_refusals(tiny_extractors, tmp_path, monkeypatch):
    import sys

    loaded = tiny_extractors["bert"].loaded
    with pytest.raises(lw.ModelLoadError, match=r"quantize='int8-full' runs on OpenVINO \(pip install "
                                                r"'layerwise\[openvino\]'; backend='auto' or 'openvino'\), not "
                                                r"backend='onnx'"):
        lw.Extractor(loaded, backend="onnx", quantize="int8-full")
    with pytest.raises(lw.ModelLoadError, match=r"quantize_calibration='t.txt' calibrates quantize='int8-full', not "
                                                r"quantize='int8'"):
        lw.ModelOptions(quantize="int8", quantize_calibration="t.txt")
    with pytest.raises(lw.ModelLoadError, match=r"quantize='int8-full' runs its float parts in float32, not "
                                                r"compute_dtype='bfloat16'"):
        lw.Extractor(loaded, backend="openvino", quantize="int8-full", compute_dtype="bfloat16")
    with pytest.raises(lw.ModelLoadError, match=r"quantize_calibration=.*missing.txt.* cannot be read"):
        lw.Extractor(loaded, quantize="int8-full", quantize_calibration=str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("\n \n", encoding="utf-8")
    with pytest.raises(lw.ModelLoadError, match=r"holds no text: give a UTF-8 text file with one text a line"):
        lw.Extractor(loaded, quantize="int8-full", quantize_calibration=str(tmp_path / "empty.txt"))
    monkeypatch.setitem(sys.modules, "nncf", None)  # the [openvino] extra without NNCF
    with pytest.raises(lw.MissingExtraError, match=r"quantize='int8-full' .*pip install 'layerwise\[openvino\]'"):
        lw.Extractor(loaded, quantize="int8-full")


def test_a_depth_serves_no_other_thread_before_its_fidelity_is_measured(tiny_graph_cache, tiny_extractors,
                                                                       monkeypatch):
    """A reduced-precision graph runs its fidelity check on its own infer requests: another thread asking for the
    same depth meanwhile waits for the check, and never starts a batch on those requests (which failed a CI run
    with OpenVINO's "Infer Request is busy")."""
    import threading

    import layerwise.model.backends.openvino as module

    backend = ovb.OpenVinoBackend(tiny_extractors["bert"].loaded, cache=tiny_graph_cache, quantize="int8")
    inside, release, order = threading.Event(), threading.Event(), []
    real = module.measure_fidelity

    def measured(b, depth):
        inside.set()
        assert release.wait(60)
        result = real(b, depth)
        order.append("measured")
        return result

    monkeypatch.setattr(module, "measure_fidelity", measured)
    opening = threading.Thread(target=backend.warm, args=([0, 1],))
    opening.start()
    assert inside.wait(120)  # the graph is open and its fidelity check about to run
    other = threading.Thread(target=lambda: (backend.compiled([0, 1]), order.append("served")))
    other.start()
    release.set()
    opening.join(120)
    other.join(120)
    assert order == ["measured", "served"] and backend.fidelity[1]
