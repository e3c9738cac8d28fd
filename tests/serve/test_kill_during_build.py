"""A real server killed with -9 while its background builds a graph (``auto``'s default path, a fresh cache): the
build's child process dies with it, and what the build left in the cache is counted by ``layerwise cache`` (its total
is what the directory holds) and removed by ``layerwise cache --clear``; the next server builds and serves."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the build's child process in /proc")

OFFLOAD = "layerwise.model.backends.offload"


def _children(pid: int) -> list[int]:
    """The offload children of ``pid`` (build steps run as ``python -m layerwise.model.backends.offload``)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            stat = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat[1]) == pid and OFFLOAD in cmdline:
            found.append(int(proc.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _writing(root: Path) -> bool:
    """Whether a build has begun writing into the cache at ``root``: a temporary file with bytes in it."""
    try:
        return any(".tmp-" in str(p.relative_to(root)) and p.is_file() and p.stat().st_size > 0
                   for p in root.rglob("*"))
    except OSError:  # a file renamed or removed while looked at
        return False


def _on_disk(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _cache(env, *args):
    done = subprocess.run([sys.executable, "-m", "layerwise.cli.main", "cache", *args], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_server_killed_during_a_build_leaves_nothing_unaccounted(tmp_path):
    from tiny import free_port, wait_until

    env = {k: v for k, v in os.environ.items() if k != "LAYERWISE_AUTO_RUNTIME"}  # the default path
    env.update(LAYERWISE_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    root = tmp_path / "cache" / "onnx"
    cmd = [sys.executable, "-m", "layerwise.cli.main", "serve", "--device", "cpu", "--log-level", "warning",
           "--port", str(free_port())]  # the embedded default model: its export takes seconds in the child

    def building() -> list[int]:
        assert server.poll() is None, f"no build child seen (server exit {server.poll()})"
        return _children(server.pid)

    server = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        children = wait_until(building, 240, "a build child of the server", interval=0.01)
        wait_until(lambda: _writing(root), 120, "the build writing into the cache", interval=0.01)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
    wait_until(lambda: not any(_alive(c) for c in children), 5, "the build's child ending with its server")
    listed = json.loads(_cache(env, "--dir", str(root), "--json"))
    assert listed["bytes"] == _on_disk(root)  # every byte the kill left is counted
    assert listed["temporary"] and all(t["dead"] for t in listed["temporary"]), listed["temporary"]
    _cache(env, "--dir", str(root), "--clear")
    left = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert left == [], left  # (lock files are empty)
