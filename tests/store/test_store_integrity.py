"""A store you can trust: every way a store can be damaged, against every command that reads or writes one.

For each damage (a shard deleted, truncated, bit-flipped, swapped, duplicated, added or replaced by another store's;
the manifest deleted, truncated, ``null``, missing a key, with an edited shape or level; a foreign file with a
store's name), at sentence, token and word level, with ``open_store``, ``inspect``, ``export``, resume and ``verify``
(``merge`` on damaged parts), the outcome is one of: (a) a refusal naming the file, (b) a repair by resume that
equals a clean run, (c) correct data. Never wrong data, never a traceback, never a lost user file.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.store import StoreWarning, merge_stores, open_store, verify_store
from layerwise.store.layout import ShardFile, save_tensors

from tiny import extract

LEVELS = ["sentence", "token", "word"]
RECORDS = [{"id": i, "text": f"record {i} says " + " ".join(["alpha", "beta", "gamma", "delta"][: 1 + i % 4])}
           for i in range(20)]
ARGS = dict(layers=[1, 2], keep=["id"], shard_records=5, progress=False)  # 4 shards of 5 records
S1, S2 = "shard-000001.safetensors", "shard-000002.safetensors"


def _write_corpus(path: Path) -> Path:
    lines = [json.dumps(r) for r in RECORDS]
    lines.insert(7, '{"text": 7}')  # a bad record (line 8), logged in errors.jsonl
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_extractors):
    """Clean stores at every level (4 shards each), the corpus, and a store of another run (another id)."""
    root = tmp_path_factory.mktemp("integrity")
    corpus = _write_corpus(root / "in.jsonl")
    ex = tiny_extractors["bert"]
    for level in LEVELS:
        extract(corpus, root / f"clean-{level}", model=ex, level=level, **ARGS)
        extract(corpus, root / f"other-{level}", model=ex, level=level, **ARGS)  # same data, another store id
    return root, corpus, ex


def fresh(clean, level: str, tmp_path: Path) -> Path:
    """A copy of the clean store of ``level`` to damage."""
    return Path(shutil.copytree(clean[0] / f"clean-{level}", tmp_path / "store"))


def contents(store, raw: bool = False) -> dict:
    """Everything a reader returns: records' features (bytes, or arrays with ``raw``), lines, kept columns, token
    ids or words, errors."""
    out = {"lines": store.lines.tolist(), "ids": store.column("id"), "errors": store.errors,
           "features": [np.array(x) if raw else np.asarray(x).tobytes() for x in store]}
    if store.level == "token":
        out["token_ids"] = [store.token_ids(i).tolist() for i in range(len(store))]
    if store.level == "word":
        out["words"] = [store.words(i) for i in range(len(store))]
    return out


def assert_same_records(path, clean_path, tol: float = 1e-5) -> None:
    """A recomputed store equals the clean one: everything exact but the features, equal within ``tol`` (a resume
    batches records differently, and a CLI run may pick another backend)."""
    got, want = read_all(path, raw=True), read_all(clean_path, raw=True)
    assert {k: v for k, v in got.items() if k != "features"} == {k: v for k, v in want.items() if k != "features"}
    assert len(got["features"]) == len(want["features"])
    for a, b in zip(got["features"], want["features"]):
        assert a.shape == b.shape and a.dtype == b.dtype and np.abs(a - b).max() <= tol


def read_all(path, raw: bool = False, **kw) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreWarning)
        return contents(open_store(path, **kw), raw)


def feature_byte(path: Path) -> int:
    """The offset of a byte inside a shard's features (the header is untouched)."""
    return ShardFile(path).data_offset("features") + 5


