"""The graph cache is bounded and visible (issue 37): least recently used entries go when a build passes the limit,
said in one line; `layerwise cache` lists it and --clear empties it; nothing but layerwise's own files is touched."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.model.backends.cache import GraphCache, cache_limit

pytest.importorskip("onnxruntime")


def _entry(root, name, size, age, suffixes=(".onnx",)):
    for suffix in suffixes:
        path = root / f"{name}{suffix}"
        path.write_bytes(b"\0" * size)
        os.utime(path, (age, age))


def test_least_recently_used_go_first_and_only_layerwise_files(tmp_path):
    root = tmp_path / "onnx"
    (root / "openvino-blobs").mkdir(parents=True)
    _entry(root, "bert-d1-aaa", 100, 1_000)
    _entry(root, "bert-d2-openvino-bbb", 100, 2_000, (".xml", ".bin"))  # 200 bytes, one entry
    _entry(root, "bert-d3-ccc", 100, 3_000)
    _entry(root / "openvino-blobs", "123", 50, 500, (".blob",))
    (root / "races.json").write_text("{}")
    (root / "notes.txt").write_text("mine")  # not layerwise's: never counted, never removed
    cache = GraphCache(root)
    assert [e.name for e in cache.entries()] == ["openvino-blobs/123.blob", "bert-d1-aaa", "bert-d2-openvino-bbb",
                                                 "bert-d3-ccc"]
    assert cache.total() == 450
    removed = cache.trim(300, keep=(root / "bert-d1-aaa.onnx",))  # the oldest is kept: it was just built
    assert [e.name for e in removed] == ["openvino-blobs/123.blob", "bert-d2-openvino-bbb"]
    assert sorted(p.name for p in root.iterdir() if p.is_file()) == ["bert-d1-aaa.onnx", "bert-d3-ccc.onnx",
                                                                     "notes.txt", "races.json"]
    GraphCache.touch(root / "bert-d1-aaa.onnx")  # used now: the other is older
    assert [e.name for e in cache.entries()] == ["bert-d3-ccc", "bert-d1-aaa"]


def test_the_limit(monkeypatch):
    monkeypatch.delenv("LAYERWISE_CACHE_LIMIT", raising=False)
    assert cache_limit(10**9) == 3 * 10**9 and cache_limit(10) == 256 * 2**20
    monkeypatch.setenv("LAYERWISE_CACHE_LIMIT", "2GB")
    assert cache_limit(10**9) == 2 * 10**9
    monkeypatch.setenv("LAYERWISE_CACHE_LIMIT", "lots")
    with pytest.raises(lw.ModelLoadError, match="LAYERWISE_CACHE_LIMIT must be a size such as '4GB'"):
        cache_limit()


def test_a_build_past_the_limit_evicts_and_says_so(tiny_extractors, tmp_path, monkeypatch, capfd):
    """Real builds of the tiny model's depths, beside an older entry, under a limit that holds the model's graphs
    but not the older one: the build evicts it (never the exported graph its cuts read), and the line says the path,
    the size, the limit and what went."""
    loaded = tiny_extractors["bert"].loaded
    backend = lw.model.backends.OnnxBackend(loaded, cache=tmp_path)
    first = backend.build(1)
    _entry(tmp_path, "bert-d9-older", 400_000, 1_000)  # another model's graph, used long ago
    ours = GraphCache(tmp_path).total() - 400_000
    monkeypatch.setenv("LAYERWISE_CACHE_LIMIT", f"{ours + 3 * first.stat().st_size}B")
    capfd.readouterr()
    second = backend.build(2)
    said = capfd.readouterr().err
    assert first.exists() and second.exists() and not (tmp_path / "bert-d9-older.onnx").exists()
    assert backend.intact(1) and backend.intact(2)
    assert "removed the 1 least recently used" in said
    assert f"graph cache {tmp_path}: " in said and "limit (LAYERWISE_CACHE_LIMIT)" in said, said
    assert "list or clear it with `layerwise cache`" in said


def test_the_command_lists_and_clears(tmp_path):
    root = tmp_path / "onnx"
    root.mkdir()
    _entry(root, "bert-d1-aaa", 1000, 1_000)
    (root / "races.json").write_text("{}")
    (root / "notes.txt").write_text("mine")
    runner = CliRunner()
    listed = runner.invoke(app, ["cache", "--dir", str(root), "--json"])
    assert listed.exit_code == 0, listed.output
    assert '"name": "bert-d1-aaa"' in listed.stdout and '"bytes": 1000' in listed.stdout
    cleared = runner.invoke(app, ["cache", "--dir", str(root), "--clear"])
    assert cleared.exit_code == 0 and "removed 1 cached graphs" in cleared.stdout
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]
