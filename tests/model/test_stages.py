"""The compiled runtimes' one-layer graphs (ONNX Runtime's and OpenVINO's): rows of a batch leave it at their own
depth, with the states of the full graph, at a measured price, and ``auto`` builds them only where rows of mixed
depths are asked for, on the runtime that serves the depth."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import layerwise as lw
from layerwise.errors import ModelLoadError
from layerwise.model.backends.ort import OnnxBackend, cut_stage
from layerwise.model.backends.ort_stages import OrtStages
from layerwise.model.backends.race import Racer
from layerwise.model.backends.stages import Staged, Stages
from layerwise.model.capture import keep_counts

RUNTIMES = ["onnx", "openvino"]
TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naïve cafés " * 5, "a b c",
         "the quick brown fox jumps over the lazy dog", "x"]


def staged(runtime: str, loaded, cache, **options) -> Staged:
    """The backend of ``runtime`` (skipped where OpenVINO is not installed)."""
    if runtime == "openvino":
        pytest.importorskip("openvino")
        from layerwise.model.backends.openvino import OpenVinoBackend

        return OpenVinoBackend(loaded, cache=cache, **options)
    return OnnxBackend(loaded, cache=cache, **options)


def counted_layers(backend: Staged, monkeypatch) -> list[tuple[int, int]]:
    """Each one-layer graph's runs on ``backend``, as ``(layer, rows fed to the runtime)``, recorded from here on at
    the runtime's boundary (ONNX Runtime's session runs, OpenVINO's infer requests)."""
    runs: list[tuple[int, int]] = []
    stages = backend.stages
    if isinstance(stages, OrtStages):
        real_session = OrtStages.session

        def session(self, layer):
            return _Counting(real_session(self, layer), layer, runs)

        monkeypatch.setattr(OrtStages, "session", session)
    else:
        real_compiled = type(stages).compiled

        def compiled(self, layer):
            graph, requests = real_compiled(self, layer)
            return graph, [_Counting(r, layer, runs) for r in requests]

        monkeypatch.setattr(type(stages), "compiled", compiled)
    return runs