def flip(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x10
    path.write_bytes(bytes(data))


def names(named, text: str) -> bool:
    """Whether ``text`` names the damaged file (or one of the files that may be named first)."""
    return any(n in text for n in ((named,) if isinstance(named, str) else named))


def edit_manifest(store: Path, change) -> None:
    m = json.loads((store / "manifest.json").read_text())
    m = change(m)
    (store / "manifest.json").write_text(json.dumps(m))


def _delete(s, other):
    (s / S1).unlink()


def _truncate(s, other):
    (s / S1).write_bytes((s / S1).read_bytes()[:-40])


def _bitflip(s, other):
    flip(s / S1, feature_byte(s / S1))


def _header_length(s, other):
    data = (s / S1).read_bytes()
    (s / S1).write_bytes(struct.pack("<Q", 2**64 - 1) + data[8:])


def _swap(s, other):
    a, b = (s / S1).read_bytes(), (s / S2).read_bytes()
    (s / S1).write_bytes(b)
    (s / S2).write_bytes(a)


def _duplicate(s, other):
    shutil.copy(s / S1, s / "shard-000099.safetensors")


def _added(s, other):
    shutil.copy(other / S2, s / "shard-000004.safetensors")


def _replaced(s, other):
    shutil.copy(other / S1, s / S1)


def _manifest_deleted(s, other):
    (s / "manifest.json").unlink()


def _manifest_truncated(s, other):
    (s / "manifest.json").write_bytes((s / "manifest.json").read_bytes()[:300])


def _manifest_null(s, other):
    (s / "manifest.json").write_text("null")


def _manifest_no_spec(s, other):
    edit_manifest(s, lambda m: {k: v for k, v in m.items() if k != "spec"})


def _manifest_shape(s, other):
    edit_manifest(s, lambda m: {**m, "feature_shape": [7]})


def _manifest_level(s, other):
    def change(m):
        m["spec"]["level"] = "sentence" if m["spec"]["level"] != "sentence" else "token"
        m["spec"]["pool"] = "mean" if m["spec"]["level"] == "sentence" else None
        return m

    edit_manifest(s, change)


def _manifest_version(s, other):
    edit_manifest(s, lambda m: {**m, "format_version": 9})


def _foreign_manifest(s, other):
    (s / "manifest.json").write_text(json.dumps({"name": "my web app", "icons": []}))


# damage -> (the file a refusal must name, what reading gives: "refuse" | "same" (correct data))
DAMAGES = {
    "shard deleted": (_delete, S1, "refuse"),
    "shard truncated": (_truncate, S1, "refuse"),
    "shard bit-flipped": (_bitflip, S1, "refuse"),
    "shard header length 2^64-1": (_header_length, S1, "refuse"),
    "shards swapped": (_swap, S1, "refuse"),
    "shard duplicated": (_duplicate, "shard-000099.safetensors", "same"),
    "another store's shard added": (_added, "shard-000004.safetensors", "same"),
    "shard replaced by another store's": (_replaced, S1, "refuse"),
    "manifest deleted": (_manifest_deleted, "manifest.json", "refuse"),
    "manifest truncated": (_manifest_truncated, "manifest.json", "refuse"),
    "manifest null": (_manifest_null, "manifest.json", "refuse"),
    "manifest without spec": (_manifest_no_spec, "manifest.json", "refuse"),
    "manifest shape edited": (_manifest_shape, "shard-000000.safetensors", "refuse"),
    "manifest level edited": (_manifest_level, ("shard-000000.safetensors", "manifest.json"), "refuse"),
    "manifest format_version unknown": (_manifest_version, "manifest.json", "refuse"),
    "foreign manifest.json": (_foreign_manifest, "manifest.json", "refuse"),
}
S3 = "shard-000003.safetensors"
# a resume checks every listed shard's size, header and sha256, as verify does
RESUME_DAMAGES = {**{d: v for d, v in DAMAGES.items() if "manifest" not in d},
                  "last shard bit-flipped": (lambda s, other: flip(s / S3, feature_byte(s / S3)), S3, "refuse")}


def damaged(clean, tmp_path, level: str, entry) -> tuple[Path, object, str]:
    """A fresh copy of the clean store at ``level`` with one damage of ``DAMAGES``/``RESUME_DAMAGES`` done to it:
    ``(store, what the message names, expected outcome)``."""
    make, named, outcome = entry
    store = fresh(clean, level, tmp_path)
    make(store, clean[0] / f"other-{level}")
    return store, named, outcome


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damage_is_refused_naming_the_file_or_read_correctly(clean, tmp_path, level, damage):
    root, corpus, ex = clean
    store, named, outcome = damaged(clean, tmp_path, level, DAMAGES[damage])
    want = read_all(root / f"clean-{level}")
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    runner = CliRunner()

    # open_store with every hash checked: refuses naming the file, or gives the clean data
    if outcome == "refuse":
        with pytest.raises(lw.StoreError) as info:
            read_all(store, verify=True)
        assert names(named, str(info.value)), str(info.value)
    else:
        assert read_all(store, verify=True) == want
    # a plain open (sizes and headers, no hashing): refuses naming the file, or correct data; a flipped feature
    # byte keeps every size and header, and only the sha256 finds it (verify)
    try:
        plain = read_all(store)
    except lw.StoreError as exc:
        assert outcome == "refuse" and names(named, str(exc)), str(exc)
    else:
        assert plain == want or damage == "shard bit-flipped", damage

    # verify: exit 1 naming the file (2 when it is no store at all), 0 with a note for an unlisted file
    res = runner.invoke(app, ["verify", str(store)])
    assert "bug in layerwise" not in res.output and "Traceback" not in res.output
    assert names(named, res.output), res.output
    if outcome == "same":
        assert res.exit_code == 0 and "not listed in the manifest" in res.output
    else:
        assert res.exit_code in ((2,) if "manifest deleted" in damage or "foreign" in damage else (1, 2)), res.output

    # inspect: one error line naming the file, or the store
    res = runner.invoke(app, ["inspect", str(store), "--sample", "30"], env={"COLUMNS": "200"})
    assert "bug in layerwise" not in res.output and "Traceback" not in res.output, res.output
    assert res.exit_code == (0 if outcome == "same" or damage == "shard bit-flipped" else 2), res.output
    if res.exit_code == 2:
        assert names(named, res.output), res.output

    # export: refused naming the file (every hash is checked first), or the clean data exported
    out = tmp_path / "out-npy"
    res = runner.invoke(app, ["export", str(store), "--to", "npy", "-o", str(out)])
    assert "bug in layerwise" not in res.output and "Traceback" not in res.output
    if outcome == "refuse":
        assert res.exit_code == 2 and names(named, res.output) and not out.exists(), res.output
    else:
        assert res.exit_code == 0, res.output

    # nothing above changed a byte of the store
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("damage", list(RESUME_DAMAGES))
def test_resume_repairs_shard_damage_to_equal_a_clean_run(clean, tmp_path, level, damage):
    root, corpus, ex = clean
    store, named, outcome = damaged(clean, tmp_path, level, RESUME_DAMAGES[damage])
    kept = {p.name: p.read_bytes() for p in store.iterdir() if p.name not in ("manifest.json", "errors.jsonl")}
    summary = extract(corpus, store, model=ex, level=level, **ARGS)
    if outcome == "refuse":
        assert summary.status == "complete" and summary.repairs and summary.records > 0, summary
        assert any(named in r for r in summary.repairs), summary.repairs
    else:
        assert summary.status == "already_complete"  # an unlisted copy changes nothing
    assert_same_records(store, root / f"clean-{level}")
    assert verify_store(store).ok
    listed = [e["file"] for e in json.loads((store / "manifest.json").read_text())["shards"]]
    assert len(listed) == len(set(listed)) == 4
    # a damaged file is left where it was (no longer listed), never overwritten; an intact one of ours is redone
    for name, data in kept.items():
        if name not in listed and (store / name).exists():
            assert (store / name).read_bytes() == data


@pytest.mark.parametrize("damage", [d for d in DAMAGES if "manifest" in d])
def test_resume_refuses_a_damaged_or_foreign_manifest_and_touches_nothing(clean, tmp_path, damage):
    root, corpus, ex = clean
    make, named, outcome = DAMAGES[damage]
    store = fresh(clean, "sentence", tmp_path)
    make(store, root / "other-sentence")
    (store / "index.html").write_text("<h1>mine</h1>")
    if "manifest deleted" in damage or "foreign" in damage:
        (store / "errors.jsonl").write_text("my own log\n")
    before = {p.name: p.read_bytes() for p in store.iterdir()}
    res = CliRunner().invoke(app, ["extract", str(corpus), "-o", str(store), "--layers", "1,2", "--keep", "id",
                                   "--shard-records", "5", "--model", str(ex.loaded.name), "--quiet"])
    if damage in ("manifest shape edited", "manifest level edited"):  # a readable manifest of other options
        assert res.exit_code == 2 and "made with other options" in res.output, res.output
    else:
        assert res.exit_code == 2 and "manifest.json" in res.output, res.output
    assert "bug in layerwise" not in res.output and "Traceback" not in res.output
    assert {p.name: p.read_bytes() for p in store.iterdir()} == before
    if "foreign" in damage or "deleted" in damage:  # not a layerwise store: --overwrite does not replace it either
        res = CliRunner().invoke(app, ["extract", str(corpus), "-o", str(store), "--model", str(ex.loaded.name),
                                       "--overwrite", "--quiet"])
        assert res.exit_code == 2 and {p.name: p.read_bytes() for p in store.iterdir()} == before, res.output


def test_deleted_middle_shard_of_a_stopped_run_is_recomputed_without_overwriting(clean, tmp_path):
    """The first repro: 4 shards of a run stopped early, the middle shard deleted, the same command again."""
    root, corpus, ex = clean
    store = tmp_path / "s"
    extract(corpus, store, model=ex, max_records=20, **{**ARGS, "shard_records": 5})
    extract(corpus, store, model=ex, **ARGS)
    (store / S1).unlink()
    shard3 = (store / "shard-000003.safetensors").read_bytes()
    summary = extract(corpus, store, model=ex, **ARGS)
    assert summary.resumed_from == 5 and summary.records == 15 and "shard-000001" in " ".join(summary.repairs)
    assert_same_records(store, root / "clean-sentence")
    manifest = json.loads((store / "manifest.json").read_text())
    assert [e["file"] for e in manifest["shards"]] == [f"shard-00000{i}.safetensors" for i in range(4)]
    assert (store / "shard-000003.safetensors").read_bytes() != shard3 or verify_store(store).ok


def test_a_deleted_shard_is_not_already_complete(clean, tmp_path):
    root, corpus, ex = clean
    store = fresh(clean, "sentence", tmp_path)
    (store / "shard-000003.safetensors").unlink()
    res = CliRunner().invoke(app, ["extract", str(corpus), "-o", str(store), "--layers", "1,2", "--keep", "id",
                                   "--shard-records", "5", "--model", str(ex.loaded.name)])
    assert res.exit_code == 0 and "already complete" not in res.output, res.output
    assert "repaired: shard-000003.safetensors: missing" in res.output
    assert_same_records(store, root / "clean-sentence")


def test_an_extra_copy_is_ignored_with_a_warning(clean, tmp_path):
    store = fresh(clean, "sentence", tmp_path)
    shutil.copy(store / S1, store / "shard-000099.safetensors")
    with pytest.warns(StoreWarning, match=r"shard-000099\.safetensors"):
        st = open_store(store)
    assert len(st) == 20


def test_merge_refuses_a_part_that_lacks_a_shard_or_was_changed(clean, tmp_path):
    root, corpus, ex = clean
    parts = [tmp_path / f"p{i}" for i in range(2)]
    for i, part in enumerate(parts):
        extract(corpus, part, model=ex, num_shards=2, shard_index=i, **{**ARGS, "shard_records": 3})
    whole = tmp_path / "whole"
    merge_stores(parts, whole)
    assert_same_records(whole, root / "clean-sentence")
    flip(parts[1] / S1, feature_byte(parts[1] / S1))
    with pytest.raises(lw.StoreCorruptError, match=rf"{S1}: sha256 .*its bytes changed"):
        merge_stores(parts, tmp_path / "m1")
    (parts[1] / S1).unlink()
    with pytest.raises(lw.StoreCorruptError, match=rf"{S1}: missing"):
        merge_stores(parts, tmp_path / "m2")
    res = CliRunner().invoke(app, ["merge", *map(str, parts), "-o", str(tmp_path / "m3")])
    assert res.exit_code == 2 and S1 in res.output and "Traceback" not in res.output
    assert not (tmp_path / "m1").exists() or not any((tmp_path / "m1").glob("shard-*"))


def test_overwrite_never_replaces_a_foreign_directory(clean, tmp_path):
    root, corpus, ex = clean
    out = tmp_path / "site"
    out.mkdir()
    files = {"manifest.json": '{"name": "my web app"}', "errors.jsonl": "mine\n", "index.html": "<h1>hi</h1>"}
    for name, text in files.items():
        (out / name).write_text(text)
    with pytest.raises(lw.StoreError, match=r"not a layerwise store's .*errors\.jsonl, index\.html, manifest\.json"):
        extract(corpus, out, model=ex, overwrite=True, **ARGS)
    assert {p.name: p.read_text() for p in out.iterdir()} == files


def test_overwrite_replaces_only_a_stores_own_files(clean, tmp_path):
    root, corpus, ex = clean
    store = fresh(clean, "sentence", tmp_path)
    (store / "notes.txt").write_text("mine")
    (store / ".draft.tmp-12").write_text("mine too")  # a dotfile with ".tmp-" that layerwise did not write
    extract(corpus, store, model=ex, overwrite=True, **{**ARGS, "layers": [2]})
    assert (store / "notes.txt").read_text() == "mine" and (store / ".draft.tmp-12").read_text() == "mine too"
    assert open_store(store).spec.layers == (2,)
    summary = extract(corpus, store, model=ex, **{**ARGS, "layers": [2]})  # "already complete" keeps them too
    assert summary.status == "already_complete" and (store / ".draft.tmp-12").exists()


def test_a_dead_writers_temporary_file_is_removed_a_live_ones_is_not(clean, tmp_path):
    root, corpus, ex = clean
    store = fresh(clean, "sentence", tmp_path)
    dead, live = store / ".shard-000004.safetensors.tmp-999999999", store / f".manifest.json.tmp-{1}"
    dead.write_bytes(b"half")
    live.write_bytes(b"pid 1 is alive")
    extract(corpus, store, model=ex, **ARGS)
    assert not dead.exists() and live.exists()


@pytest.mark.parametrize("change, field", [
    (lambda m: {k: v for k, v in m.items() if k != "spec"}, "field 'spec' is missing"),
    (lambda m: None, "holds null instead of a JSON object"),
    (lambda m: {**m, "feature_shape": "big"}, "field 'feature_shape' is 'big'"),
    (lambda m: {**m, "status": "done"}, "field 'status' is 'done'"),
    (lambda m: {**m, "shards": [m["shards"][0], m["shards"][0]]}, r"shards\[1\]\.file.*listed twice"),
    (lambda m: {**m, "shards": [{**m["shards"][0], "bytes": "x"}]}, r"shards\[0\]\.bytes"),
    (lambda m: {**m, "counts": {**m["counts"], "records": 999}}, "counts.records"),
])
def test_a_damaged_manifest_names_the_file_the_field_and_the_fix(clean, tmp_path, change, field):
    store = fresh(clean, "sentence", tmp_path)
    edit_manifest(store, change)
    with pytest.raises(lw.StoreCorruptError,
                       match=rf"manifest\.json' is damaged: .*{field}.*layerwise recover on the store to rebuild"):
        open_store(store)


def test_json_errors_name_the_file(clean, tmp_path):
    store = fresh(clean, "sentence", tmp_path)
    (store / "manifest.json").write_text("{not json")
    with pytest.raises(lw.StoreCorruptError, match=r"manifest\.json' is damaged: not valid JSON"):
        open_store(store)
    store2 = fresh(clean, "token", tmp_path / "b")
    (store2 / "errors.jsonl").write_text("{cut")
    with pytest.raises(lw.StoreCorruptError, match=r"errors\.jsonl' is damaged: line 1 is not JSON"):
        _ = open_store(store2).errors


def test_verify_says_intact_and_lists_problems(clean, tmp_path):
    store = fresh(clean, "word", tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["verify", str(store)])
    assert res.exit_code == 0 and "intact (4 shards, 20 records)" in res.output, res.output
    assert open_store(store).verify().ok
    flip(store / S1, feature_byte(store / S1))
    (store / "shard-000003.safetensors").unlink()
    res = runner.invoke(app, ["verify", str(store)])
    problems = [line for line in res.stdout.splitlines() if line]
    assert res.exit_code == 1 and len(problems) == 2, res.output
    assert "shard-000001.safetensors: sha256" in problems[0] and "shard-000003.safetensors: missing" in problems[1]
    assert runner.invoke(app, ["verify", str(tmp_path / "nothing")]).exit_code == 2


def test_verify_finds_inner_inconsistency_that_keeps_the_hash_listed(clean, tmp_path):
    """A shard rewritten consistently by hand (new hash listed) but with offsets out of order: verify sees it."""
    store = fresh(clean, "token", tmp_path)
    sf = ShardFile(store / S1)
    tensors = {k: np.array(sf.array(k)) for k in sf.keys()}
    tensors["offsets"][2] = tensors["offsets"][1] - 1
    written = save_tensors(store / S1, tensors, sf.metadata)
    edit_manifest(store, lambda m: {**m, "shards": [
        {**e, "bytes": written.bytes, "sha256": written.sha256} if e["file"] == S1 else e for e in m["shards"]]})
    report = verify_store(store)
    assert [p for p in report.problems] == [f"{S1}: offsets do not run from 0 up to its "
                                            f"{json.loads((store / 'manifest.json').read_text())['shards'][1]['rows']}"
                                            f" rows"]


def test_shards_are_safetensors_any_reader_reads_and_hashed_as_written(clean):
    from safetensors.numpy import load_file

    store = clean[0] / "clean-token"
    manifest = json.loads((store / "manifest.json").read_text())
    for entry in manifest["shards"]:
        data = (store / entry["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
        loaded = load_file(str(store / entry["file"]))
        sf = ShardFile(store / entry["file"])
        assert sorted(loaded) == sorted(sf.keys())
        assert all(np.array_equal(loaded[k], sf.array(k)) for k in loaded)
        assert sf.metadata["store"] == manifest["id"] and sf.metadata["shard"] == str(int(entry["file"][6:12]))


def test_a_format_2_store_opens_and_verify_says_the_hashes_are_absent(clean, tmp_path):
    store = fresh(clean, "sentence", tmp_path)

    def as_v2(m):
        m["format_version"] = 2
        m.pop("id")
        for e in m["shards"]:
            e.pop("sha256")
        return m

    edit_manifest(store, as_v2)
    assert read_all(store) == read_all(clean[0] / "clean-sentence")
    report = verify_store(store)
    assert report.ok and any("no sha256 recorded" in n for n in report.notes)
    res = CliRunner().invoke(app, ["verify", str(store)])
    assert res.exit_code == 0 and "no sha256 recorded" in res.output


@pytest.fixture(scope="module")
def small(tmp_path_factory, tiny_extractors):
    root = tmp_path_factory.mktemp("hyp")
    corpus = _write_corpus(root / "in.jsonl")
    store = root / "store"
    extract(corpus, store, model=tiny_extractors["bert"], level="token", **ARGS)
    return store, read_all(store)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_whatever_bytes_a_shard_holds_the_reader_refuses_or_returns_the_original(small, tmp_path_factory, data):
    store, want = small
    work = Path(shutil.copytree(store, tmp_path_factory.mktemp("h") / "s"))
    path = work / S1
    raw = bytearray(path.read_bytes())
    kind = data.draw(st.sampled_from(["overwrite", "truncate", "extend"]))
    if kind == "overwrite":
        at = data.draw(st.integers(0, len(raw) - 1))
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        raw[at:at + len(chunk)] = chunk
        raw = raw[:len(path.read_bytes())] if len(raw) > len(path.read_bytes()) else raw
    elif kind == "truncate":
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        raw += data.draw(st.binary(min_size=1, max_size=64))
    path.write_bytes(bytes(raw))
    try:
        got = read_all(work, verify=True)
    except lw.StoreCorruptError as exc:
        assert S1 in str(exc)
    else:
        assert got == want
    try:  # a plain open never fails otherwise: a StoreCorruptError, or records of the listed shapes
        plain = read_all(work)
    except lw.StoreCorruptError as exc:
        assert S1 in str(exc)
    else:
        assert [len(f) for f in plain["features"]] == [len(f) for f in want["features"]]


def test_explore_on_a_damaged_store_is_one_error_line(clean, tmp_path):
    store = fresh(clean, "sentence", tmp_path)
    (store / S1).unlink()
    res = CliRunner().invoke(app, ["explore", str(store), "--model", str(clean[2].loaded.name)])
    assert res.exit_code == 2 and f"{S1}: missing" in res.output and "Traceback" not in res.output, res.output
