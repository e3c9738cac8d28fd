"""One writer per store: a second run (a real second process) is refused naming the first, a dead writer's lock is
taken over in one line, and ``verify`` tells a live writer from a dead one."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.store import StoreWriter, verify_store
from layerwise.store.lock import LOCK, StoreLock, lock_state

from tiny import extract

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")

# A writer that holds the store: it extracts, and after its first shard waits until its stdin closes.
HOLDER = textwrap.dedent(
    """
    import sys
    import layerwise as lw

    model, corpus, store = sys.argv[1:4]

    def hold(n):
        if n == 1:
            print("holding", flush=True)
            sys.stdin.read()  # until the test closes it

    lw.extract(corpus, store, lw.EncodeSpec(layers=[1, 2]), model=lw.Extractor(model, device="cpu"), on_shard=hold,
               options=lw.ExtractOptions(shard_records=4, progress=False))
    """
)
TEXTS = [f"record {i} says alpha beta gamma"[: 14 + i % 17] for i in range(24)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("lock")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(TEXTS) + "\n")
    script = root / "holder.py"
    script.write_text(HOLDER)
    return root, corpus, script, str(tiny_dirs["bert"])


def cli(model: str, corpus: Path, store: Path) -> list[str]:
    """The `layerwise extract` command the holder's run equals."""
    return [sys.executable, "-m", "layerwise.cli.main", "extract", str(corpus), "-o", str(store), "--model", model,
            "--device", "cpu", "--layers", "1,2", "--shard-records", "4"]