class _Counting:
    """A session or an infer request that records the rows of each run it is given."""

    def __init__(self, inner, layer, runs):
        self.inner, self.layer, self.runs = inner, layer, runs

    def run(self, names, feed):  # ONNX Runtime
        self.runs.append((self.layer, len(feed["attention_mask"])))
        return self.inner.run(names, feed)

    def start_async(self, inputs):  # OpenVINO
        self.runs.append((self.layer, len(inputs["attention_mask"])))
        return self.inner.start_async(inputs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_rows_leave_at_their_depth_with_the_full_graphs_states(tiny_extractors, family, runtime, tmp_path,
                                                               monkeypatch):
    loaded = tiny_extractors[family].loaded
    ov = staged(runtime, loaded, tmp_path)
    deepest = loaded.num_layers
    assert ov.ragged_price(deepest, "block") is None  # nothing built before it is asked for
    price = ov.prepare_ragged(deepest)
    assert price is not None and price >= 1.0 and ov.ragged_price(deepest, "block") == price
    assert len(list(tmp_path.glob(f"*-s{deepest}-*.onnx"))) == 1  # the one-layer graph, cut and cached
    if runtime == "openvino":
        assert len(list(tmp_path.glob(f"*-s{deepest}-openvino-*.blob"))) == 1  # and compiled

    enc = loaded.tokenizer(TEXTS, padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    depths = [2, 2, 1, 1, 0, 0]
    layers = list(range(deepest + 1))
    runs = counted_layers(ov, monkeypatch)
    got = ov.start_ragged(ids, mask, layers, "block", depths)()
    want = ov.forward(ids, mask, layers, "block")
    torch_states = lw.Extractor(loaded, backend="torch").backend.forward(ids, mask, layers, "block")
    keep = keep_counts(depths, deepest)
    assert sum(rows for layer, rows in runs if layer == 2) == keep[2] == 2  # layer 2 ran on its two rows only
    for layer in layers:
        n = len(TEXTS) if layer <= 1 else keep[layer]  # layers 0 and 1 are one graph: every row
        real = mask[:n].bool()
        assert float((got[layer, :n][real] - want[layer, :n][real]).abs().max()) <= 1e-5
        assert float((got[layer, :n][real] - torch_states[layer, :n][real]).abs().max()) <= 1e-4
        assert not got[layer, n:].any()  # rows that did not run a layer hold zeros


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_albert_reads_the_token_ids_in_its_layers_and_runs_whole_graphs(tiny_extractors, runtime, tmp_path, caplog):
    ov = staged(runtime, tiny_extractors["albert"].loaded, tmp_path)
    with caplog.at_level("INFO", logger="layerwise"):
        assert ov.prepare_ragged(2) is None
    label = {"onnx": "ONNX Runtime", "openvino": "OpenVINO"}[runtime]
    assert f"is not run in {label} stages: layers 2..2 of albert-" in caplog.text and "read input_ids" in caplog.text
    enc = ov.loaded.tokenizer(TEXTS, padding=True, return_tensors="pt")
    got = ov.start_ragged(enc["input_ids"], enc["attention_mask"], [2], "block", [2, 2, 1, 1, 0, 0])()
    np.testing.assert_array_equal(got, ov.forward(enc["input_ids"], enc["attention_mask"], [2], "block"))


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_quantised_graphs_are_not_cut(tiny_extractors, runtime, tmp_path):
    if runtime == "openvino":
        pytest.importorskip("nncf")
    ov = staged(runtime, tiny_extractors["bert"].loaded, tmp_path, quantize="int8")
    assert ov.prepare_ragged(2) is None and ov.ragged_price(2, "block") is None
    assert not list(tmp_path.glob("*-s*"))


def test_a_layer_that_reads_more_than_the_state_and_mask_is_refused(tmp_path):
    """A toy graph whose layer 2 reads input_ids itself (not only its shape): no stage can be cut."""
    import onnx
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Unsqueeze", ["ids_f", "axis"], ["hidden_0"]),
             helper.make_node("Add", ["hidden_0", "one"], ["hidden_1"]),
             helper.make_node("Add", ["hidden_1", "hidden_0"], ["hidden_2"])]  # reads the embeddings' output
    graph = helper.make_graph(
        nodes, "toy",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "t"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["b", "t"])],
        [helper.make_tensor_value_info(f"hidden_{i}", TensorProto.FLOAT, ["b", "t", 1]) for i in range(3)],
        [helper.make_tensor("axis", TensorProto.INT64, [1], [2]),
         helper.make_tensor("one", TensorProto.FLOAT, [], [1])])
    base = tmp_path / "toy.onnx"
    onnx.save_model(helper.make_model(graph), str(base))
    with pytest.raises(ModelLoadError, match=r"layers 2\.\.2 of toy\.onnx read input_ids besides hidden_1 and the "
                                             r"attention mask, so they cannot run as a stage"):
        cut_stage(base, 1, 2, tmp_path / "stage.onnx")
    assert not (tmp_path / "stage.onnx").exists()


