"""Extraction on Ray at this machine's real resources (the ``[ray]`` extra, installed by ``./dev setup``).

Ray starts with its own defaults here (no inflated ``num_cpus``): a pool that leaves the other stages no CPU is
refused in seconds, ``num_workers="auto"`` and one worker complete and equal the local store, a worker killed
mid-run is restarted and its part retried (every record exactly once), a driver killed mid-run resumes with the same
command, a stalled run ends with the stages' states and resumes, every model option reaches the workers, and the
output opens as one store without a merge."""

from __future__ import annotations

import json
import os
import re
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
from test_sharding import _same, corpus

import layerwise as lw
from layerwise.extraction.pool import local_resources, size_pool
from layerwise.extraction.ray import part_path
from layerwise.extraction.signals import SignalState
from layerwise.store import export, merge_stores, open_store

from tiny import extract, wait_until

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


@pytest.fixture(scope="module")
def cluster(request):
    """Ray in this process; its signal handling put back at the end, with faulthandler writing where pytest's did
    (``ray.shutdown`` leaves Ray's behind: :mod:`layerwise.extraction.signals`)."""
    try:
        from _pytest.faulthandler import fault_handler_stderr_fd_key

        fault_fd = request.config.stash.get(fault_handler_stderr_fd_key, None)
    except ImportError:
        fault_fd = None
    state = SignalState.save(fault_fd)
    ray.init(include_dashboard=False, log_to_driver=False)  # Ray's defaults: this machine's CPUs
    yield ray.cluster_resources()
    ray.shutdown()
    state.restore()


@pytest.fixture(scope="module")
def data(tmp_path_factory, tiny_dirs, tiny_extractors):
    root = tmp_path_factory.mktemp("ray")
    src = corpus(root / "c.jsonl", n=3000, bad_every=700)
    extract(src, root / "plain", model=tiny_extractors["bert"], layers="-2:", keep=("id",))
    return root, src, str(tiny_dirs["bert"])


def _run(root, src, model, out, **kw):
    kw.setdefault("part_records", 500)
    return lw.ray.extract(src, root / out, lw.EncodeSpec(layers="-2:"), model=lw.ModelOptions(model, device="cpu"),
                          reading=lw.ReadOptions(keep=("id",)), **kw)


def _cli(src, out, model, *extra):
    return [sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(out), "--engine", "ray",
            "--model", model, "--device", "cpu", "--layers=-2:", "--keep", "id", "--quiet", *extra]


def test_a_pool_that_starves_the_other_stages_is_refused_at_once(data, tmp_path):
    """On this machine's CPUs, as many 1-CPU workers as CPUs leave nothing for reading: refused before Ray starts."""
    _, src, model = data
    cpus = int(local_resources().cpus)
    started = time.monotonic()
    done = subprocess.run(_cli(src, tmp_path / "out", model, "--num-workers", str(cpus)), capture_output=True,
                          text=True, timeout=60, env=ENV)
    took = time.monotonic() - started
    assert done.returncode == 2, done.stderr[-2000:]
    want = (f"{cpus} workers x 1 CPU on a {cpus}-CPU cluster (this machine) leaves 0 CPUs for reading, tokenising "
            f"and writing, which need 1: the run would wait forever; use --num-workers {cpus - 1}, or "
            f"--num-workers auto")
    assert want in " ".join(done.stderr.split()), done.stderr
    assert took < 5, took
    assert not (tmp_path / "out").exists()
    with pytest.raises(lw.ExtractError, match="would wait forever for GPUs"):
        size_pool(1, local_resources(), cpus_per_worker=1, gpus_per_worker=8)


