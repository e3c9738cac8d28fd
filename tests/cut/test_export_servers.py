"""An exported layer served by an OpenAI-compatible server that is not layerwise: Infinity (``infinity-emb``), which
loads Hugging Face directories through sentence-transformers, called with the official ``openai`` client.

Infinity pins sentence-transformers < 4 and transformers < 5, so it runs from its own virtual environment, built here
(``torch`` first, the local CPU wheel of the version this suite runs, then ``infinity-emb[server,torch]``; about a
minute from the package index, started in the background as soon as the session has collected this test:
:mod:`prebuilt`). Locally the test is skipped unless ``LAYERWISE_SIDE_SERVERS=1``; in CI
(``LAYERWISE_CI=1``) it always runs.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

import layerwise as lw
import prebuilt

from tiny import free_port, wait_until

openai = pytest.importorskip("openai", reason="the openai client is in the test extra")
st = pytest.importorskip("sentence_transformers", reason="in the test extra")

INFINITY = "infinity-emb[server,torch]==0.0.78"
TEXTS = ["I love Paris", "EU rejects German call to boycott British lamb .", "naïve cafés, again and again"]

pytestmark = pytest.mark.skipif(
    not (os.environ.get("LAYERWISE_CI") or os.environ.get("LAYERWISE_SIDE_SERVERS")),
    reason="builds Infinity's own environment (about a minute); set LAYERWISE_SIDE_SERVERS=1")


def infinity_environment(root: Path) -> Path:
    """Infinity's own virtual environment under ``root``: its ``infinity_emb`` command."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pin = f"torch=={torch.__version__.split('+')[0]}"  # the CPU wheel this suite runs (an unpinned torch pulls CUDA)
    (root / "constraints.txt").write_text(pin + "\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    for args in ([pin], [INFINITY, "-c", str(root / "constraints.txt")]):
        done = subprocess.run([*pip, *args], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-3000:]
    return venv / "bin" / "infinity_emb"


@pytest.fixture(scope="module")
def infinity() -> Path:
    """Infinity's ``infinity_emb`` command (its environment started building when the session collected this test:
    :mod:`prebuilt`)."""
    return prebuilt.wait("infinity", infinity_environment)


def readme_command() -> list[str]:
    """The README's Infinity line (``DO_NOT_TRACK=1 infinity_emb v2 --model-id ./minilm-l3 ...``), split."""
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    (line,) = [ln for ln in text.splitlines() if "infinity_emb v2" in ln]
    return shlex.split(line)


def serve(command: Path, models: dict[str, Path], log: Path):
    """``infinity_emb v2`` serving ``models`` (name -> directory) with the README's flags, offline, no telemetry;
    its base URL once healthy."""
    env_var, exe, *flags = readme_command()
    assert (env_var, exe, flags[0]) == ("DO_NOT_TRACK=1", "infinity_emb", "v2")
    given = dict(zip(flags[1::2], flags[2::2]))
    assert given["--model-id"] == "./minilm-l3" and "--port" in given
    port = free_port()
    args = [str(command), "v2", "--port", str(port)]
    args += [x for k, v in given.items() if k not in ("--model-id", "--port") for x in (k, v)]
    for name, directory in models.items():
        args += ["--model-id", str(directory), "--served-model-name", name]
    env = {**os.environ, "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0"}
    handle = open(log, "w+")
    proc = subprocess.Popen(args, stdout=handle, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            urllib.request.urlopen(f"{base}/health", timeout=5).read()
            return True
        except OSError:
            return False

    try:
        wait_until(lambda: proc.poll() is not None or healthy(), 300, "GET /health answering", interval=0.5)
        assert proc.poll() is None, f"infinity exited with status {proc.returncode}"
    except AssertionError as exc:
        proc.kill()
        handle.seek(0)
        pytest.fail(f"infinity did not start ({exc}):\n{handle.read()[-4000:]}")
    return proc, handle, base


def test_infinity_serves_a_layer_and_a_mix_as_sentence_transformers_computes_them(infinity, tmp_path):
    one = lw.export_model(tmp_path / "minilm-l3", layers=3, normalize=True).directory
    mix = lw.export_model(tmp_path / "minilm-mix", layers=[2, 4], combine="weighted", weights=[1.0, 3.0],
                          normalize=True).directory
    proc, log, base = serve(infinity, {"minilm-l3": one, "minilm-mix": mix}, tmp_path / "infinity.log")
    try:
        client = openai.OpenAI(base_url=base, api_key="unused")
        for name, directory in (("minilm-l3", one), ("minilm-mix", mix)):
            got = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
            served = np.array([d.embedding for d in got.data])
            want = st.SentenceTransformer(str(directory), device="cpu").encode(TEXTS)
            assert np.abs(served - want).max() < 1e-5, name
        # and it is layerwise's layer, not the full model's
        layer3 = lw.Extractor().encode(TEXTS, layers=3, pool="mean", normalize=True)
        got = client.embeddings.create(model="minilm-l3", input=TEXTS, encoding_format="float")
        assert np.abs(np.array([d.embedding for d in got.data]) - layer3).max() < 1e-5
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
        log.close()