def auto_on(runtime: str, tiny_extractors, cache, monkeypatch) -> lw.Extractor:
    """``auto`` on the tiny BERT with the graph cache ``cache`` (the session's depth graphs, no stages), its race won
    by ``runtime`` (skipped where auto does not run it)."""
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")
    monkeypatch.setattr("layerwise.model.backends.decisions.pays_back", lambda *args: True)  # prepared at once
    monkeypatch.setattr(Racer, "race", lambda self, depth, runtimes: {"torch": 0.003, runtime: 0.001} |
                        {r: 0.002 for r in runtimes if r != runtime})
    ex = lw.Extractor(tiny_extractors["bert"].loaded, onnx_cache=cache)
    if runtime not in ex.backend.compiled_runtimes:
        pytest.skip(f"auto runs no {runtime} here")
    return ex


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_auto_builds_the_stages_where_mixed_rows_are_asked_and_runs_them(tiny_extractors, runtime, tiny_graph_cache,
                                                                         monkeypatch):
    ex = auto_on(runtime, tiny_extractors, tiny_graph_cache, monkeypatch)
    ex.encode(TEXTS, layers=2)
    assert ex.backend.settle(timeout=120) and ex.backend.runtime_for([2], "block") == runtime
    assert not list(tiny_graph_cache.glob("*-s2-*"))  # one depth asked: no one-layer graph built
    # the first ask for mixed rows: PyTorch's price against the race's winner, while the stages are prepared
    assert ex.backend.ragged_price(2, "block") == pytest.approx(3.0)
    assert ex.backend.settle(timeout=120) and list(tiny_graph_cache.glob("*-s2-*"))
    serving = ex.backend.compiled_runtimes[runtime]
    price = ex.backend.ragged_price(2, "block")
    assert price is not None and price >= 1.0 and price == serving.ragged_price(2, "block")
    assert ex.backend.staged(2) is serving
    runs = counted_layers(serving, monkeypatch)
    specs = [lw.EncodeSpec(layers=2), lw.EncodeSpec(layers=1, pool="cls"), lw.EncodeSpec(layers=[0, 2], combine="mean")]
    texts = [TEXTS, TEXTS[:3], TEXTS[2:]]
    parts = [(ex.tokenize(t, words=False), spec) for t, spec in zip(texts, specs)]
    got: dict[int, dict[int, torch.Tensor]] = {}
    for step in ex.encode_shared(parts, ragged=True):
        for p, result in step:
            got.setdefault(p, {})[result.index] = result.features
    assert runs and all(layer == 2 for layer, _ in runs)
    assert sum(rows for _, rows in runs) == len(TEXTS) + len(TEXTS[2:])  # layer 2: the rows of the parts needing it
    reference = lw.Extractor(ex.loaded, backend="torch")
    for p, (items, spec) in enumerate(zip(texts, specs)):
        want = reference.encode(items, spec.layers, spec.combine, spec.pool)
        np.testing.assert_allclose(np.stack([got[p][i].numpy() for i in range(len(items))]), want, atol=1e-5)


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_auto_offers_the_other_runtimes_chain_priced_against_the_serving_graph(tiny_extractors, runtime,
                                                                               tiny_graph_cache, monkeypatch):
    """Where two compiled runtimes can run a depth, the plan offers each one's chain for rows of mixed depths: the
    serving runtime's at its own price, the other's at its own price times its graph's race time over the serving
    graph's (a service measures which runs its mixed calls faster). A call run on the other runtime's chain gives the
    states of PyTorch, and only that runtime's one-layer graphs ran."""
    ex = auto_on(runtime, tiny_extractors, tiny_graph_cache, monkeypatch)
    other = next((r for r in ex.backend.compiled_runtimes if r != runtime), None)
    if other is None:
        pytest.skip(f"auto runs only {runtime} here")
    ex.encode(TEXTS, layers=2)
    assert ex.backend.settle(timeout=120)
    ex.backend.ragged_prices(2, "block")  # the first ask queues every runtime's stages
    assert ex.backend.settle(timeout=120)
    offers = ex.backend.ragged_prices(2, "block")
    own = ex.backend.compiled_runtimes[runtime].ragged_price(2, "block")
    theirs = ex.backend.compiled_runtimes[other].ragged_price(2, "block")
    assert own is not None and theirs is not None
    assert list(offers) == [runtime, other]  # the serving runtime's own chain first
    assert offers[runtime] == own and offers[other] == pytest.approx(theirs * 2.0)  # race: 0.002 s over 0.001 s
    plan = ex.backend.plan([0, 1, 2], "block")
    with pytest.raises(lw.LayerwiseError, match=f"offered: {runtime}, {other}"):
        plan.chain("tensorflow")
    chained = plan.chain(other)
    assert chained.runtime == runtime and chained.ragged_runtime == other and plan.chain(runtime) is plan
    mine = counted_layers(ex.backend.compiled_runtimes[runtime], monkeypatch)
    runs = counted_layers(ex.backend.compiled_runtimes[other], monkeypatch)
    specs = [lw.EncodeSpec(layers=2), lw.EncodeSpec(layers=1, pool="cls")]
    parts = [(ex.tokenize(t, words=False), spec) for t, spec in zip([TEXTS, TEXTS[:3]], specs)]
    got: dict[int, dict[int, torch.Tensor]] = {}
    for step in ex.encode_shared(parts, ragged=True, plan=chained):
        for p, result in step:
            got.setdefault(p, {})[result.index] = result.features
    assert runs and not mine and sum(rows for _, rows in runs) == len(TEXTS)  # layer 2: only the rows needing it
    reference = lw.Extractor(ex.loaded, backend="torch")
    for p, (items, spec) in enumerate(zip([TEXTS, TEXTS[:3]], specs)):
        want = reference.encode(items, spec.layers, spec.combine, spec.pool)
        np.testing.assert_allclose(np.stack([got[p][i].numpy() for i in range(len(items))]), want, atol=1e-5)


