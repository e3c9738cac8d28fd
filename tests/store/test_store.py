"""The feature store: protection of existing stores, resume with max_records, the reader API, export, and the CLI.

Every store is written by the tiny BERT from small inputs in ``tmp_path``. Exports are read back with h5py,
pandas/pyarrow and numpy only (no layerwise).
"""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.store import export, open_store

from tiny import extract

TEXTS = [
    "EU rejects German call",
    "Peter Blackburn",
    "I love Paris in the springtime",
    "a",
    "naïve cafés",
    "the lazy dog",
]
JSONL = [{"id": 100 + i, "text": t, "label": "pos" if i % 2 else "neg"} for i, t in enumerate(TEXTS)]


@pytest.fixture(scope="module")
def bert(tiny_extractors):
    return tiny_extractors["bert"]


@pytest.fixture
def corpus(tmp_path):
    p = tmp_path / "in.jsonl"
    lines = [json.dumps(r, ensure_ascii=False) for r in JSONL]
    lines.insert(2, '{"text": 7}')  # a bad record on line 3
    p.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return p


def snapshot(root):
    return {
        p.relative_to(root).as_posix(): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_same(a, b, tol=1e-5):
    """Two stores hold the same records (features within ``tol``: batching differs), lines, columns and errors."""
    assert len(a) == len(b) and a.lines.tolist() == b.lines.tolist() and a.errors == b.errors
    assert a.columns == b.columns and all(a.column(c) == b.column(c) for c in a.columns)
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype and np.abs(x.astype(np.float32) - y).max() <= tol


BASE = dict(layers=[1, 2], pool="mean", keep=["id", "label"], shard_records=2)


@pytest.mark.parametrize(
    "change, name",
    [
        ({"layers": 0}, "spec.layers"),
        ({"pool": "max"}, "spec.pool"),
        ({"output_dtype": "float16"}, "spec.output_dtype"),
        ({"combine": "sum"}, "spec.combine"),
        ({"level": "token", "pool": None}, "spec.level"),
        ({"keep": ["id"]}, "input.keep"),
        ({"input": "edit"}, "its sha256 is"),  # said as a changed input, not as an option
    ],
)
def test_rerun_with_other_options_is_refused_and_changes_nothing(bert, tmp_path, corpus, change, name):
    store = tmp_path / "s"
    extract(corpus, store, model=bert, **BASE)
    before = snapshot(store)
    kw = {**BASE, **change}
    if kw.pop("input", None):
        with open(corpus, "a", encoding="utf-8") as fh:
            fh.write('{"text": "one more", "id": 1, "label": "x"}\n')
    said = "the input .* changed since the store" if "input" in change else "holds a store made with other options"
    with pytest.raises(lw.StoreError, match=said) as info:
        extract(corpus, store, model=bert, **kw)
    assert name in str(info.value) and "--overwrite" in str(info.value)
    assert snapshot(store) == before
    kw["overwrite"] = True  # replaces it: same content as a fresh run with the new options
    extract(corpus, store, model=bert, **kw)
    extract(corpus, tmp_path / "fresh", model=bert, **kw)
    assert_same(open_store(store), open_store(tmp_path / "fresh"))
    assert sorted(os.listdir(store)) == sorted(os.listdir(tmp_path / "fresh"))


def test_overwrite_removes_every_old_shard(bert, tmp_path, corpus):
    store = tmp_path / "s"
    extract(corpus, store, model=bert, layers=0, shard_records=1)
    assert open_store(store).num_shards == 6
    extract(corpus, store, model=bert, layers=-1, pool="cls", overwrite=True)
    st = open_store(store)
    assert st.num_shards == 1
    assert sorted(os.listdir(store)) == ["errors.jsonl", "manifest.json", "shard-000000.safetensors"]
    good = [r["text"] for r in JSONL]
    assert np.abs(st.to_numpy() - bert.encode(good, layers=-1, pool="cls")).max() <= 1e-5


def test_non_store_directory_is_refused_and_untouched(bert, tmp_path, corpus):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    (other / "shard-000000.safetensors").write_bytes(b"not ours")
    before = snapshot(other)
    for overwrite in (False, True):
        with pytest.raises(lw.StoreError, match="is not a layerwise store"):
            extract(corpus, other, model=bert, overwrite=overwrite)
        assert snapshot(other) == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(lw.StoreError, match="is a file"):
        extract(corpus, tmp_path / "afile", model=bert)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert extract(corpus, empty, model=bert).records == len(JSONL)  # an empty directory is fine


def test_finished_store_rerun_is_already_complete_and_writes_nothing(bert, tmp_path, corpus):
    store = tmp_path / "s"
    first = extract(corpus, store, model=bert, **BASE)
    assert first.status == "complete" and first.records == 6 and first.skipped == 1 and first.shards_written == 3
    before = snapshot(store)
    again = extract(corpus, store, model=bert, **BASE)
    assert again.status == "already_complete" and again.records == 0 and again.bytes_written == 0
    assert again.total_records == 6 and "already complete" in again.line()
    assert snapshot(store) == before


def test_max_records_partial_then_continue_equals_direct_run(bert, tmp_path, corpus):
    store = tmp_path / "s"
    s1 = extract(corpus, store, model=bert, max_records=3, **BASE)
    st = open_store(store)
    assert s1.status == "partial" and len(st) == 3 and not st.complete and st.manifest["status"] == "partial"
    assert st.lines.tolist() == [1, 2, 4] and st.errors == [{"line": 3, "reason": st.errors[0]["reason"]}]
    s2 = extract(corpus, store, model=bert, max_records=5, **BASE)
    assert s2.status == "partial" and s2.resumed_from == 3 and s2.records == 2 and s2.total_records == 5
    direct = extract(corpus, tmp_path / "direct", model=bert, max_records=5, **BASE)
    assert direct.total_records == 5
    assert_same(open_store(store), open_store(tmp_path / "direct"))
    # the same counts, but for the bytes: the resumed store's shards end where each run stopped, so their headers
    # (which list each shard's columns, padded to 8 bytes) differ in length from the direct run's; each store's bytes
    # are its own shard files'
    resumed, straight = (open_store(p).manifest["counts"] for p in (store, tmp_path / "direct"))
    assert {**resumed, "bytes": None} == {**straight, "bytes": None}
    for path, counts in ((store, resumed), (tmp_path / "direct", straight)):
        assert counts["bytes"] == sum(f.stat().st_size for f in path.glob("shard-*.safetensors"))
    s3 = extract(corpus, store, model=bert, **BASE)  # no limit: runs to the end
    assert s3.status == "complete" and s3.total_records == 6
    extract(corpus, tmp_path / "full", model=bert, **BASE)
    assert_same(open_store(store), open_store(tmp_path / "full"))
    assert len(open_store(store).errors) == 1


@pytest.fixture
def stores(bert, tmp_path, corpus):
    """{(level, multi): store} at sentence and token level, one shard vs shards of 2 records."""
    out = {}
    for level in ("sentence", "token"):
        for multi in (False, True):
            path = tmp_path / f"{level}-{multi}"
            extract(
                corpus,
                path,
                model=bert,
                layers=[1, 2],
                level=level,
                keep=["id", "label"],
                shard_records=2 if multi else 100,
            )
            out[level, multi] = open_store(path)
    return out


def test_reader_api_sentence_level(bert, stores):
    good = [r["text"] for r in JSONL]
    want = bert.encode(good, layers=[1, 2], pool="mean")
    one, many = stores["sentence", False], stores["sentence", True]
    assert (one.num_shards, many.num_shards) == (1, 3)
    for st in (one, many):
        assert len(st) == 6 and st.feature_shape == (64,) and st.level == "sentence"
        assert np.abs(st.to_numpy() - want).max() <= 1e-5
        assert np.abs(st[-1] - want[5]).max() <= 1e-5 and np.abs(st[-6] - want[0]).max() <= 1e-5
        assert np.abs(st[np.int64(2)] - want[2]).max() <= 1e-5
        for bad in (6, -7):
            with pytest.raises(IndexError, match="out of range"):
                st[bad]
        assert np.abs(np.stack(list(st)) - want).max() <= 1e-5
        chunks = list(st.iter_chunks(4))
        assert all(len(c) <= 4 for c in chunks) and np.abs(np.concatenate(chunks) - want).max() <= 1e-5
        assert st.lines.tolist() == [1, 2, 4, 5, 6, 7]
        assert st.columns == ["id", "label"] and st.column("id") == [r["id"] for r in JSONL]
        assert st.column("label") == [r["label"] for r in JSONL]
        with pytest.raises(KeyError, match="was not kept"):
            st.column("text")
        with pytest.raises(ValueError, match="token- and word-level"):
            st.ragged()
    assert_same(one, many)


def test_reader_api_token_level(bert, stores):
    good = [r["text"] for r in JSONL]
    want = bert.encode(good, layers=[1, 2], pool=None)
    one, many = stores["token", False], stores["token", True]
    for st in (one, many):
        with pytest.raises(ValueError, match="token-level"):
            st.to_numpy()
        rows, offsets = st.ragged()
        assert offsets.tolist() == [0, *np.cumsum([w.shape[0] for w in want]).tolist()]
        assert rows.shape == (offsets[-1], 64) and st.num_rows == offsets[-1]
        for i, w in enumerate(want):
            assert np.abs(rows[offsets[i] : offsets[i + 1]] - w).max() <= 1e-5
            assert np.array_equal(st[i], rows[offsets[i] : offsets[i + 1]])
        assert [x.shape for x in st] == [w.shape for w in want]
        chunked = [x for c in st.iter_chunks(3) for x in c]
        assert all(np.array_equal(a, b) for a, b in zip(chunked, st)) and len(chunked) == 6
        assert st.token_ids(-1).tolist() == bert.tokenizer(good[-1])["input_ids"]
    assert_same(one, many)
    with pytest.raises(ValueError, match="word-level"):
        one.words(0)
    with pytest.raises(ValueError, match="token-level"):
        stores["sentence", True].token_ids(0)
    with pytest.raises(ValueError, match="not a layerwise store"):
        open_store(one.path.parent)


def test_manifest_provenance(bert, stores, corpus, tiny_extractors, tmp_path):
    st = stores["token", True]
    m, o, model = st.manifest, st.spec, st.model
    assert m["format"] == "layerwise-store" and m["layerwise_version"] == lw.__version__ and m["status"] == "complete"
    assert m["format_version"] == 3 and lw.EncodeSpec.from_dict(m["spec"]) == o  # the manifest holds the spec
    assert model["name"] == bert.loaded.name and model["fingerprint"] == bert.fingerprint()
    assert len(model["fingerprint"]) == 64 and int(model["fingerprint"], 16) >= 0
    got = (o.layers, o.site, o.combine, o.pool, o.level, o.output_dtype)
    assert got == ((1, 2), "block", "concat", None, "token", "float32")
    assert m["tokenizer"]["vocab_size"] == len(bert.tokenizer)
    assert m["tokenizer"]["class"] == type(bert.tokenizer).__name__
    assert m["input"]["path"] == os.path.abspath(corpus) and m["input"]["format"] == "jsonl"
    assert m["input"]["sha256"] == hashlib.sha256(corpus.read_bytes()).hexdigest()
    assert m["input"]["keep"] == ["id", "label"]
    tokens = sum(len(bert.tokenizer(r["text"])["input_ids"]) for r in JSONL)
    want = {"records": 6, "rows": tokens, "tokens": tokens, "skipped": 1, "shards": 3, "bytes": st.nbytes}
    assert m["counts"] == want
    assert stores["sentence", False].spec.pool == "mean"
    extract(corpus, tmp_path / "rob", model=tiny_extractors["roberta"])
    rob = open_store(tmp_path / "rob").model
    assert rob["fingerprint"] != model["fingerprint"] and rob["family"] == "roberta"


def read_export(path, to, level):
    """(features per record, lines, columns) read with h5py / pandas / numpy only."""
    if to == "npy":
        load = lambda n: np.load(path / f"{n}.npy", allow_pickle=False)  # noqa: E731
        feats, lines, cols = load("features"), load("lines"), {c: load(c).tolist() for c in ("id", "label")}
        offsets = load("offsets") if level != "sentence" else None
    elif to == "hdf5":
        import h5py

        with h5py.File(path, "r") as f:
            feats, lines = f["features"][()], f["lines"][()]
            offsets = f["offsets"][()] if level != "sentence" else None
            cols = {"id": f["columns/id"][()].tolist(), "label": [x.decode() for x in f["columns/label"][()]]}
    else:
        import pandas as pd

        df = pd.read_parquet(path)
        lines, cols = df["line"].to_numpy(), {"id": df["id"].tolist(), "label": df["label"].tolist()}
        recs = [np.asarray(np.stack(list(x)) if level != "sentence" else x, dtype=np.float32) for x in df["features"]]
        return recs, lines.tolist(), cols
    recs = list(feats) if offsets is None else [feats[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
    return recs, lines.tolist(), cols


@pytest.mark.parametrize("to", ["hdf5", "parquet", "npy"])
@pytest.mark.parametrize("level", ["sentence", "token"])
def test_export_reads_back_without_layerwise(stores, tmp_path, level, to):
    st = stores[level, True]
    out = export(st, tmp_path / ("out-npy" if to == "npy" else f"out.{to}"), to=to)  # an npy export is a folder
    recs, lines, cols = read_export(out, to, level)
    assert len(recs) == len(st) == 6 and lines == st.lines.tolist()
    for got, want in zip(recs, st):
        assert got.shape == want.shape and np.array_equal(np.asarray(got, dtype=np.float32), want)
    assert cols == {"id": st.column("id"), "label": st.column("label")}


def test_export_parquet_column_null_in_first_shard(bert, tmp_path):
    p = tmp_path / "n.jsonl"
    rows = [{"text": t, "label": lab} for t, lab in zip(TEXTS[:4], [None, None, "a", "b"])]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    extract(p, tmp_path / "s", model=bert, keep=["label"], shard_records=2)
    import pyarrow.parquet as pq

    table = pq.read_table(export(tmp_path / "s", tmp_path / "o.parquet", to="parquet"))
    assert table.column("label").to_pylist() == [None, None, "a", "b"]  # pandas would show the nulls as NaN


def test_export_parquet_empty_store(bert, tmp_path):
    p = tmp_path / "bad.txt"
    p.write_bytes(b"\n  \n\xff\n")
    assert extract(p, tmp_path / "s", model=bert).skipped == 3
    import pyarrow.parquet as pq

    assert pq.read_table(export(tmp_path / "s", tmp_path / "o.parquet", to="parquet")).num_rows == 0


def test_cli_inspect_export_and_errors(bert, tiny_dirs, tmp_path, corpus):
    runner, env = CliRunner(), {"COLUMNS": "200"}
    model = ["--model", str(tiny_dirs["bert"]), "--device", "cpu"]
    store = tmp_path / "s"
    args = [
        "extract",
        str(corpus),
        "-o",
        str(store),
        "--layers",
        "0,2",
        "--level",
        "token",
        "--keep",
        "id",
        "--keep",
        "label",
        "--shard-records",
        "3",
        "--quiet",
        *model,
    ]
    res = runner.invoke(app, args)
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == "", res.output
    st = open_store(store)
    assert st.columns == ["id", "label"] and st.num_shards == 2

    res = runner.invoke(app, ["inspect", str(store), "--sample", "2"], env=env)
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert "[0, 2] / block" in out and "6 (1 skipped)" in out and "[64] float32" in out and "complete" in out
    assert f"record 1 (line 2): shape [{st[1].shape[0]}, 64]" in out and "record 2" not in out
    res = runner.invoke(app, ["inspect", str(store), "--json"])
    assert json.loads(res.stdout) == st.manifest

    res = runner.invoke(app, ["export", str(store), "--to", "npy"])
    assert res.exit_code == 0 and f"wrote {store}-npy" in res.stderr
    recs, lines, cols = read_export(tmp_path / "s-npy", "npy", "token")
    assert all(np.array_equal(a, b) for a, b in zip(recs, st)) and cols["id"] == st.column("id")
    res = runner.invoke(app, ["export", str(store), "--to", "parquet", "-o", str(tmp_path / "x.parquet")])
    assert res.exit_code == 0 and read_export(tmp_path / "x.parquet", "parquet", "token")[1] == st.lines.tolist()

    before = snapshot(store)
    (tmp_path / "in.csv").write_text("id,sentence\n1,hello\n")
    errors = [
        (
            [
                "extract",
                str(corpus),
                "-o",
                str(store),
                "--layers",
                "1",
                "--level",
                "token",
                "--keep",
                "id,label",
                *model,
            ],
            "spec.layers",
        ),
        (
            ["extract", str(tmp_path / "in.csv"), "-o", str(tmp_path / "n"), "--text-column", "body", *model],
            "the CSV header has no column 'body'",
        ),
        (["inspect", str(tmp_path)], "not a layerwise store"),
        (["export", str(store), "--to", "csv"], "Valid formats are: npy, hdf5, parquet"),
    ]
    for argv, message in errors:
        res = runner.invoke(app, argv, env=env)
        assert res.exit_code == 2 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert res.stderr.startswith("error: ") and message in res.stderr and "Traceback" not in res.stderr
    assert snapshot(store) == before and not (tmp_path / "n").exists()


def _disk_full_at(monkeypatch, n):
    """Make the ``n``-th shard write fail half-way with ENOSPC (after writing part of its temporary file)."""
    import errno

    import layerwise.store.layout as layout

    real, calls = layout.save_tensors, {"n": 0}

    def save(tmp, tensors, metadata, **options):
        calls["n"] += 1
        if calls["n"] == n:
            with open(tmp, "wb") as fh:
                fh.write(b"\0" * 100)  # a partial file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, tensors, metadata, **options)

    monkeypatch.setattr(layout, "save_tensors", save)


@pytest.mark.parametrize("level", ["sentence", "token"])
def test_full_disk_is_one_clear_message_and_the_rerun_resumes(bert, tmp_path, corpus, monkeypatch, level):
    """On ``auto``'s default path: the resumed store names one runtime and equals, bit for bit, a clean run with
    ``backend=<that runtime>``."""
    monkeypatch.delenv("LAYERWISE_AUTO_RUNTIME", raising=False)
    kw = dict(layers=[1, 2], keep=["id", "label"], shard_records=2, level=level)
    store = tmp_path / "s"
    with monkeypatch.context() as full:
        _disk_full_at(full, 2)
        with pytest.raises(lw.StoreError) as info:
            extract(corpus, store, model=lw.Extractor(bert.loaded), **kw)
    text = str(info.value)
    assert "no space left on the device while writing shard-000001.safetensors" in text
    assert repr(str(store)) in text and "2 records in 1 finished shards are safe" in text
    assert "rerun the same command: it resumes after the last finished shard" in text
    assert not [p.name for p in store.iterdir() if ".tmp-" in p.name]  # the temporary file is gone
    assert len(open_store(store)) == 2 and not open_store(store).complete
    summary = extract(corpus, store, model=lw.Extractor(bert.loaded), **kw)  # space freed: the same command resumes
    assert summary.status == "complete" and summary.resumed_from == 2 and summary.records == 4
    runtime = open_store(store).manifest["runtime"]["name"]
    assert {e["runtime"] for e in open_store(store).manifest["shards"]} == {runtime}
    extract(corpus, tmp_path / "clean", model=lw.Extractor(bert.loaded, backend=runtime), **kw)
    assert_same(open_store(store), open_store(tmp_path / "clean"), tol=0.0)


def test_full_disk_on_the_manifest_is_the_same_message(bert, tmp_path, corpus, monkeypatch):
    import errno

    import layerwise.store.layout as layout

    real = layout.atomic_write_bytes

    def full(path, data):
        if path.name == "manifest.json" and (path.parent / "shard-000000.safetensors").exists():
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, data)

    monkeypatch.setattr("layerwise.store.layout.atomic_write_bytes", full)
    with pytest.raises(lw.StoreError, match="no space left on the device while writing manifest.json"):
        extract(corpus, tmp_path / "s", model=bert, **BASE)


def test_full_disk_in_the_cli_is_one_line(bert, tiny_dirs, tmp_path, corpus, monkeypatch):
    _disk_full_at(monkeypatch, 1)
    res = CliRunner().invoke(
        app, ["extract", str(corpus), "-o", str(tmp_path / "s"), "--model", str(tiny_dirs["bert"]), "--quiet"]
    )
    assert res.exit_code == 2 and res.stderr.startswith("error: no space left on the device")
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_a_copy_of_the_input_at_another_path_resumes_the_same_store(bert, tmp_path, corpus):
    store = tmp_path / "s"
    extract(corpus, store, model=bert, max_records=2, **BASE)
    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(corpus.read_bytes())
    summary = extract(copy, store, model=bert, **BASE)  # same content, other path: resumes
    assert summary.resumed_from == 2 and summary.status == "complete"
    copy.write_text(copy.read_text() + '{"text": "new"}\n')
    with pytest.raises(lw.StoreError, match="the input .*renamed.jsonl changed since the store"):
        extract(copy, store, model=bert, **BASE)
