"""A resume checks what it relies on: every listed shard's sha256, so damage anywhere is recomputed from the first
damaged shard (the fault matrix: a flipped byte in the header length, the header, its padding and each tensor of
each of 3 shards); ``verify``'s advice is true; ``verify --repair`` fixes what needs no model run."""

from __future__ import annotations

import json
import os
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
from layerwise.store.lock import LOCK

from tiny import extract

ARGS = dict(layers=[1, 2], level="token", keep=["id"], shard_records=5, progress=False)  # 3 shards of 5 records
SHARDS = [f"shard-00000{i}.safetensors" for i in range(3)]
TENSORS = ("features", "lines", "offsets", "token_ids")


def corpus(path: Path, pad: int) -> Path:
    """15 records; ``pad`` varies the kept ids' length (and so each shard header's length)."""
    path.write_text("".join(json.dumps({"id": "x" * pad + str(i), "text": f"record {i} says " + "alpha beta "[: i]})
                            + "\n" for i in range(15)))
    return path


def padding(path: Path) -> range:
    """Where the spaces that pad a shard's JSON header to a multiple of 8 are."""
    data = path.read_bytes()
    size = int.from_bytes(data[:8], "little")
    header = data[8:8 + size]
    return range(8 + len(header.rstrip(b" ")), 8 + size)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_extractors):
    """A clean 3-shard token-level store whose 3 shard headers all end in padding, and its corpus."""
    root = tmp_path_factory.mktemp("resume")
    ex = tiny_extractors["bert"]
    for pad in range(12):
        store = root / f"clean-{pad}"
        data = corpus(root / f"in-{pad}.jsonl", pad)
        extract(data, store, model=ex, **ARGS)
        if all(len(padding(store / s)) for s in SHARDS):
            return store, data, ex
    raise AssertionError("no corpus gave padded headers in all 3 shards")


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def position(path: Path, where: str) -> int:
    shard = ShardFile(path)
    if where == "header length":
        return 1
    if where == "header":
        return 8 + (padding(path).start - 8) // 2  # the middle of the JSON
    if where == "padding":
        return padding(path).start
    begin = shard.data_offset(where)
    return begin + shard.dtype(where).itemsize * int(np.prod(shard.shape(where))) // 2  # the middle of the tensor


def contents(path: Path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)  # a damaged file left in place, no longer listed
        st = open_store(path)
        return {"lines": st.lines.tolist(), "ids": st.column("id"), "errors": st.errors,
                "token_ids": [st.token_ids(i).tolist() for i in range(len(st))],
                "features": [np.array(x) for x in st], "complete": st.complete}


@pytest.mark.parametrize("shard", [0, 1, 2])
@pytest.mark.parametrize("where", ["header length", "header", "padding", *TENSORS])
def test_fault_matrix_a_flipped_byte_anywhere_is_recomputed_by_the_resume(clean, tmp_path, shard, where):
    store, data, ex = clean
    work = Path(shutil.copytree(store, tmp_path / "store"))
    name = SHARDS[shard]
    flip(work / name, position(work / name, where))
    summary = extract(data, work, model=ex, **ARGS)
    assert summary.status == "complete" and summary.resumed_from == 5 * shard, summary
    assert summary.records == 15 - 5 * shard and any(name in r for r in summary.repairs), summary.repairs
    got, want = contents(work), contents(store)
    assert {k: v for k, v in got.items() if k != "features"} == {k: v for k, v in want.items() if k != "features"}
    assert all(a.shape == b.shape and np.abs(a - b).max() <= 1e-5 for a, b in zip(got["features"], want["features"]))
    report = verify_store(work)
    assert report.ok and report.records == 15, report.problems
    assert not (work / LOCK).exists()