def test_auto_sizes_the_pool_and_writes_the_local_store(cluster, data):
    root, src, model = data
    summary = _run(root, src, model, "auto")
    want = size_pool("auto", local_resources(), cpus_per_worker=1, gpus_per_worker=0)
    assert summary.workers == want == int(cluster["CPU"]) - 1 >= 1
    assert summary.records == 2996 and summary.skipped == 4 and summary.parts >= 5
    got, plain = open_store(root / "auto"), open_store(root / "plain")  # no merge: the parts read as one store
    _same(got, plain)
    np.testing.assert_allclose(got.to_numpy(), plain.to_numpy(), atol=1e-5, rtol=0)
    assert got.manifest["format_version"] == 4 and not (root / "auto.parts").exists()
    assert open_store(part_path(root / "auto", 1)).manifest["part"]["index"] == 1
    assert got.verify().ok
    again = _run(root, src, model, "auto")  # a rerun of a finished run finds it complete
    assert again.already_complete == again.parts == summary.parts
    with pytest.raises(lw.ExtractError, match=r"another run's parts"):  # another spec into the same output
        lw.ray.extract(src, root / "auto", lw.EncodeSpec(layers="-1"), model=lw.ModelOptions(model, device="cpu"),
                       reading=lw.ReadOptions(keep=("id",)), part_records=500)


def test_one_worker(cluster, data):
    root, src, model = data
    summary = _run(root, src, model, "one", num_workers=1, part_records=1000)
    assert summary.workers == 1
    _same(open_store(root / "one"), open_store(root / "plain"))


def test_a_store_of_parts_reads_exports_and_compacts_like_one(cluster, data, tmp_path):
    root, src, model = data
    if not (root / "auto" / "manifest.json").exists():
        _run(root, src, model, "auto")
    st, plain = open_store(root / "auto"), open_store(root / "plain")
    np.testing.assert_allclose(st[10:2000:7], plain[10:2000:7], atol=1e-5)
    np.testing.assert_allclose(np.concatenate(list(st.iter_chunks(333))), plain.to_numpy(), atol=1e-5)
    assert st.to_arrow().column("line").to_pylist() == plain.lines.tolist()
    export(st, tmp_path / "f-npy", to="npy")
    np.testing.assert_allclose(np.load(tmp_path / "f-npy" / "features.npy"), plain.to_numpy(), atol=1e-5)
    assert np.load(tmp_path / "f-npy" / "lines.npy").tolist() == plain.lines.tolist()
    summary = merge_stores([root / "auto"], tmp_path / "compact")
    assert summary.records == 2996
    _same(open_store(tmp_path / "compact"), plain)
    from typer.testing import CliRunner

    from layerwise.cli.main import app

    res = CliRunner().invoke(app, ["inspect", str(root / "auto")])
    assert res.exit_code == 0 and "2,996" in res.output.replace("2996", "2,996")
    # real damage: a part deleted is named, never read as complete
    copy = tmp_path / "damaged"
    shutil.copytree(root / "auto", copy)
    shutil.rmtree(part_path(copy, 2))
    with pytest.raises(lw.StoreCorruptError, match=r"part part-00002 is missing"):
        open_store(copy)
    res = CliRunner().invoke(app, ["verify", str(copy)])
    assert res.exit_code != 0 and "part-00002" in res.output + (res.stderr or "")


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


def test_a_stalled_run_ends_with_the_stages_states_and_resumes(cluster, data):
    root, src, model = data
    flag = root / "stall"
    flag.write_text("")

    first = root / "stall-first"

    def stall_after_one(part: int) -> None:  # runs in the encode actor: every part after the first it encodes hangs
        if os.path.exists(flag):
            if first.exists():
                time.sleep(300)
            first.write_text(str(part))

    started = time.monotonic()
    # the clock runs from the start (a pool that never starts is a stall too): the timeout covers the actor's start
    with pytest.raises(lw.ExtractError, match=r"no part finished for 30 s \(stall_timeout.*Stages: read and "
                                              r"tokenised \d+ parts, encoded \d+ \(pool of \d\), written \d+.*rerun "
                                              r"the same command to resume"):
        _run(root, src, model, "stalled", stall_timeout=30, on_part=stall_after_one)
    assert time.monotonic() - started < 150
    kept = sorted(p.name for p in (root / "stalled").glob("part-*"))
    assert kept == [f"part-{int(first.read_text()):05d}"] and not (root / "stalled" / "manifest.json").exists()
    flag.unlink()
    again = _run(root, src, model, "stalled")
    assert again.already_complete == 1
    _same(open_store(root / "stalled"), open_store(root / "plain"))


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


