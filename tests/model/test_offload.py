"""auto's background builds (torch's ONNX export, OpenVINO's compilation, ONNX Runtime's int8) run in a child process,
so they never hold this process's GIL; a child that fails hands the step back; a stopped preparation kills it; a child
never outlives its parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import layerwise as lw
import layerwise.model.backends.offload as offload
import layerwise.model.backends.openvino as ovb
import layerwise.model.backends.ort as ob

from tiny import wait_until

pytest.importorskip("onnxruntime")

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", "naïve cafés " * 20]


def test_background_export_and_conversion_run_in_a_child(tiny_extractors, monkeypatch, tmp_path, eager_preparation):
    """This process cannot export nor convert (both refused here): the background preparation still serves a
    compiled runtime, built by the child, and its states equal PyTorch's."""
    monkeypatch.setenv("LAYERWISE_AUTO_RUNTIME", "fastest")

    def refused(*args, **kwargs):
        raise AssertionError("built in the caller's process")

    monkeypatch.setattr(ob, "export_module", refused)
    monkeypatch.setattr(ovb, "compile_graph", refused)
    ran = []
    real = offload.run
    monkeypatch.setattr(offload, "run", lambda step, *a: ran.append(step) or real(step, *a))
    loaded = tiny_extractors["bert"].loaded
    ex = lw.Extractor(loaded, onnx_cache=tmp_path)
    reference = lw.Extractor(loaded, backend="torch").encode(TEXTS, layers=-1)
    np.testing.assert_array_equal(ex.encode(TEXTS, layers=-1), reference)  # PyTorch, meanwhile
    assert ex.backend.settle(timeout=300)
    depth = loaded.num_layers
    assert "layerwise.model.backends.ort:export_saved" in ran and ex.backend.decisions.exact(depth)
    if ovb.openvino_available():
        assert "layerwise.model.backends.openvino:compile_graph" in ran
    assert "failed" not in ex.backend.runtime()
    np.testing.assert_allclose(ex.encode(TEXTS, layers=-1), reference, atol=1e-5, rtol=0)


def test_the_rebuilt_model_is_the_truncated_copy(tiny_extractors, tmp_path):
    """What the child exports: the truncated copy rebuilt from its class, config and weights, equal to it."""
    import torch

    loaded = tiny_extractors["roberta"].loaded
    model = ob.truncated_copy(loaded, 1)
    ob.save_truncated(model, tmp_path / "m.pt")
    rebuilt = ob.load_truncated(tmp_path / "m.pt")
    ids = torch.tensor([[0, 5, 6, 7, 2]])
    with torch.no_grad():
        want = ob.Truncated(model)(ids, torch.ones_like(ids))
        got = ob.Truncated(rebuilt)(ids, torch.ones_like(ids))
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_child_that_fails_hands_the_step_back(tiny_extractors, monkeypatch, tmp_path, capfd):
    """No interpreter to run the child: the export is done in this process, and said once."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-python"))
    loaded = tiny_extractors["electra"].loaded
    with offload.offloaded(threading.Event()):
        assert offload.active()
        path = ob.export(loaded, 1, tmp_path / "g.onnx")
    assert not offload.active()
    assert path.exists() and path.with_name(path.name + ".data").exists()
    assert not list(tmp_path.glob(".g.onnx.tmp-*"))  # the file handed to the child is gone
    assert "it runs in this process" in capfd.readouterr().err


def test_a_failing_step_in_the_child_hands_it_back_with_the_reason(monkeypatch, tmp_path, capfd):
    """The child's own error (a graph that is not there) is said; the caller then runs the step itself."""
    with offload.offloaded(threading.Event()):
        assert not offload.run("layerwise.model.backends.ort:quantize_graph", str(tmp_path / "absent.onnx"),
                               str(tmp_path / "out.onnx"))
    err = capfd.readouterr().err
    assert "quantize_graph in a child process failed (exit 1" in err and "absent.onnx" in err