def test_verifys_advice_is_true_a_rerun_repairs_a_flipped_byte_in_the_middle_shard(clean, tmp_path):
    """The repro: one byte flipped in the middle of shard-000001; verify says to rerun the extract command; the
    rerun repairs it (it used to say 'already complete' and leave the damage)."""
    store, data, ex = clean
    work = Path(shutil.copytree(store, tmp_path / "store"))
    size = (work / SHARDS[1]).stat().st_size
    flip(work / SHARDS[1], size // 2)
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(work)])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and f"{SHARDS[1]}: sha256" in said, said
    assert "rerun the extract command to repair it (a model run is needed from shard-000001.safetensors on" in said
    assert "recomputes from input line 6 (10 records in 2 shard(s) listed now)" in said, said
    cmd = ["extract", str(data), "-o", str(work), "--model", str(ex.loaded.name), "--device", "cpu", "--layers",
           "1,2", "--level", "token", "--keep", "id", "--shard-records", "5"]
    res = runner.invoke(app, cmd)
    assert res.exit_code == 0 and "already complete" not in res.output, res.output
    assert f"repaired: {SHARDS[1]}: sha256" in res.output and "recomputing from input line 6" in res.output
    res = runner.invoke(app, ["verify", str(work)])
    assert res.exit_code == 0 and "intact (3 shards, 15 records)" in res.output, res.output
    res = runner.invoke(app, cmd)  # and now it is complete
    assert res.exit_code == 0 and "already complete" in res.output, res.output


def test_the_headers_check_relies_on_what_it_does_not_hash(clean, tmp_path):
    """resume_check='headers' keeps the old, cheaper check: a flipped feature byte of a middle shard passes it."""
    store, data, ex = clean
    work = Path(shutil.copytree(store, tmp_path / "store"))
    flip(work / SHARDS[1], position(work / SHARDS[1], "features"))
    assert extract(data, work, model=ex, resume_check="headers", **ARGS).status == "already_complete"
    assert not verify_store(work).ok
    with pytest.raises(lw.ExtractError, match=r"resume_check='md5' is not one of sha256, headers"):
        extract(data, work, model=ex, resume_check="md5", **ARGS)


def edit(store: Path, change) -> None:
    m = json.loads((store / "manifest.json").read_text())
    change(m)
    (store / "manifest.json").write_text(json.dumps(m))


def test_verify_repair_fixes_a_wrong_listing_unlisted_shards_and_a_dead_writers_leftovers(clean, tmp_path):
    store, data, ex = clean
    work = Path(shutil.copytree(store, tmp_path / "store"))

    def damage(m):
        m["shards"][0]["tokens"] += 7  # a listing the shard contradicts (its bytes are intact)
        dropped = m["shards"].pop()  # a shard finished, not yet listed (killed before the manifest update)
        m["counts"]["records"] -= dropped["records"]
        m["status"] = "running"

    edit(work, damage)
    (work / LOCK).write_text(json.dumps({"format": "layerwise-store-lock", "pid": 999999999, "host": os.uname()[1],
                                         "since": "2026-11-25T10:00:00+00:00", "command": "layerwise extract"}))
    (work / ".shard-000003.safetensors.tmp-999999999").write_bytes(b"half")
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(work)])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and f"{SHARDS[0]}: holds" in said and "tokens" in said, said
    assert f"layerwise verify --repair {work} fixes it without a model run" in said, said
    res = runner.invoke(app, ["verify", "--repair", str(work)])
    said = " ".join(res.output.split())
    assert res.exit_code == 0 and "intact (3 shards, 15 records)" in said, said
    assert "repaired: removed the stale lock of pid 999999999" in said
    assert "repaired: removed 1 half-written temporary file(s)" in said
    assert f"repaired: {SHARDS[0]}: its listing was wrong (tokens " in said
    assert f"repaired: listed {SHARDS[2]} (5 records): finished before an interruption" in said, said
    assert "the run stopped before it finished" in said  # it cannot say the input was read to its end
    assert not (work / LOCK).exists() and not list(work.glob(".*.tmp-*"))
    mine, theirs = json.loads((work / "manifest.json").read_text()), json.loads((store / "manifest.json").read_text())
    assert mine["shards"] == theirs["shards"] and mine["counts"] == theirs["counts"]
    assert extract(data, work, model=ex, **ARGS).records == 0  # the resume finds nothing left to compute


def test_verify_repair_says_when_a_model_run_is_needed_and_changes_nothing(clean, tmp_path):
    store, data, ex = clean
    work = Path(shutil.copytree(store, tmp_path / "store"))
    flip(work / SHARDS[2], position(work / SHARDS[2], "lines"))
    before = {p.name: p.read_bytes() for p in work.iterdir()}
    res = CliRunner().invoke(app, ["verify", "--repair", str(work)])
    said = " ".join(res.output.split())
    assert res.exit_code == 1 and "nothing to repair without a model run" in said, said
    assert "a model run is needed from shard-000002.safetensors on: rerun the extract command" in said, said
    assert {p.name: p.read_bytes() for p in work.iterdir()} == before
