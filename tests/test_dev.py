"""The ``dev`` script as a newcomer meets it: ``./dev demo`` sets up only what the demo needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import prebuilt

ROOT = Path(__file__).resolve().parents[1]


def demo_environment(directory: Path) -> tuple[Path, subprocess.CompletedProcess]:
    """``./dev setup demo`` into ``directory/venv``: the environment and how the command ended."""
    venv = directory / "venv"
    env = {**os.environ, "LAYERWISE_VENV": str(venv), "PYTHON": sys.executable}
    done = subprocess.run([str(ROOT / "dev"), "setup", "demo"], capture_output=True, text=True, env=env, timeout=900)
    return venv, done


def test_the_demo_environment_has_no_tensorflow_and_no_ray():
    """``./dev setup demo`` (what ``./dev demo`` runs first) in a new environment: layerwise imports, and neither
    TensorFlow nor Ray is installed (the test extras come with ``./dev test``)."""
    if shutil.which("python3") is None:
        pytest.skip("no python3 on PATH to create the environment with")
    venv, done = prebuilt.wait("demo", demo_environment)  # started when the session collected this test
    assert done.returncode == 0, done.stderr[-3000:]
    probe = ("import importlib.util as u, layerwise; "
             "print(*(u.find_spec(m) is not None for m in ('tensorflow', 'ray', 'keras_hub')))")
    found = subprocess.run([str(venv / "bin" / "python"), "-c", probe], capture_output=True, text=True, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == ["False", "False", "False"]
    assert (venv / ".layerwise-stamp").read_text().split()[1] == "demo"