def test_outside_the_background_nothing_is_offloaded(tmp_path):
    assert not offload.active()
    assert offload.run("layerwise.model.backends.ort:export_saved", "a", "b") is False


def test_a_stopped_preparation_kills_the_child(tmp_path):
    """Stop (process exit) while the child is starting: it is killed and Stopped raised within a moment."""
    stop = threading.Event()
    threading.Timer(0.3, stop.set).start()
    t0 = time.monotonic()
    with offload.offloaded(stop), pytest.raises(offload.Stopped):
        offload.run("layerwise.model.backends.ort:export_saved", str(tmp_path / "m.pt"), "1", "0", "0",
                    str(tmp_path / "g.onnx"))
    assert time.monotonic() - t0 < 5
    with offload.offloaded(stop), pytest.raises(offload.Stopped):  # already stopped: no child at all
        offload.run("layerwise.model.backends.ort:quantize_graph", "a", "b")


def test_a_step_is_a_function_of_layerwise_only(capsys):
    assert offload.main(["compile"]) == 2
    assert "a step is 'layerwise.<module>:<function>'" in capsys.readouterr().err
    assert offload.main(["os:system", "true"]) == 2  # nothing outside layerwise runs
    assert offload.main(["layerwise.model.backends.ort:no_such_step"]) == 2
    assert "has no function 'no_such_step'" in capsys.readouterr().err


# a parent that starts a step in a child and says the child's PID; the step reads its model from a FIFO that nobody
# writes, so the child would wait there for ever
PARENT = textwrap.dedent("""
    import subprocess, sys, threading

    class Told(subprocess.Popen):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            print(self.pid, flush=True)

    subprocess.Popen = Told
    from layerwise.model.backends import offload
    with offload.offloaded(threading.Event()):
        offload.run("layerwise.model.backends.ort:export_saved", sys.argv[1], "1", "0", "0", sys.argv[2])
""")


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # a zombie waiting for PID 1 to reap it has ended


def _writer_once_read(fifo: Path) -> int:
    """A write end of ``fifo``, opened once a process has it open to read (a child blocked waiting for its model):
    the event that proves the child is at its wait. Nothing is written; closing it ends the child's read."""
    fd = []

    def opened() -> bool:
        try:
            fd.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO while no reader has it open
        except OSError:
            return False
        return True

    wait_until(opened, 60, "the child reading its model from the pipe")
    return fd[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_dies_with_its_parent(tmp_path):
    """kill -9 of the parent during a build: the child is gone within 2 s (not re-parented to PID 1 for minutes)."""
    fifo = tmp_path / "m.pt"
    os.mkfifo(fifo)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(fifo), str(tmp_path / "g.onnx")],
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    writer = None
    try:
        # the child lowers its own priority and arms the signal first thing (no preexec_fn)
        wait_until(lambda: os.sched_getscheduler(child) == os.SCHED_IDLE, 30, "the child at SCHED_IDLE")
        writer = _writer_once_read(fifo)
        assert not _gone(child)  # reading its model, which never comes
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        wait_until(lambda: _gone(child), 2.0, "the child gone after its parent's kill -9")
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
        if writer is not None:
            os.close(writer)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_child_ends_when_its_pipe_from_the_parent_closes(tmp_path):
    """The portable half: without the kernel's signal, the child watches its stdin (a pipe from the parent) and ends
    when it closes."""
    fifo = tmp_path / "m.pt"
    os.mkfifo(fifo)
    child = subprocess.Popen([sys.executable, "-m", "layerwise.model.backends.offload",
                              "layerwise.model.backends.ort:export_saved", str(fifo), "1", "0", "0",
                              str(tmp_path / "g.onnx")], stdin=subprocess.PIPE, env={**os.environ, offload.WATCH: "1"})
    writer = None
    try:
        writer = _writer_once_read(fifo)  # the child watches its stdin (armed before the step) and reads its model
        assert child.poll() is None
        child.stdin.close()
        assert child.wait(timeout=5) == 3
    finally:
        child.kill()
        child.wait()
        if writer is not None:
            os.close(writer)
