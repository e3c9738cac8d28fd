"""Every state is recoverable: a deleted or damaged manifest is rebuilt from the shards (``layerwise recover``), which
say what they prove; damaged, foreign, orphaned and missing shards are left out by name and a resume finishes the
store."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.store import StoreWarning, open_store, verify_store
from layerwise.store.layout import ShardFile
from layerwise.store.lock import StoreLock
from layerwise.store.recover import recover_store

from tiny import extract

ARGS = dict(layers=[1, 2], keep=["id"], shard_records=5, progress=False)  # 4 shards of 5 records
RECORDS = [{"id": i, "text": f"record {i} says " + " ".join(["alpha", "beta", "gamma"][: 1 + i % 3])}
           for i in range(20)]
SHARDS = [f"shard-00000{i}.safetensors" for i in range(7)]
STATE = ("status", "updated", "counts", "recovered")  # what a rebuilt manifest may say otherwise


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_extractors):
    root = tmp_path_factory.mktemp("recover")
    corpus = root / "in.jsonl"
    lines = [json.dumps(r) for r in RECORDS]
    lines.insert(7, '{"text": 7}')  # a bad record (line 8), in errors.jsonl
    corpus.write_text("\n".join(lines) + "\n")
    ex = tiny_extractors["bert"]
    extract(corpus, root / "clean", model=ex, **ARGS)
    extract(corpus, root / "other", model=ex, **ARGS)  # another store id
    return root, corpus, ex


def fresh(clean, tmp_path) -> Path:
    return Path(shutil.copytree(clean[0] / "clean", tmp_path / "store"))


def manifest(store: Path) -> dict:
    return json.loads((store / "manifest.json").read_text())


def records(store: Path) -> tuple:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        st = open_store(store)
        return st.lines.tolist(), st.column("id"), st.errors, st.to_numpy()


def test_a_deleted_manifest_is_rebuilt_and_the_resume_finishes_the_store(clean, tmp_path):
    """The repro: manifest.json deleted, 4 intact shards; extract refused the directory and nothing rebuilt it."""
    root, corpus, ex = clean
    store = fresh(clean, tmp_path)
    original = manifest(store)
    (store / "manifest.json").unlink()
    runner = CliRunner()
    cmd = ["extract", str(corpus), "-o", str(store), "--model", str(ex.loaded.name), "--device", "cpu", "--layers",
           "1,2", "--keep", "id", "--shard-records", "5"]
    res = runner.invoke(app, cmd)
    said = " ".join(res.output.split())
    assert res.exit_code == 2 and f"it holds 4 shard file(s): layerwise recover {store} rebuilds" in said, said
    res = runner.invoke(app, ["verify", str(store)])
    assert res.exit_code == 2 and "layerwise recover" in " ".join(res.output.split()), res.output

    res = runner.invoke(app, ["recover", str(store)])
    said = " ".join(res.output.split())
    assert res.exit_code == 0, said
    assert (f"recovered: {store}/manifest.json rebuilt from 4 shard(s): 20 records, input lines 1..21, store id "
            f"{original['id']}") in said, said
    assert "proven: 4 shard(s) hold exactly the bytes their writer sealed" in said
    assert "not proven: whether the run had finished: the manifest says running" in said
    rebuilt = manifest(store)
    assert {k: v for k, v in rebuilt.items() if k not in STATE} == {k: v for k, v in original.items() if k not in STATE}
    assert rebuilt["status"] == "running" and rebuilt["counts"] == original["counts"]  # one skipped, from errors.jsonl
    assert verify_store(store).ok

    res = runner.invoke(app, cmd)  # reads the input past line 21: nothing left, the store is complete
    assert res.exit_code == 0 and "0 records" in res.output, res.output
    assert manifest(store)["status"] == "complete"
    got, want = records(store), records(root / "clean")
    assert got[:3] == want[:3] and np.array_equal(got[3], want[3])
    res = runner.invoke(app, ["recover", str(store)])  # a readable manifest: nothing to do, nothing touched
    assert res.exit_code == 2 and "is readable: there is nothing to recover" in " ".join(res.output.split())


def test_a_cut_manifest_is_rebuilt_by_verify_repair(clean, tmp_path):
    store = fresh(clean, tmp_path)
    original = manifest(store)
    (store / "manifest.json").write_bytes((store / "manifest.json").read_bytes()[:300])  # a full disk mid-write
    res = CliRunner().invoke(app, ["verify", str(store)])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and f"layerwise verify --repair {store} fixes it without a model run" in said, said
    res = CliRunner().invoke(app, ["verify", "--repair", str(store)])
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "repaired: " in said and "rebuilt from 4 shard(s)" in said, said
    assert manifest(store)["shards"] == original["shards"]


def test_damaged_foreign_and_orphaned_shards_are_left_out_by_name(clean, tmp_path):
    """A resume that repaired shard 1 left it (damaged) beside its recomputed successors; a shard of another store
    was copied in; the manifest is then lost. The rebuilt manifest lists the chain the resume wrote."""
    root, corpus, ex = clean
    store = fresh(clean, tmp_path)
    data = bytearray((store / SHARDS[1]).read_bytes())
    body = 8 + int.from_bytes(data[:8], "little")  # a byte of the tensors, past the header (whose length varies with
    data[body + (len(data) - body) // 2] ^= 0x10  # the runtime's recorded reason): damage the seal alone can tell
    (store / SHARDS[1]).write_bytes(bytes(data))
    extract(corpus, store, model=ex, **ARGS)  # repairs: shard 1 stays (damaged, unlisted), 2.. recomputed
    listed = [e["file"] for e in manifest(store)["shards"]]
    assert SHARDS[1] not in listed and len(listed) == 4
    shutil.copy(root / "other" / SHARDS[3], store / "shard-000009.safetensors")
    (store / "manifest.json").unlink()
    report = recover_store(store)
    assert report.listed == listed and report.records == 20
    left = " | ".join(report.left_out)
    assert f"{SHARDS[1]}: its bytes are not the ones its writer sealed (damaged)" in left, left
    assert "shard-000009.safetensors: holds shard 3" in left, left  # a renamed copy of another store's shard
    assert verify_store(store).ok and records(store)[:3] == records(root / "clean")[:3]


def test_a_missing_middle_shard_ends_the_chain_and_the_resume_recomputes_from_it(clean, tmp_path):
    root, corpus, ex = clean
    store = fresh(clean, tmp_path)
    (store / SHARDS[2]).unlink()
    (store / "manifest.json").unlink()
    report = recover_store(store)
    assert report.listed == SHARDS[:2] and report.last_line == 11  # the bad record at line 8 counts as a line
    assert any(f"{SHARDS[3]}: does not follow the listed shards (it follows input line 16" in x
               for x in report.left_out), report.left_out
    summary = extract(corpus, store, model=ex, **ARGS)
    assert summary.status == "complete" and summary.resumed_from == 10 and summary.records == 10
    got, want = records(store), records(root / "clean")
    assert got[:3] == want[:3] and np.abs(got[3] - want[3]).max() <= 1e-5


def test_a_seal_covers_the_header_metadata_and_every_byte(clean, tmp_path):
    store = fresh(clean, tmp_path)
    path = store / SHARDS[0]
    assert ShardFile(path).seal_ok() is True
    raw = path.read_bytes()
    at = raw.index(b"[0, 1, 2") + 1  # the first kept id, in the header's metadata: 0 -> 1, still valid JSON
    path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1:])
    assert ShardFile(path).metadata["columns"].startswith('{"id": [1, 1, 2')
    assert ShardFile(path).seal_ok() is False
    path.write_bytes(raw + b"\0")  # bytes after the last tensor
    assert ShardFile(path).seal_ok() is False


def test_recover_refuses_what_is_not_its_to_rebuild(clean, tmp_path):
    store = fresh(clean, tmp_path)
    (store / "manifest.json").write_text(json.dumps({"name": "my web app"}))
    with pytest.raises(lw.StoreError, match="is not a layerwise store manifest; layerwise replaces only its own"):
        recover_store(store)
    assert json.loads((store / "manifest.json").read_text()) == {"name": "my web app"}
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(lw.StoreError, match="no shard of .* can rebuild its manifest: it holds no shard files"):
        recover_store(empty)


def test_a_directory_without_a_manifest_says_what_it_is(tmp_path):
    # a run on Ray killed before its first top manifest: its parts are there, and the same command finishes it
    ray_out = tmp_path / "ray-out"
    for part in ("part-00000", "part-00001"):
        (ray_out / part).mkdir(parents=True)
    with pytest.raises(lw.StoreError, match=r"holds 2 finished or started part\(s\) of a run on Ray \(part-00000, "
                                            r"part-00001\).*rerun the same layerwise extract --engine ray command"):
        verify_store(ray_out)
    # a run writing it now (before its first manifest): said, with who, and not "create one with layerwise extract"
    busy = tmp_path / "busy"
    busy.mkdir()
    with StoreLock(busy):
        with pytest.raises(lw.StoreError, match=r"\(no manifest.json\); a run is writing it now: pid \d+ on host"):
            verify_store(busy)
    with pytest.raises(lw.StoreError, match="create one with layerwise extract"):
        verify_store(busy)
