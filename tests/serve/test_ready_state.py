"""``/ready`` tells the truth about the warmed depths only: once they are prepared it stays 200, whatever other depths
requests ask for and the background prepares meanwhile (those are listed in ``preparing``)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from layerwise.serve.ready import Readiness


class Backend:
    """A backend whose background preparation the test drives: ``pending`` is what it says is being prepared."""

    name = "torch"

    def __init__(self) -> None:
        self.pending_depths: list[int] = [2]
        self.warmed: list[int] = []
        self.release = threading.Event()

    def warm(self, layers):
        self.warmed.append(max(layers))

    def pending(self):
        if self.release.is_set() and 2 in self.pending_depths:
            self.pending_depths.remove(2)
        return list(self.pending_depths)


def test_ready_waits_for_the_warmed_depths_and_then_stays_ready():
    backend = Backend()
    ready = Readiness(SimpleNamespace(backend=backend), [2]).start()
    state = ready.state()
    assert state["ready"] is False and state["pending"] == [2] and state["depths"] == {"2": "preparing"}
    backend.release.set()  # the warmed depth's preparation ends
    assert ready.done.wait(10)
    assert ready.state() == {"ready": True, "depths": {"2": "torch"}, "pending": [], "preparing": [], "error": None}
    backend.pending_depths.append(5)  # a request at an unwarmed depth: its preparation runs in the background
    state = ready.state()
    assert state["ready"] is True and state["pending"] == [] and state["preparing"] == [5], state
    backend.pending_depths.append(2)  # stages of a warmed depth asked by mixed requests: still ready
    assert ready.state()["ready"] is True


def test_a_named_runtime_serves_other_depths_from_its_warmed_graphs(tiny_extractors, tiny_graph_cache):
    """``--backend onnx``: the warmed depth (the last layer) is compiled before ``/ready``; a request for layer 1
    then runs on it (the same features as PyTorch's), and no graph of depth 1 is opened on the request's path."""
    import numpy as np
    import pytest
    from fastapi.testclient import TestClient

    import layerwise as lw
    from layerwise.serve import create_app

    pytest.importorskip("onnxruntime")
    ex = lw.Extractor(tiny_extractors["bert"].loaded, backend="onnx", onnx_cache=tiny_graph_cache)
    last = ex.num_layers
    with TestClient(create_app(ex)) as client:
        readiness = client.app.state.readiness
        assert readiness.done.wait(120) and readiness.error is None
        assert client.get("/ready").json()["ready"] is True
        assert ex.backend.served == (last,) and ex.backend.depth_for([1]) == last
        got = client.post("/v1/encode", json={"texts": ["hello world"], "layers": 1, "pool": "mean"})
        assert got.status_code == 200, got.text
        assert sorted(ex.backend._sessions) == [last], "a depth nobody warmed was compiled on the request's path"
        ex.backend._open(1)  # a graph opened before (the one-layer stages' head is the depth-1 graph): used as it is
        assert ex.backend.depth_for([0, 1]) == 1
    want = tiny_extractors["bert"].encode(["hello world"], layers=1, pool="mean")
    assert np.abs(np.asarray(got.json()["vectors"]) - want).max() < 1e-4