def test_a_directory_of_files_is_read_in_parallel(cluster, data, tmp_path, tiny_extractors):
    """Several files: one part (at least) each, numbered as the local engine numbers them (lines counted on)."""
    _, src, model = data
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    folder = tmp_path / "in"
    folder.mkdir()
    for k in range(4):
        (folder / f"f{k}.jsonl").write_text("".join(lines[k * 750:(k + 1) * 750]), encoding="utf-8")
    extract(folder, tmp_path / "local", model=tiny_extractors["bert"], layers="-2:", keep=("id",))
    summary = lw.ray.extract(folder, tmp_path / "ray", lw.EncodeSpec(layers="-2:"),
                             model=lw.ModelOptions(model, device="cpu"), reading=lw.ReadOptions(keep=("id",)),
                             part_records=400)
    assert summary.parts >= 8
    _same(open_store(tmp_path / "ray"), open_store(tmp_path / "local"))
    assert open_store(tmp_path / "local").lines[-1] == 3000


def _ray_processes(tag: str) -> list[int]:
    """Processes that name ``tag`` (the temp dir of a driver's own Ray cluster) on their command line or in their
    environment (``RAY_TMPDIR``, which every process of that cluster inherits; a Ray worker's command line is its
    title, ``ray::IDLE``)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
            with open(f"/proc/{pid}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
            with open(f"/proc/{pid}/stat", "rb") as fh:
                zombie = fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
        except OSError:
            continue
        if not zombie and (tag.encode() in cmdline or f"RAY_TMPDIR={tag}".encode() in environ):
            found.append(int(pid))
    return found


def _left_after(temp: Path, seconds: float) -> list[int]:
    """The processes of the Ray cluster under ``temp`` still running after ``seconds`` ([] as soon as none are)."""
    try:
        wait_until(lambda: not _ray_processes(str(temp)), seconds, "the Ray cluster's processes ending", interval=0.2)
    except AssertionError:
        return _ray_processes(str(temp))
    return []


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                names.append(fh.read().replace(b"\0", b" ").decode(errors="replace")[:80])
        except OSError:
            pass
    return names


def _summary(stderr: str) -> tuple[int, int]:
    found = re.search(r"ray: (\d+) parts \((\d+) already complete", stderr)
    assert found, stderr[-3000:]
    return int(found.group(1)), int(found.group(2))


def test_a_killed_driver_ends_its_cluster_and_resumes_with_the_same_command(data, tmp_path):
    """A second driver on the same output is refused naming the first; ``kill -9`` of the first (the driver alone)
    leaves no process of its Ray cluster behind (its guard ends them); the same command resumes, keeping every part
    written before the kill."""
    root, src, model = data
    out = tmp_path / "driver"
    # the driver's own local cluster lives here, so what it leaves can be found (short: socket paths)
    temp = Path(tempfile.mkdtemp(prefix="lwray", dir="/tmp"))
    env = {**ENV, "RAY_TMPDIR": str(temp)}
    # small parts and one-text batches: a run of some seconds, so the kill lands mid-run
    cmd = _cli(src, out, model, "--part-records", "100", "--batch-tokens", "16")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 240  # for the lock and the first parts together
        wait_until(lambda: proc.poll() is not None or (out / "writer.lock").exists(), 240, "the driver's writer.lock")
        # the first driver holds the output (Ray and its parts still to come): a second one is refused, naming it
        second = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        said = " ".join(second.stderr.split())
        assert second.returncode == 2 and "is being written by another run" in said, second.stderr[-3000:]
        assert f"pid {proc.pid}" in said
        # some parts written, the run not finished
        wait_until(lambda: proc.poll() is not None or len(list(out.glob("part-*"))) >= 2,
                   round(deadline - time.monotonic(), 1), "two parts written")
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
        assert _ray_processes(str(temp)), "the driver's cluster was not found by its temp dir"
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as the out-of-memory killer would
        proc.wait(timeout=30)
        killed = time.monotonic()
        left = _left_after(temp, 30)
        print(f"the killed driver's Ray processes were gone {time.monotonic() - killed:.1f} s after the kill")
        assert left == [], f"left running after the driver's kill -9: {_names(left)}"
    finally:
        for pid in _ray_processes(str(temp)):  # only if the assertion above failed: this test's own cluster
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    written = sorted(p.name for p in out.glob("part-*"))
    assert len(written) >= 2 and not (out / "manifest.json").exists()
    again = [c for c in cmd if c != "--quiet"]  # the same command (with its summary line)
    done = subprocess.run(again, capture_output=True, text=True, timeout=300, env=env)
    left = _left_after(temp, 20)  # Ray's shutdown, then the guard's look for stragglers
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    shutil.rmtree(temp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    _same(open_store(out), open_store(root / "plain"))
    parts, complete = _summary(done.stderr)
    # every part written before the kill is kept; a part the killed run's last task finished after the kill (an
    # orphaned writer completing its atomic rename) is kept too, never written twice
    assert len(written) <= complete < parts
    assert "2,996 records, 4 skipped" in done.stderr
    assert left == [], f"left running after a finished run: {_names(left)}"
    assert not (out / "writer.lock").exists()


def _csv(path, n):
    """``n`` csv rows (header ``text,id``); every 5th text holds a quoted newline and a quoted comma."""
    import csv

    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "id"])
        for i in range(n):
            w.writerow([f"row {i}, with a comma\nand a second line" if i % 5 == 0 else f"plain row {i}", i])
    return path


@pytest.mark.parametrize("fmt", ["csv", "tsv"])
def test_csv_and_tsv_parts_hold_part_records(cluster, data, tmp_path, tiny_extractors, fmt):
    """A csv/tsv input is cut where the csv reader ends a row (quoted newlines included): 1,200 rows with
    ``part_records=300`` are 4 parts (they were 1), and the store equals a local run."""
    _, _, model = data
    src = _csv(tmp_path / "c.csv", 1200)
    if fmt == "tsv":
        import csv

        with open(src, newline="", encoding="utf-8") as fh:
            rows = [[c.replace("\n", " ") for c in r] for r in csv.reader(fh)]
        src = tmp_path / "c.tsv"
        src.write_text("".join("\t".join(r) + "\n" for r in rows), encoding="utf-8")
    extract(src, tmp_path / "local", model=tiny_extractors["bert"], layers="-2:", keep=("id",))
    summary = lw.ray.extract(src, tmp_path / "ray", lw.EncodeSpec(layers="-2:"),
                             model=lw.ModelOptions(model, device="cpu"), reading=lw.ReadOptions(keep=("id",)),
                             part_records=300)
    assert summary.parts == 4 and summary.records == 1200
    got = open_store(tmp_path / "ray")
    assert [open_store(part_path(tmp_path / "ray", p)).manifest["counts"]["records"] for p in range(4)] == [300] * 4
    _same(got, open_store(tmp_path / "local"))
    if fmt == "csv":
        assert got.lines[-1] == 1200 + 1200 // 5 + 1  # header, rows, and the second line of every 5th


def test_cli_engine_ray(data, tmp_path):
    root, src, model = data
    cmd = _cli(src, tmp_path / "cli", model, "--part-records", "1000")
    cmd.remove("--quiet")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    parts, complete = _summary(done.stderr)
    assert parts >= 2 and complete == 0 and "encode worker" in done.stderr
    assert "2,996 records, 4 skipped" in done.stderr
    _same(open_store(tmp_path / "cli"), open_store(root / "plain"))
    bad = subprocess.run([sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / "bad"),
                          "--engine", "spark"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "Valid engines are: local, ray" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "-o", str(tmp_path / "bad"),
                          "--engine", "ray", "--num-workers", "many"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--num-workers 'many' is not a number" in bad.stderr


OPTIONS = {  # option -> (model family, ModelOptions fields, whether it must change the features)
    "compute_dtype": ("bert", {"compute_dtype": "bfloat16"}, True),
    "quantize": ("bert", {"quantize": "int8"}, True),
    "backend": ("bert", {"backend": "torch"}, False),
    "padding_side": ("gpt2", {"padding_side": "left"}, False),
    "layer_modules": ("bert", {"layer_modules": "encoder.layer"}, False),
}


@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_every_model_option_reaches_the_ray_workers(cluster, option, arch_dirs, tmp_path):
    """Each option gives the manifest and features of a local run with the same option (one part, the same token
    budget: the same batches)."""
    family, fields, changes = OPTIONS[option]
    src = tmp_path / "c.txt"
    src.write_text("".join(f"sentence number {i} says {'more ' * (i % 7)}words\n" for i in range(40)))
    with_option = lw.ModelOptions(str(arch_dirs[family]), device="cpu", **fields)
    spec, options = lw.EncodeSpec(layers="-2:"), lw.ExtractOptions(batch_tokens=256)
    lw.ray.extract(src, tmp_path / "ray", spec, model=with_option, options=options, num_workers=1,
                   part_records=1000)
    lw.extract(src, tmp_path / "local", spec, model=with_option, options=options)
    lw.extract(src, tmp_path / "plain", spec, model=lw.ModelOptions(str(arch_dirs[family]), device="cpu"),
               options=options)
    ray_st, local, plain = (open_store(tmp_path / n) for n in ("ray", "local", "plain"))
    value = fields[option]
    assert ray_st.manifest["model_options"][option] == value == local.manifest["model_options"][option]
    assert plain.manifest["model_options"][option] in (None, "right", "auto")
    assert ray_st.model == local.model
    got, want, base = ray_st.to_numpy(), local.to_numpy(), plain.to_numpy()
    assert got.shape == want.shape == base.shape and got.shape[0] == 40
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0)
    if changes:
        assert ray_st.model["precision"] != plain.model["precision"]
        assert np.abs(got - base).max() > 1e-4  # the option took effect


RAY_ACTIVATIONS = """
import sys
import layerwise as lw