def hold(setup, store: Path) -> subprocess.Popen:
    """Start the holder; returns once it holds the store (one shard written, waiting until its stdin closes)."""
    root, corpus, script, model = setup
    proc = subprocess.Popen([sys.executable, str(script), model, str(corpus), str(store)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.strip() == "holding", proc.stderr.read()  # type: ignore[union-attr]
    return proc


def test_a_second_extract_process_is_refused_naming_the_first(setup, tmp_path):
    root, corpus, script, model = setup
    store = tmp_path / "conc"
    first = hold(setup, store)
    try:
        second = subprocess.run(cli(model, corpus, store), capture_output=True, text=True, timeout=300)
        out = " ".join(second.stderr.split())
        assert second.returncode == 2, second.stderr
        assert f"is being written by another run: pid {first.pid} on host {socket.gethostname()} since " in out, out
        assert f"kill {first.pid}" in out and "rerun this command to resume" in out, out
        assert "holder.py" in out  # the holder's command line
        # the same from Python, in this process
        with pytest.raises(lw.StoreError, match=rf"pid {first.pid}"):
            StoreWriter(store, {}).open()
        state = lock_state(store)
        assert state is not None and state.live and state.holder.pid == first.pid
        res = CliRunner().invoke(app, ["verify", str(store)])
        assert res.exit_code == 0 and f"a run is writing it now: pid {first.pid}" in res.output, res.output
    finally:
        first.stdin.close()  # type: ignore[union-attr]  # lets it go on
    assert first.wait(timeout=300) == 0, first.stderr.read()  # type: ignore[union-attr]
    # the second run wrote nothing: no orphaned shard, every shard listed once, the lock file gone
    listed = [e["file"] for e in json.loads((store / "manifest.json").read_text())["shards"]]
    assert sorted(p.name for p in store.glob("shard-*")) == listed and len(listed) == 6
    assert not (store / LOCK).exists() and lock_state(store) is None
    assert verify_store(store).ok and lw.open_store(store).complete


def test_a_dead_writers_lock_is_taken_over_in_one_line_and_verify_says_it_died(setup, tmp_path, tiny_extractors):
    root, corpus, script, model = setup
    store = tmp_path / "killed"
    first = hold(setup, store)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    assert (store / LOCK).exists()  # the kernel let the lock go; the file stays, naming the dead writer
    state = lock_state(store)
    assert state is not None and not state.live and state.holder.pid == first.pid
    res = CliRunner().invoke(app, ["verify", str(store)])
    assert res.exit_code == 0, res.output
    said = " ".join(res.output.split())
    assert f"the run stopped: its writer (pid {first.pid} on host {socket.gethostname()} since " in said, said
    assert "ended without finishing; rerun the extract command" in said and "is running" not in said, said
    rerun = subprocess.run(cli(model, corpus, store), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    lines = [line for line in rerun.stderr.splitlines() if "stale lock" in line]
    assert len(lines) == 1 and f"took over the stale lock of pid {first.pid} on host" in lines[0], rerun.stderr
    assert "that writer has ended" in lines[0]
    clean = tmp_path / "clean"
    extract(corpus, clean, model=tiny_extractors["bert"], layers=[1, 2], shard_records=4, progress=False)
    got, want = lw.open_store(store), lw.open_store(clean)
    assert got.complete and len(got) == len(want) == len(TEXTS) and verify_store(store).ok
    assert abs(got.to_numpy() - want.to_numpy()).max() <= 1e-5
    assert not (store / LOCK).exists()


def test_a_stopped_run_without_a_lock_file_is_said_to_have_stopped(setup, tmp_path, tiny_extractors):
    root, corpus, script, model = setup
    store = tmp_path / "s"
    extract(corpus, store, model=tiny_extractors["bert"], layers=[1, 2], shard_records=4, progress=False)
    m = json.loads((store / "manifest.json").read_text())
    (store / "manifest.json").write_text(json.dumps({**m, "status": "running"}))
    said = " ".join(verify_store(store).notes)
    assert "the run stopped before it finished (no writer holds the store now)" in said, said


def test_a_lock_of_another_host_is_not_taken_over(setup, tmp_path, tiny_extractors):
    root, corpus, script, model = setup
    store = tmp_path / "s"
    store.mkdir()
    lock = {"format": "layerwise-store-lock", "pid": 4242, "host": "elsewhere-node", "since": "2026-11-25T10:00:00",
            "command": "layerwise extract x -o s"}
    (store / LOCK).write_text(json.dumps(lock))
    with pytest.raises(lw.StoreError, match=r"lock file of pid 4242 on host elsewhere-node since 2026-11-25T10:00:00 "
                                            r"\(layerwise extract x -o s\), a process this host .* cannot see\. If "
                                            r"that run has ended, delete .*writer\.lock"):
        extract(corpus, store, model=tiny_extractors["bert"], progress=False)
    assert json.loads((store / LOCK).read_text()) == lock and not (store / "manifest.json").exists()


def test_a_foreign_lock_file_is_never_replaced(setup, tmp_path, tiny_extractors):
    root, corpus, script, model = setup
    store = tmp_path / "s"
    store.mkdir()
    (store / LOCK).write_text("my own notes\n")
    with pytest.raises(lw.StoreError, match=r"writer\.lock' is not a layerwise lock file"):
        extract(corpus, store, model=tiny_extractors["bert"], progress=False)
    assert (store / LOCK).read_text() == "my own notes\n" and sorted(p.name for p in store.iterdir()) == [LOCK]


def test_one_process_cannot_open_two_writers_and_a_closed_writer_lets_go(setup, tmp_path, tiny_extractors):
    root, corpus, script, model = setup
    store = tmp_path / "s"
    extract(corpus, store, model=tiny_extractors["bert"], layers=[1, 2], shard_records=4, progress=False)
    header = {k: v for k, v in json.loads((store / "manifest.json").read_text()).items()
              if k in ("spec", "model", "model_options", "tokenizer", "input", "feature_shape")}
    first = StoreWriter(store, header)
    assert first.open() == "complete" and (store / LOCK).exists()
    with pytest.raises(lw.StoreError, match="this process already writes store"):
        StoreWriter(store, header).open()
    first.close()
    assert not (store / LOCK).exists()
    with StoreWriter(store, header) as again:
        assert again.open() == "complete"
    assert not (store / LOCK).exists()


def test_release_removes_the_file_while_holding_it_and_the_next_writer_takes_a_new_one(tmp_path):
    """A writer that opened the file before it was released finds it unlinked (and locks a new one)."""
    a = StoreLock(tmp_path).acquire()
    fd = os.open(tmp_path / LOCK, os.O_RDWR)  # a second writer that opened the file before it was released
    a.release()
    assert os.fstat(fd).st_nlink == 0 and not (tmp_path / LOCK).exists()
    os.close(fd)
    t0 = time.monotonic()
    b = StoreLock(tmp_path).acquire()  # a new file, at once (no retry wait)
    assert time.monotonic() - t0 < 0.5 and json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(lw.StoreError, match="this process already writes"):
        StoreLock(tmp_path).acquire()
    b.release()
    assert not (tmp_path / LOCK).exists()
