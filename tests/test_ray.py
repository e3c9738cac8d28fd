"""Extraction on a local Ray cluster (the ``[ray]`` extra, installed by ``./dev setup``): two workers give the store a
plain run gives, a worker killed mid-run is restarted and its part retried (every record exactly once), a driver
killed mid-run (SIGKILL, in a subprocess) resumes with the same command, a dataset is an input, and the CLI's
``--engine ray`` writes the same store."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import ray

import layerwise as lw
from layerwise.extraction.ray import part_path
from layerwise.store import open_store
from test_sharding import _same, corpus

from tiny import extract


@pytest.fixture(scope="module")
def cluster():
    # 4 logical CPUs on 2 cores: the 2-actor pool holds 2, the read, tokenise and write tasks share the rest
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_dirs, tiny_extractors):
    root = tmp_path_factory.mktemp("ray")
    src = corpus(root / "c.jsonl", n=3000, bad_every=700)
    extract(src, root / "plain", model=tiny_extractors["bert"], layers="-2:", keep=("id",))
    return root, src, str(tiny_dirs["bert"])


def _run(root, src, model, out, **kw):
    return lw.ray.extract(src, root / out, lw.EncodeSpec(layers="-2:"), model=lw.ModelOptions(model, device="cpu"),
                          reading=lw.ReadOptions(keep=("id",)), num_workers=2, part_records=500, **kw)


def test_two_workers_write_the_plain_store(cluster, data):
    root, src, model = data
    seen = root / "encoders"
    seen.mkdir()

    def note_encoder(part: int) -> None:  # runs in an encode actor; slow enough that the second actor is up
        (seen / f"{part}-{os.getpid()}").write_text("")
        time.sleep(1.0)

    summary = _run(root, src, model, "two", on_part=note_encoder)
    assert len({p.name.split("-")[1] for p in seen.iterdir()}) == 2  # both actors encoded parts
    assert summary.parts == 6 and summary.records == 2996 and summary.skipped == 4
    _same(open_store(root / "two"), open_store(root / "plain"))
    assert open_store(part_path(root / "two", 5)).manifest["part"] == {"index": 5, "of": 6}
    again = _run(root, src, model, "two")  # a rerun of a finished run finds every part complete
    assert again.already_complete == 6
    with pytest.raises(lw.ExtractError, match=r"other options: .*spec\.layers"):  # parts of another spec are refused
        lw.ray.extract(src, root / "two", lw.EncodeSpec(layers="-1"), model=lw.ModelOptions(model, device="cpu"),
                       reading=lw.ReadOptions(keep=("id",)), part_records=500)


def test_a_dataset_is_an_input(cluster, data, tmp_path):
    root, src, model = data
    datasets = pytest.importorskip("datasets")
    rows = [json.loads(line) for line in open(src, encoding="utf-8")]
    ds = datasets.Dataset.from_list([{"text": r.get("text"), "id": r.get("id")} for r in rows])
    lw.ray.extract(ds, tmp_path / "ds", lw.EncodeSpec(layers="-2:"), model=lw.ModelOptions(model, device="cpu"),
                   reading=lw.ReadOptions(keep=("id",)), num_workers=1, part_records=1000)
    got, want = open_store(tmp_path / "ds"), open_store(root / "plain")
    np.testing.assert_allclose(got.to_numpy(), want.to_numpy(), atol=1e-5)
    assert got.column("id") == want.column("id") and got.manifest["input"]["format"] == "table"


def test_a_killed_worker_is_restarted_and_its_part_resumes(cluster, data):
    root, src, model = data
    flag = root / "kill-once"
    flag.write_text("")

    def kill_after_a_part(part: int) -> None:  # runs in an encode actor: SIGKILL its own process, once
        if part == 2 and os.path.exists(flag):
            os.remove(flag)
            os.kill(os.getpid(), signal.SIGKILL)

    _run(root, src, model, "killed", on_part=kill_after_a_part)
    assert not flag.exists()  # a worker did die
    _same(open_store(root / "killed"), open_store(root / "plain"))


def _cli(src, out, model, *extra):
    return [sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(out), "--engine", "ray",
            "--model", model, "--device", "cpu", "--layers=-2:", "--keep", "id", "--quiet", *extra]


def _ray_processes(tag: str) -> list[int]:
    """Processes whose command line names ``tag`` (the temp dir of a killed driver's own Ray cluster)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if tag.encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def test_a_killed_driver_resumes_with_the_same_command(data, tmp_path):
    root, src, model = data
    out = tmp_path / "driver"
    # the driver's own local cluster lives here, so what it leaves can be found and stopped (short: socket paths)
    temp = Path(tempfile.mkdtemp(prefix="lwray", dir="/tmp"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0", "RAY_TMPDIR": str(temp)}
    # small parts and one-text batches: a run of some seconds, so the kill lands mid-run
    cmd = _cli(src, out, model, "--part-records", "100", "--num-workers", "1", "--batch-tokens", "16")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    parts = out.with_name("driver.parts")
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if len(list(parts.glob("part-*"))) >= 2:  # some parts written, the run not finished
            break
        time.sleep(0.05)
    try:
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        for pid in _ray_processes(str(temp)):  # the killed driver's raylet and workers
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    written = sorted(p.name for p in parts.glob("part-*"))
    assert 2 <= len(written) < 30 and not (out / "manifest.json").exists()
    again = [c for c in cmd if c != "--quiet"]  # the same command (with its summary line)
    done = subprocess.run(again, capture_output=True, text=True, timeout=300, env=env)
    for pid in _ray_processes(str(temp)):
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _same(open_store(out), open_store(root / "plain")) is None
    complete = [p for p in written if (parts / p / "manifest.json").exists()]
    assert complete and f"ray: 30 parts ({len(complete)} already complete), 2,996 records, 4 skipped" in done.stderr


def test_cli_engine_ray(data, tmp_path):
    root, src, model = data
    cmd = _cli(src, tmp_path / "cli", model, "--num-workers", "1", "--part-records", "1000")
    cmd.remove("--quiet")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ray: 3 parts (0 already complete), 2,996 records, 4 skipped" in done.stderr
    _same(open_store(tmp_path / "cli"), open_store(root / "plain"))
    bad = subprocess.run([sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / "bad"),
                          "--engine", "spark"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Valid engines are: local, ray" in bad.stderr


@pytest.mark.slow
@pytest.mark.parametrize("flags", [["--compute-dtype", "bfloat16"], ["--quantize", "int8"]])
def test_model_options_reach_the_ray_workers(data, tmp_path, flags):
    """Every model option given to `extract --engine ray` is in the store's manifest and changes the features exactly
    as the same option does in a local run (one part, the same token budget: the same batches)."""
    _, _, model = data
    src = tmp_path / "c.txt"
    src.write_text("".join(f"sentence number {i} says {'more ' * (i % 7)}words\n" for i in range(40)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    common = ["--model", model, "--device", "cpu", "--layers=-2:", "--batch-tokens", "256", "--quiet", *flags]
    runs = {
        "ray": ["--engine", "ray", "--num-workers", "1", "--part-records", "1000"],
        "local": [],
        "plain": None,  # the same run without the option: the option must change the features
    }
    for name, extra in runs.items():
        args = common if extra is not None else common[: -len(flags)]
        cmd = [sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / name), *args,
               *(extra or [])]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    ray_st, local, plain = (open_store(tmp_path / n) for n in runs)
    field, value = flags[0].removeprefix("--").replace("-", "_"), flags[1]
    assert ray_st.manifest["model_options"][field] == value == local.manifest["model_options"][field]
    assert plain.manifest["model_options"][field] is None
    precision = "int8" if field == "quantize" else value
    assert ray_st.model["precision"] == local.model["precision"] == precision != plain.model["precision"]
    got, want, base = ray_st.to_numpy(), local.to_numpy(), plain.to_numpy()
    assert got.shape == want.shape == base.shape == (40, 2 * 32)
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    assert np.abs(got - base).max() > 1e-4  # the option took effect