src, out, model = sys.argv[1], sys.argv[2], sys.argv[3]
kw = dict(layers=[1, 2], context_size=16, batch_tokens=128, shard_bytes=20_000,
          model=lw.ModelOptions(model, device="cpu", backend="torch"))
lw.extract_activations(src, out + "/local", **kw)
print(lw.extract_activations(src, out + "/ray", engine="ray", num_workers=2, **kw).status)
"""


def test_token_activations_on_ray_are_the_local_store(arch_dirs, tmp_path):
    """extract --context-size on Ray (a process of its own, starting its own cluster, as a user's run does): the
    compute on two actors, the same contexts, shards and layout as the local run, the values within 1e-5."""
    from layerwise.store.activations import ActivationStore

    from tiny import CORPUS

    src = tmp_path / "corpus.txt"
    src.write_text("\n".join(f"{CORPUS[i % len(CORPUS)]} number {i}" for i in range(200)) + "\n", encoding="utf-8")
    run = subprocess.run([sys.executable, "-c", RAY_ACTIVATIONS, str(src), str(tmp_path), str(arch_dirs["llama"])],
                         capture_output=True, text=True, timeout=600, env=ENV)
    assert run.returncode == 0 and run.stdout.strip().endswith("complete"), run.stderr[-3000:]
    a, b = ActivationStore(tmp_path / "local"), ActivationStore(tmp_path / "ray")
    assert [e["contexts"] for e in a.entries] == [e["contexts"] for e in b.entries] and len(a.entries) > 1
    assert np.array_equal(a.token_ids(), b.token_ids())
    assert a.manifest["runtime"]["name"] == b.manifest["runtime"]["name"] == "torch"
    for k in (1, 2):
        assert np.abs(a.to_numpy(k) - b.to_numpy(k)).max() <= 1e-5
