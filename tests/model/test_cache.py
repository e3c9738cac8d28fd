"""The graph cache is bounded and visible (issue 37) and shared by every process (issue 51): least recently used
entries go when a build passes the limit, said in one line, never one a live process holds; every write goes through
one put (temporary directory, rename, trim) under cross-process locks, so two processes build a graph once; `layerwise
cache` lists it with its holders and the dead processes' temporary files, and --clear empties it; nothing but
layerwise's own files is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.model.backends.cache import LOCKS, GraphCache, cache_limit

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
    assert cache_limit(10**9) == 5 * 10**9 and cache_limit(10) == 256 * 2**20
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
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt"]  # no lock file left either


def _ended_pid() -> int:
    """The PID of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _write(*names: str, size: int = 100, fail: bool = False):
    def write(tmp: Path) -> None:
        for name in names:
            (tmp / name).write_bytes(b"\0" * size)
        if fail:
            raise RuntimeError("the exporter failed")
    return write


def test_put_renames_the_entry_in_whole_and_leaves_nothing_of_a_failed_write(tmp_path):
    """A write that raises leaves no temporary file and no entry; a write's companions come in with it, its scratch
    files do not; a write that forgets its main file is refused, and leaves nothing either."""
    cache = GraphCache(tmp_path)
    with pytest.raises(RuntimeError, match="the exporter failed"):
        cache.put(tmp_path / "g.onnx", _write("g.onnx.data", "g.onnx", fail=True))
    assert not [p for p in tmp_path.iterdir() if p.name != LOCKS], list(tmp_path.iterdir())
    assert cache.put(tmp_path / "g.onnx", _write("g.onnx.data", "g.onnx", ".scratch.pt", "notes.txt"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["g.onnx", "g.onnx.data"]
    assert not cache.put(tmp_path / "g.onnx", _write("g.onnx", fail=True))  # there already: not written again
    with pytest.raises(lw.LayerwiseError, match="building h.onnx wrote no h.onnx"):
        cache.put(tmp_path / "h.onnx", _write("h.onnx.data"))
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["g.onnx", "g.onnx.data"]
    assert [e.name for e in cache.entries()] == ["g"] and cache.total() == 200


def test_the_limit_holds_after_every_write(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERWISE_CACHE_LIMIT", "1000B")
    cache = GraphCache(tmp_path)
    for i in range(8):
        assert cache.put(tmp_path / f"g{i}.blob", _write(f"g{i}.blob", f"g{i}.json", size=150))
        assert cache.total() <= 1000 and (tmp_path / f"g{i}.blob").exists()
    assert [e.name for e in cache.entries()] == ["g5", "g6", "g7"]
    assert [e.name for e in cache.removed][:2] == ["g0", "g1"]


PUT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from layerwise.model.backends.cache import GraphCache
    root = Path(sys.argv[1])
    def write(tmp):
        with open(root / "builds.txt", "a") as f:
            f.write("built\\n")
        time.sleep(1.5)
        (tmp / "g.onnx").write_bytes(b"graph")
    print(GraphCache(root).put(root / "g.onnx", write), flush=True)
""")


def test_two_processes_build_a_graph_once(tmp_path):
    """Two processes ask for the same graph at once: one builds it, the other waits for it and uses it."""
    procs = [subprocess.Popen([sys.executable, "-c", PUT, str(tmp_path)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    assert sorted(out.strip() for out, _ in outs) == ["False", "True"], outs
    assert (tmp_path / "builds.txt").read_text() == "built\n"
    assert (tmp_path / "g.onnx").read_bytes() == b"graph"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


HOLD = textwrap.dedent("""
    import sys
    from pathlib import Path
    from layerwise.model.backends.cache import GraphCache
    root = Path(sys.argv[1])
    lease = GraphCache(root).lease(root / "held.onnx", root / "held.onnx.data")
    print("held" if lease else "gone", flush=True)
    sys.stdin.read()
""")


def test_a_graph_another_process_holds_is_never_evicted(tmp_path):
    """A second process holds a lease on an entry (its session open): a trim from this process skips it, and the
    listing names the holder; once that process is killed, its lease is stale and the entry goes."""
    _entry(tmp_path, "held", 300, 1_000, (".onnx", ".onnx.data"))
    _entry(tmp_path, "free", 300, 2_000)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        cache = GraphCache(tmp_path)
        assert {e.name: e.holders for e in cache.entries()} == {"held": [holder.pid], "free": []}
        assert [e.name for e in cache.trim(0)] == ["free"]
        assert (tmp_path / "held.onnx").exists() and (tmp_path / "held.onnx.data").exists()
        listed = json.loads(CliRunner().invoke(app, ["cache", "--dir", str(tmp_path), "--json"]).stdout)
        assert listed["entries"][0]["held_by"] == [holder.pid]
    finally:
        holder.kill()
        holder.wait()
    assert [e.name for e in GraphCache(tmp_path).trim(0)] == ["held"]
    assert not list((tmp_path / LOCKS).glob("*.lease-*"))  # the dead process's lease went with it


def test_a_lease_is_refused_for_an_evicted_graph_and_held_here(tmp_path):
    _entry(tmp_path, "g", 100, 1_000)
    cache = GraphCache(tmp_path)
    assert cache.lease(tmp_path / "g.onnx", tmp_path / "gone.onnx") is None
    lease = cache.lease(tmp_path / "g.onnx")
    again = cache.lease(tmp_path / "g.onnx")  # two holders in one process: one lease file
    assert cache.entries()[0].holders == [os.getpid()] and cache.trim(0) == []
    lease.release()
    assert cache.entries()[0].holders == [os.getpid()]
    again.release()
    assert cache.entries()[0].holders == [] and [e.name for e in cache.trim(0)] == ["g"]


def test_dead_processes_temporary_files_are_counted_and_cleared(tmp_path):
    """What a killed build left (its process's PID in the name, or an earlier version's export leftovers) is listed
    and counted, the listed total is what is on disk, and --clear removes it, but not a live process's write."""
    root = tmp_path / "onnx"
    root.mkdir()
    _entry(root, "bert-d1-aaa", 1000, 1_000)
    dead = root / f".bert-all6-bbb.tmp-{_ended_pid()}-1a2b"
    dead.mkdir()
    (dead / "bert-all6-bbb.onnx.data").write_bytes(b"\0" * 5000)
    (root / ".export-model-x1y2.pt").write_bytes(b"\0" * 700)
    stale = root / f".bert-d2-openvino-ccc.tmp-{_ended_pid()}.bin"  # an earlier version's temporary file
    stale.write_bytes(b"\0" * 300)
    live = root / f".bert-d3-ddd.tmp-{os.getpid()}-9z9z"
    live.mkdir()
    (live / "bert-d3-ddd.onnx").write_bytes(b"\0" * 50)
    (root / "races.json").write_text("{}")
    (root / "notes.txt").write_text("mine")
    runner = CliRunner()
    listed = json.loads(runner.invoke(app, ["cache", "--dir", str(root), "--json"]).stdout)
    assert listed["bytes"] == _on_disk(root) == 1000 + 5000 + 700 + 300 + 50 + 2 + 4
    assert listed["dead_bytes"] == 6000 and listed["entries_bytes"] == 1000
    assert sorted((Path(t["path"]).name, t["dead"]) for t in listed["temporary"]) == sorted([
        (dead.name, True), (stale.name, True), (live.name, False), (".export-model-x1y2.pt", True)])
    said = runner.invoke(app, ["cache", "--dir", str(root)]).stdout
    assert "3 temporary files of dead processes" in said and "being written by" in said, said
    cleared = runner.invoke(app, ["cache", "--dir", str(root), "--clear"])
    assert "removed 1 cached graphs (1 kB) and 3 temporary files of dead processes" in cleared.stdout, \
        cleared.stdout
    assert sorted(p.name for p in root.iterdir()) == sorted([live.name, "notes.txt"])


def test_a_trim_removes_dead_processes_temporary_files(tmp_path):
    stale = tmp_path / f".g.onnx.tmp-{_ended_pid()}"
    stale.write_bytes(b"\0" * 10)
    GraphCache(tmp_path).put(tmp_path / "h.onnx", _write("h.onnx"))
    assert not stale.exists() and (tmp_path / "h.onnx").exists()


KILLED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from layerwise.model.backends.cache import GraphCache
    root = Path(sys.argv[1])
    def write(tmp):
        (tmp / "g.onnx.data").write_bytes(b"x" * 4096)
        print("writing", flush=True)
        time.sleep(60)
    GraphCache(root).put(root / "g.onnx", write)
""")


def test_a_build_killed_midway_leaves_only_what_the_next_one_removes(tmp_path):
    """kill -9 during a build: its half-written entry is a dead process's temporary directory, never in the cache;
    its build lock died with it (the next build does not wait), and that build's trim removes what it left."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.kill()
    proc.wait()
    cache = GraphCache(tmp_path)
    [left] = cache.temps()
    assert left.dead and left.pid == proc.pid and left.bytes == 4096 and cache.entries() == []
    assert cache.survey().bytes == _on_disk(tmp_path) == 4096
    t0 = time.monotonic()
    assert cache.put(tmp_path / "g.onnx", _write("g.onnx", "g.onnx.data"))
    assert time.monotonic() - t0 < 1 and cache.temps() == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["g.onnx", "g.onnx.data"]
