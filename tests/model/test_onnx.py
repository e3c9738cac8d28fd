"""ONNX Runtime backend: same results as PyTorch (<= 1e-4) for every family, graph ends at the deepest layer."""

from __future__ import annotations

import numpy as np
import pytest

import layerwise as lw
import layerwise.model.backends.ort as ob

pytest.importorskip("onnxruntime")

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", ".", "naïve cafés " * 40]


@pytest.fixture(scope="module")
def onnx_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx")


@pytest.mark.parametrize("layers", ["all", 1, [0, 2]])
def test_onnx_equals_torch_every_family(tiny_extractors, family, layers, onnx_cache):
    ref = tiny_extractors[family]
    ex = lw.Extractor(ref.loaded, backend="onnx", onnx_cache=onnx_cache, max_length=24)  # long text: windows
    torch_ex = lw.Extractor(ref.loaded, max_length=24)
    got = ex.encode(TEXTS, layers=layers, combine="concat", pool="mean")
    want = torch_ex.encode(TEXTS, layers=layers, combine="concat", pool="mean")
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    for g, w in zip(ex.encode(TEXTS, layers=layers, pool=None), torch_ex.encode(TEXTS, layers=layers, pool=None)):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


def test_onnx_default_model_words(default_extractor, tmp_path):
    ex = lw.Extractor(default_extractor.loaded, backend="onnx", onnx_cache=tmp_path)
    words = [t.split() for t in TEXTS if t]
    for g, w in zip(ex.encode_words(words, layers="-4:"), default_extractor.encode_words(words, layers="-4:")):
        np.testing.assert_allclose(g, w, atol=1e-4, rtol=0)


def test_export_is_cached_and_truncated(tiny_extractors, tmp_path, monkeypatch):
    onnx = pytest.importorskip("onnx")
    calls = []
    real = ob.export
    monkeypatch.setattr(ob, "export", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    loaded = tiny_extractors["bert"].loaded
    lw.Extractor(loaded, backend="onnx", onnx_cache=tmp_path).encode(TEXTS, layers=1)
    lw.Extractor(loaded, backend="onnx", onnx_cache=tmp_path).encode(TEXTS, layers=1)  # a new process would too
    assert calls == [2]  # the tiny model is exported once, whole
    lw.Extractor(loaded, backend="onnx", onnx_cache=tmp_path).encode(TEXTS, layers=2)
    assert calls == [2]  # depth 2: cut from it
    sizes = {}
    for path in tmp_path.glob("*-d[12]-*.onnx"):
        graph = onnx.load(str(path)).graph
        sizes[len([n for n in graph.node if n.op_type == "MatMul"])] = path
    assert len(sizes) == 2  # the layer-1 graph holds fewer matrix products: nothing after layer 1 exists


def test_onnx_errors(tiny_extractors, tmp_path):
    loaded = tiny_extractors["bert"].loaded
    with pytest.raises(ValueError, match="unknown backend 'jax'. Valid backends are: auto, torch, onnx, openvino, "
                                         "keras, tf"):
        lw.Extractor(loaded, backend="jax")
    ex = lw.Extractor(loaded, backend="onnx", onnx_cache=tmp_path)
    with pytest.raises(ValueError, match="site .attention. is not available for this model with this backend; "
                       "it offers block"):
        ex.encode(["x"], layers=1, site="attention")


def test_a_copy_for_export_never_carries_a_captures_hooks(tiny_extractors, monkeypatch):
    """auto exports in a background thread while the caller captures: the copy for the export waits for the
    capture, so it never carries the capture's hooks (which stopped the export's trace with their early exit). The
    model's lock is watched: the copy reaches it while the capture holds it, and enters only once the capture let
    go (no timed wait)."""
    import threading

    loaded = tiny_extractors["bert"].loaded
    monkeypatch.setattr(loaded, "ensure_depth", lambda depth: None)  # as a model loaded whole (no block to read)
    ex = lw.Extractor(loaded, backend="torch")
    inside, release, tried = threading.Event(), threading.Event(), threading.Event()
    entered: list[bool] = []  # for the copy: whether the capture had been let go when it entered
    copied: dict = {}
    copying = threading.Thread(target=lambda: copied.setdefault("model", ob.truncated_copy(loaded, 1)))

    class Watched:
        def __init__(self, inner):
            self.inner = inner

        def __enter__(self):
            mine = threading.current_thread() is copying
            if mine:
                tried.set()
            self.inner.__enter__()
            if mine:
                entered.append(release.is_set())
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    monkeypatch.setattr(loaded, "lock", Watched(loaded.lock))
    handle = loaded.layer_map.layers[0].register_forward_hook(
        lambda m, a, o: (inside.set(), release.wait(30)) and None)
    try:
        capturing = threading.Thread(target=lambda: ex.encode(["hello there"], layers=1))
        capturing.start()
        assert inside.wait(30)  # the capture's hooks are on the modules now
        copying.start()
        assert tried.wait(30)  # the copy is at the model's lock, which the capture holds
        assert "model" not in copied
        release.set()
        capturing.join(30)
        copying.join(30)
        assert entered == [True]  # it entered only after the capture was let go
        hooks = [h for m in copied["model"].modules() for h in (*m._forward_hooks.values(),
                                                               *m._forward_pre_hooks.values())]
        assert hooks and not [h for h in hooks if type(getattr(h, "__self__", None)).__name__ == "Recorder"]
    finally:
        release.set()
        handle.remove()
