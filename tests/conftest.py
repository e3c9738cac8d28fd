"""Shared fixtures: tiny random models of every family (built once per session) and the real default model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import session_tmp

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's start-up notices (the tests' own processes)
# exported ONNX graphs (backend "auto"/"onnx") go to a fresh cache per test session, shared with the subprocesses,
# in the session's own folder (removed at its end, or by the next session if this one is killed)
os.environ.setdefault("LAYERWISE_CACHE", str(session_tmp.ROOT / "cache"))
# "auto" takes ONNX Runtime wherever it is exact, without timing it against PyTorch, so the tests check that path
# on every machine (test_auto.py checks the timed choice with LAYERWISE_AUTO_RUNTIME=fastest)
os.environ.setdefault("LAYERWISE_AUTO_RUNTIME", "onnx")

import layerwise as lw  # noqa: E402
from archs import ARCHS  # noqa: E402
from archs import build as build_arch  # noqa: E402

from tiny import FAMILIES, build  # noqa: E402

SENTENCES = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn",
    ".",
    "The quick brown fox jumps over the lazy dog, again and again and again!",
    "naïve cafés",
    "a",
]


@pytest.fixture(autouse=True)
def _notices_said():
    """A CLI command run in-process with -q silences layerwise's notices for the process: each test starts loud."""
    from layerwise import notices

    notices.set_quiet(False)
    yield


@pytest.fixture
def eager_preparation(monkeypatch):
    """``auto`` prepares a depth after the caller's first pass there: its pay-back gate (a job too short to pay for a
    conversion starts none; tested in test_auto.py) opened, for the tests of what the preparation does."""
    monkeypatch.setattr("layerwise.model.backends.decisions.pays_back", lambda *args: True)


@pytest.fixture(scope="session")
def tiny_graphs(tmp_path_factory, tiny_extractors) -> Path:
    """A graph cache holding the tiny BERT's compiled graphs, built once per session: its export, the cuts of depths
    1 and 2 and their OpenVINO blobs (where installed), float32 and int8 (ONNX Runtime's dynamic int8, OpenVINO's
    int8 weights); no one-layer stages, no race. Tests of what ``auto`` decides start from a copy
    (:func:`tiny_graph_cache`) instead of exporting and compiling again in child processes."""
    from layerwise.model.backends import OnnxBackend, OpenVinoBackend
    from layerwise.model.backends.openvino import openvino_available

    root = tmp_path_factory.mktemp("tiny-graphs")
    loaded = tiny_extractors["bert"].loaded
    runtimes = [OnnxBackend(loaded, cache=root), OnnxBackend(loaded, cache=root, quantize="int8")]
    if openvino_available():
        runtimes += [OpenVinoBackend(loaded, exporter=runtimes[0]),
                     OpenVinoBackend(loaded, exporter=runtimes[0], quantize="int8")]
    for backend in runtimes:
        backend.warm([0, 1])
        backend.warm([0, 1, 2])
    (root / "races.json").unlink(missing_ok=True)
    return root


@pytest.fixture
def tiny_graph_cache(tiny_graphs, tmp_path) -> Path:
    """A fresh graph cache (``tmp_path / "graphs"``) holding a copy of :func:`tiny_graphs`' (no races, no locks)."""
    import shutil

    target = tmp_path / "graphs"
    target.mkdir()
    for path in tiny_graphs.iterdir():
        if path.is_file():
            shutil.copy2(path, target / path.name)
    return target


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {fam: build(fam, root / fam) for fam in FAMILIES}


@pytest.fixture(scope="session")
def tiny_extractors(tiny_dirs) -> dict[str, lw.Extractor]:
    return {fam: lw.Extractor(str(path), device="cpu") for fam, path in tiny_dirs.items()}


@pytest.fixture(scope="session")
def arch_dirs(tmp_path_factory, tiny_dirs) -> dict[str, Path]:
    """Tiny models of every architecture of ``tests/archs.py`` (the 7 families included)."""
    root = tmp_path_factory.mktemp("archs")
    return {**tiny_dirs, **{name: build_arch(name, root / name) for name in ARCHS}}


@pytest.fixture(scope="session")
def llama_service(arch_dirs) -> str:
    """The service on the tiny random Llama of ``tests/archs.py`` (a decoder), served by uvicorn in a thread of this
    process for the whole session (its own Extractor, as a served process has): its base URL."""
    from layerwise.serve import create_app

    from tiny import serve_in_thread

    with serve_in_thread(create_app(lw.Extractor(str(arch_dirs["llama"]), device="cpu"))) as url:
        yield url


@pytest.fixture(scope="session")
def arch_extractors(arch_dirs, tiny_extractors) -> dict[str, lw.Extractor]:
    return {**tiny_extractors, **{n: lw.Extractor(str(arch_dirs[n]), device="cpu") for n in ARCHS}}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def default_extractor() -> lw.Extractor:
    return lw.Extractor(device="cpu")


@pytest.fixture(scope="session")
def sentences() -> list[str]:
    return list(SENTENCES)


def pytest_configure(config: pytest.Config) -> None:
    """The suite's time budget (:mod:`budget`): durations to a file, limits checked at the end."""
    import budget

    if not config.pluginmanager.is_registered(budget):
        config.pluginmanager.register(budget, "layerwise-budget")


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the pip-built environments of the collected tests that will run (SAELens's, Infinity's, the demo's) in the
    background (:mod:`prebuilt`): their minutes overlap the rest of the suite. Nothing is started for
    ``--collect-only`` (no test runs, and the session would wait for the builds)."""
    import shutil

    import prebuilt

    if session.config.option.collectonly:
        return

    modules = {item.module.__name__: item.module for item in session.items if hasattr(item, "module")}
    if {"test_activations", "test_doc_examples"} & set(modules):
        import sae_env

        sae_env.start()  # SAELens and sparsify's environment (first: its tests come first)
    if "test_export_servers" in modules and (os.environ.get("LAYERWISE_CI") or
                                             os.environ.get("LAYERWISE_SIDE_SERVERS")):
        prebuilt.start("infinity", modules["test_export_servers"].infinity_environment)
    if "test_dev" in modules and shutil.which("python3") is not None:
        prebuilt.start("demo", modules["test_dev"].demo_environment)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import prebuilt

    prebuilt.clean()
    session_tmp.clean()