def test_a_deeper_chain_covers_the_shallower_depths(tiny_extractors, tmp_path, monkeypatch):
    """A chain prepared for depth D holds the stages of every shallower depth, checked and timed: a mixed call whose
    deepest row is shallower is served at D's price, with no new build or timing (each new depth re-timed the chain
    in the background while a server was under load). A chain that does not run in stages covers nothing."""
    ov = OnnxBackend(tiny_extractors["bert"].loaded, cache=tmp_path)
    measured: list[int] = []
    outcome = {5: 1.1, 8: None, 9: 1.2}
    monkeypatch.setattr(Stages, "_measure",
                        lambda self, depth, alone: measured.append(depth) or outcome.get(depth))
    assert ov.prepare_ragged(5) == 1.1
    assert [ov.ragged_price(d, "block") for d in (1, 2, 3, 4, 5, 6)] == [None, 1.1, 1.1, 1.1, 1.1, None]
    assert ov.prepare_ragged(3) == 1.1 and ov.stages.prepared(4) and measured == [5]
    assert ov.prepare_ragged(8) is None and ov.prepare_ragged(7) is None and measured == [5, 8, 7]
    assert ov.prepare_ragged(9) == 1.2 and ov.prepare_ragged(6) == 1.2 and measured == [5, 8, 7, 9]


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_auto_times_the_stages_with_the_machine_to_themselves(tiny_extractors, runtime, tiny_graph_cache,
                                                              monkeypatch):
    """``auto`` prepares the stages in the background while its caller runs; the chain is timed with the caller's
    next forward pass held (and its running ones let finish), so the price is the chain's alone, not its share of a
    busy machine. The held pass runs as soon as the timing ends, with the right states."""
    import threading

    from tiny import wait_until

    ex = auto_on(runtime, tiny_extractors, tiny_graph_cache, monkeypatch)
    want = ex.encode(TEXTS, layers=2)
    assert ex.backend.settle(timeout=120)
    activity = ex.backend.preparer.activity
    held: list[bool] = []
    features: list[np.ndarray] = []
    real = Stages._measure

    def measure(self, depth, alone):  # each runtime's stages (the serving one's, then the others')
        got: list[np.ndarray] = []
        caller = threading.Thread(target=lambda: got.append(ex.encode(TEXTS, layers=2)))
        with alone():
            caller.start()
            # the caller's pass reaches the gate and waits there while the chain is timed (seen, not slept on)
            wait_until(lambda: activity.held() > 0 or got, 30, "the caller's pass at the timing gate")
            held.append(not got and activity.held() == 1)
        caller.join(60)
        features.extend(got)
        return real(self, depth, alone)

    monkeypatch.setattr(Stages, "_measure", measure)
    ex.backend.ragged_price(2, "block")  # queues the stages' preparation in the background
    assert ex.backend.settle(timeout=120)
    assert held and all(held) and ex.backend.ragged_price(2, "block") is not None
    for got in features:
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_runtime_error_while_building_the_stages_is_said_once_and_not_retried(tiny_extractors, tmp_path,
                                                                                monkeypatch, caplog):
    """A session or a conversion that fails while the stages are built leaves the depth unstaged (its mixed rows run
    as segments): said once in the log, the price ``None``, and never built again by the calls that follow."""
    ob = OnnxBackend(tiny_extractors["bert"].loaded, cache=tmp_path)
    tried: list[int] = []

    def ready(self, layer):
        tried.append(layer)
        raise RuntimeError("no room left on the device")

    monkeypatch.setattr(OrtStages, "ready", ready)
    with caplog.at_level("WARNING", logger="layerwise"):
        assert ob.prepare_ragged(2) is None and ob.prepare_ragged(2) is None
    assert tried == [2] and ob.ragged_price(2, "block") is None and ob.stages.prepared(2)
    assert "preparing layers 2..2 failed: RuntimeError: no room left on the device" in caplog.text
