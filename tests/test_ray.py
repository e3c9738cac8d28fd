"""Extraction on a local Ray cluster (the ``[ray]`` extra, installed by ``./dev setup``): two workers give the store a
plain run gives, a worker killed mid-part is restarted and its part resumes (every record exactly once), an
interrupted run resumes with the same call, and the CLI's ``--engine ray`` writes the same store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import ray

import layerwise as lw
from layerwise.store import open_store
from test_sharding import _same, corpus

from tiny import extract


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_dirs, tiny_extractors):
    root = tmp_path_factory.mktemp("ray")
    src = corpus(root / "c.jsonl", n=3000, bad_every=700)
    extract(src, root / "plain", model=tiny_extractors["bert"], layers="-2:", keep=("id",))
    return root, src, str(tiny_dirs["bert"])


def _run(root, src, model, out, **kw):
    return lw.ray.extract(src, root / out, lw.EncodeSpec(layers="-2:"), model=model, device="cpu",
                          reading=lw.ReadOptions(keep=("id",)), num_workers=2, parts=6, **kw)


def test_two_workers_write_the_plain_store(cluster, data):
    root, src, model = data
    summary = _run(root, src, model, "two")
    assert summary.parts == 6 and summary.records == 2996 and summary.skipped == 4
    _same(open_store(root / "two"), open_store(root / "plain"))
    again = _run(root, src, model, "two")  # a rerun of a finished run finds every part complete
    assert again.already_complete == 6


def test_a_killed_worker_is_restarted_and_its_part_resumes(cluster, data):
    root, src, model = data
    flag = root / "kill-once"
    flag.write_text("")

    def kill_after_first_shard(shards: int) -> None:  # runs in a worker: SIGKILL its own process, once
        if os.path.exists(flag):
            os.remove(flag)
            os.kill(os.getpid(), signal.SIGKILL)

    opts = lw.ExtractOptions(shard_records=100)
    _run(root, src, model, "killed", options=opts, on_shard=kill_after_first_shard)
    assert not flag.exists()  # a worker did die
    _same(open_store(root / "killed"), open_store(root / "plain"))


def test_an_interrupted_run_resumes_with_the_same_call(cluster, data, tiny_extractors):
    root, src, model = data
    from layerwise.engines.ray import part_path

    # what a driver killed mid-run leaves: one part finished, one part half-written, the rest not started
    base = dict(model=tiny_extractors["bert"], layers="-2:", keep=("id",), num_shards=6, shard_records=50)
    extract(src, part_path(root / "resumed", 0), shard_index=0, **base)
    extract(src, part_path(root / "resumed", 3), shard_index=3, max_records=120, **base)
    summary = _run(root, src, model, "resumed", options=lw.ExtractOptions(shard_records=50))
    assert summary.already_complete == 1
    _same(open_store(root / "resumed"), open_store(root / "plain"))


def test_cli_engine_ray(data, tmp_path):
    root, src, model = data
    cmd = [sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / "cli"), "--engine",
           "ray", "--num-workers", "1", "--parts", "3", "--model", model, "--device", "cpu", "--layers=-2:", "--keep",
           "id"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ray: 3 parts (0 already complete), 2,996 records, 4 skipped" in done.stderr
    _same(open_store(tmp_path / "cli"), open_store(root / "plain"))
    bad = subprocess.run([sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / "bad"),
                          "--engine", "spark"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Valid engines are: local, ray" in bad.stderr
