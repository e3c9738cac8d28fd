"""Stores: stdin is hashed, exports keep ids and words and never replace foreign files, slicing, inputs."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from pathlib import Path

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise import ExtractError
from layerwise.cli.main import app
from layerwise.store import export, open_store
from layerwise.store.layout import ShardFile

from tiny import extract

TEXTS = [f"sentence {i} about layer {i % 3}" for i in range(10)]


@pytest.fixture(scope="module")
def bert(tiny_extractors):
    return tiny_extractors["bert"]


def _bytes(texts):
    return ("\n".join(texts) + "\n").encode()


def _stdin(texts):
    return io.BytesIO(_bytes(texts))


# ---- 1. stdin is hashed as it streams --------------------------------------------------------------------------
def test_a_finished_stdin_store_refuses_other_input(bert, tmp_path):
    store = tmp_path / "s"
    assert extract("-", store, model=bert, stdin=_stdin(TEXTS)).status == "complete"
    recorded = open_store(store).manifest["input"]
    assert recorded["sha256"] == hashlib.sha256(_bytes(TEXTS)).hexdigest() and recorded["bytes"] == len(_bytes(TEXTS))
    assert extract("-", store, model=bert, stdin=_stdin(TEXTS)).status == "already_complete"  # same input
    other = TEXTS[:-1] + ["changed"]
    new, old = hashlib.sha256(_bytes(other)).hexdigest()[:16], recorded["sha256"][:16]
    with pytest.raises(ExtractError, match=rf"stdin differs from the input store .* was made from: it has "
                                           rf"input.sha256 {new}.*manifest records input.sha256 {old}.*--overwrite"):
        extract("-", store, model=bert, stdin=_stdin(other))
    assert open_store(store).complete and len(open_store(store)) == 10  # left as it was
    shown = CliRunner().invoke(app, ["inspect", str(store)]).stdout
    assert f"sha256 {recorded['sha256'][:12]} ({len(_bytes(TEXTS))} bytes)" in shown
    assert extract("-", store, model=bert, stdin=_stdin(other), overwrite=True).records == 10


def test_cli_rerun_of_a_stdin_store_with_other_input(tiny_dirs, tmp_path):
    args = ["extract", "-", "-o", str(tmp_path / "s"), "--model", str(tiny_dirs["bert"]), "--quiet"]
    assert CliRunner().invoke(app, args, input=_bytes(TEXTS)).exit_code == 0
    res = CliRunner().invoke(app, args, input=_bytes(TEXTS[:3]))
    assert res.exit_code == 2 and "stdin differs from the input store" in res.stderr and "input.sha256" in res.stderr


def test_an_unfinished_stdin_store_resumes_only_the_same_input(bert, tmp_path):
    store = tmp_path / "s"
    extract("-", store, model=bert, stdin=_stdin(TEXTS), max_records=4, shard_records=2)
    shards = open_store(store).manifest["shards"]
    assert [s["input_prefix"]["line"] for s in shards] == [2, 4] and shards[1]["input_prefix"]["records"] == 4
    # the same limit again used to answer "already complete" whatever the input
    with pytest.raises(ExtractError, match=r"its records up to line 4 \(4 records\) hash to .*input_prefix.sha256"):
        extract("-", store, model=bert, stdin=_stdin(["other"] + TEXTS[1:]), max_records=4, shard_records=2)
    with pytest.raises(ExtractError, match=r"stdin differs from the input store .* was started with: its records up"):
        extract("-", store, model=bert, stdin=_stdin(["other"] + TEXTS[1:]), shard_records=2)
    with pytest.raises(ExtractError, match=r"it ended at line 3, before line 4 where the stored records end"):
        extract("-", store, model=bert, stdin=_stdin(TEXTS[:3]), shard_records=2)
    assert extract("-", store, model=bert, stdin=_stdin(TEXTS), max_records=4).status == "already_complete"
    summary = extract("-", store, model=bert, stdin=_stdin(TEXTS), shard_records=2)
    assert summary.status == "complete" and summary.resumed_from == 4 and summary.records == 6
    clean = tmp_path / "clean"
    extract("-", clean, model=bert, stdin=_stdin(TEXTS), shard_records=2)
    assert np.abs(open_store(store).to_numpy() - open_store(clean).to_numpy()).max() <= 1e-5
    assert open_store(store).manifest["input"]["sha256"] == hashlib.sha256(_bytes(TEXTS)).hexdigest()


def test_an_interrupted_stdin_store_checks_its_prefix_and_a_fixed_bad_line_resumes(bert, tmp_path):
    store = tmp_path / "s"

    def stop(n):
        if n == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        extract("-", store, model=bert, stdin=_stdin(TEXTS), shard_records=2, on_shard=stop)
    assert open_store(store).manifest["status"] == "running"
    with pytest.raises(ExtractError, match=r"its records up to line 4 .*hash to"):
        extract("-", store, model=bert, stdin=_stdin(TEXTS[:2] + ["x"] + TEXTS[3:]), shard_records=2)
    # a bad record stops a strict run after flushing the records before it; the fixed input resumes (the bad line
    # is after the stored records, so it is not part of the prefix they recorded)
    strict = tmp_path / "strict"
    bad = TEXTS[:3] + ["   "] + TEXTS[4:]
    with pytest.raises(ExtractError, match="bad record at line 4"):
        extract("-", strict, model=bert, stdin=_stdin(bad), shard_records=2, strict=True)
    assert open_store(strict).manifest["shards"][-1]["input_prefix"]["line"] == 3
    summary = extract("-", strict, model=bert, stdin=_stdin(TEXTS), shard_records=2, strict=True)
    assert summary.status == "complete" and summary.resumed_from == 3 and len(open_store(strict)) == 10


def test_a_stdin_store_without_recorded_hashes_is_not_trusted(bert, tmp_path):
    store = tmp_path / "s"
    extract("-", store, model=bert, stdin=_stdin(TEXTS))
    manifest = json.loads((store / "manifest.json").read_text())
    manifest["input"]["sha256"] = None  # as an older layerwise wrote it
    (store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ExtractError, match=r"without a recorded input.sha256 .*cannot tell whether its stdin is the "
                                           r"same input; pass --overwrite"):
        extract("-", store, model=bert, stdin=_stdin(TEXTS))


# ---- 2. exports keep token ids and words -----------------------------------------------------------------------
@pytest.fixture
def stores(bert, tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("\n".join(TEXTS) + "\n")
    extract(p, tmp_path / "tok", model=bert, layers=-1, level="token", shard_records=3)
    extract(p, tmp_path / "word", model=bert, layers=-1, level="word", shard_records=3)
    extract(p, tmp_path / "sent", model=bert, layers=-1, shard_records=3)
    return {k: open_store(tmp_path / k) for k in ("tok", "word", "sent")}


def test_exports_keep_token_ids_and_words(stores, tmp_path):
    tok, word = stores["tok"], stores["word"]
    ids = np.concatenate([tok.token_ids(i) for i in range(len(tok))])
    words = [word.words(i) for i in range(len(word))]
    assert len(ids) == tok.num_rows and sum(map(len, words)) == word.num_rows
    export(tok, tmp_path / "t-npy", to="npy")
    assert np.array_equal(np.load(tmp_path / "t-npy" / "token_ids.npy"), ids)
    export(word, tmp_path / "w-npy", to="npy")
    assert json.loads((tmp_path / "w-npy" / "words.json").read_text()) == words
    export(tok, tmp_path / "t.h5", to="hdf5")
    export(word, tmp_path / "w.h5", to="hdf5")
    with h5py.File(tmp_path / "t.h5") as f:
        assert np.array_equal(f["token_ids"][:], ids)
    with h5py.File(tmp_path / "w.h5") as f:
        off = f["offsets"][:]
        flat = [w.decode() for w in f["words"][:]]
        assert [flat[a:b] for a, b in zip(off[:-1], off[1:])] == words
    export(tok, tmp_path / "t.parquet", to="parquet")
    export(word, tmp_path / "w.parquet", to="parquet")
    assert [list(r) for r in pq.read_table(tmp_path / "t.parquet")["token_ids"].to_pylist()] == [
        tok.token_ids(i).tolist() for i in range(len(tok))
    ]
    assert pq.read_table(tmp_path / "w.parquet")["words"].to_pylist() == words
    assert [len(w) for w in words] == [len(r) for r in pq.read_table(tmp_path / "w.parquet")["features"].to_pylist()]


def test_export_refuses_a_kept_column_named_like_its_own_files(bert, tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_text("".join(json.dumps({"text": t, "lines": i}) + "\n" for i, t in enumerate(TEXTS[:3])))
    extract(p, tmp_path / "s", model=bert, keep=("lines",))
    with pytest.raises(ValueError, match=r"kept a column named 'lines', which would collide with lines.npy"):
        export(tmp_path / "s", tmp_path / "o-npy", to="npy")
    assert not (tmp_path / "o-npy").exists()
    with h5py.File(export(tmp_path / "s", tmp_path / "o.h5", to="hdf5")) as f:
        assert f["columns/lines"][:].tolist() == [0, 1, 2]


# ---- 3. exports never replace what layerwise did not write -----------------------------------------------------
@pytest.mark.parametrize("to,name", [("npy", "x-npy"), ("hdf5", "x.h5"), ("parquet", "x.parquet")])
def test_export_never_replaces_a_foreign_file_and_asks_before_its_own(stores, tmp_path, to, name):
    out = tmp_path / name
    if to == "npy":
        out.mkdir()
        (out / "mine.txt").write_text("keep me")
    else:
        out.write_text("my input text\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=rf"'{out}' exists and is not a layerwise {to} export .*never replaces what "
                                         rf"it did not write, even with --overwrite"):
        export(stores["sent"], out, to=to, overwrite=True)
    assert (out / "mine.txt" if to == "npy" else out).read_text() in ("keep me", "my input text\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temporary left
    fresh = tmp_path / f"fresh-{name}"
    export(stores["sent"], fresh, to=to)
    probe = tmp_path / "probe"  # written under a temporary name, yet with the permissions a new output gets
    probe.mkdir() if to == "npy" else probe.write_text("")
    assert fresh.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    with pytest.raises(ValueError, match=rf"'{fresh}' holds an earlier layerwise {to} export; pass --overwrite"):
        export(stores["tok"], fresh, to=to)
    export(stores["tok"], fresh, to=to, overwrite=True)
    res = CliRunner().invoke(app, ["export", str(stores["sent"].path), "--to", to, "-o", str(out)])
    assert res.exit_code == 2 and "never replaces what it did not write" in res.stderr
    res = CliRunner().invoke(app, ["export", str(stores["sent"].path), "--to", to, "-o", str(out), "--overwrite"])
    assert res.exit_code == 2 and "never replaces what it did not write" in res.stderr
    res = CliRunner().invoke(app, ["export", str(stores["sent"].path), "--to", to, "-o", str(fresh)])
    assert res.exit_code == 2 and "pass --overwrite" in res.stderr
    res = CliRunner().invoke(app, ["export", str(stores["sent"].path), "--to", to, "-o", str(fresh), "--overwrite"])
    assert res.exit_code == 0, res.stderr


def test_npy_overwrite_replaces_only_its_own_files(stores, tmp_path):
    out = tmp_path / "x-npy"
    export(stores["tok"], out, to="npy")
    (out / "notes.txt").write_text("mine")
    np.save(out / "mine.npy", np.arange(3))
    export(stores["sent"], out, to="npy", overwrite=True)
    assert (out / "notes.txt").read_text() == "mine" and np.load(out / "mine.npy").tolist() == [0, 1, 2]
    assert not (out / "token_ids.npy").exists() and not (out / "offsets.npy").exists()  # the old export's files
    assert np.load(out / "features.npy").shape == (10, 32)
    (out / "manifest.json").unlink()  # no longer recognisable as layerwise's: never replaced
    with pytest.raises(ValueError, match="is not a layerwise npy export"):
        export(stores["sent"], out, to="npy", overwrite=True)


def test_npy_export_to_a_npy_name_is_one_array_or_says_what_to_type_and_quiet_says_nothing(stores, tmp_path):
    """``-o x.npy``: a sentence-level store is written as that one array (np.load works on it), its manifest beside
    it; a token/word level store (several arrays) is refused with the exact command; the CLI's default is STORE-npy,
    and -q silences the 'wrote' line (issues 41 and 55)."""
    store = stores["sent"].path
    for level in ("tok", "word"):
        other = tmp_path / "x-npy"
        with pytest.raises(ValueError, match=rf"'{tmp_path / 'x.npy'}' names one array, but a {stores[level].level}"
                                             rf"-level store exports several .* layerwise export "
                                             rf"{stores[level].path} --to npy -o {other}"):
            export(stores[level], tmp_path / "x.npy", to="npy")
        assert not (tmp_path / "x.npy").exists()
    res = CliRunner().invoke(app, ["export", str(store), "--to", "npy", "-o", str(tmp_path / "x.npy")])
    assert res.exit_code == 0 and f"one array: np.load('{tmp_path / 'x.npy'}')" in res.stderr, res.output
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), stores["sent"].to_numpy())
    assert json.loads((tmp_path / "x.npy.json").read_text())["id"] == stores["sent"].manifest["id"]
    res = CliRunner().invoke(app, ["export", str(store), "--to", "npy", "-o", str(tmp_path / "x.npy")])
    assert res.exit_code == 2 and "pass --overwrite" in res.stderr
    np.save(tmp_path / "mine.npy", np.arange(3))  # the user's own array: never replaced
    res = CliRunner().invoke(app, ["export", str(store), "--to", "npy", "-o", str(tmp_path / "mine.npy"),
                                   "--overwrite"])
    assert res.exit_code == 2 and np.load(tmp_path / "mine.npy").tolist() == [0, 1, 2]
    res = CliRunner().invoke(app, ["export", str(store), "--to", "npy"])
    out = Path(f"{store}-npy")
    assert res.exit_code == 0 and f"wrote {out} (a directory: np.load('{out / 'features.npy'}'))" in res.stderr
    assert np.load(out / "features.npy").shape == (len(stores["sent"]), 32)
    for to, name in (("npy", "q-npy"), ("hdf5", "q.h5"), ("parquet", "q.parquet")):
        res = CliRunner().invoke(app, ["export", str(store), "--to", to, "-o", str(tmp_path / name), "-q"])
        assert res.exit_code == 0 and res.stderr == "" and res.stdout == "" and (tmp_path / name).exists(), to
    res = CliRunner().invoke(app, ["export", str(store), "--to", "hdf5", "-o", str(tmp_path / "q.h5"), "--quiet"])
    assert res.exit_code == 2 and "pass --overwrite" in res.stderr  # errors are still said


# ---- 5. slicing -------------------------------------------------------------------------------------------------
def test_store_slicing(stores, monkeypatch):
    sent, tok = stores["sent"], stores["tok"]
    allx = sent.to_numpy()
    for sl in (slice(2, 7), slice(None, None, -3), slice(-4, None), slice(-8, -2, 2), slice(8, 2, -2),
               slice(-100, 100), slice(5, 5)):
        got = sent[sl]
        assert isinstance(got, np.ndarray) and got.dtype == allx.dtype and np.array_equal(got, allx[sl]), sl
    assert sent[5:5].shape == (0, 32)
    parts = tok[1:4]
    assert isinstance(parts, list) and [p.shape for p in parts] == [tok[i].shape for i in (1, 2, 3)]
    assert [p.shape for p in tok[::-4]] == [tok[i].shape for i in (9, 5, 1)] and tok[7:3] == []
    assert all(np.array_equal(a, tok[i]) for a, i in zip(tok[-3:], (7, 8, 9)))
    with pytest.raises(TypeError, match=r"store index must be an int or a slice \(store\[3\], store\[0:10\]\)"):
        sent["a"]  # type: ignore[call-overload]
    # only the shards a slice names are read (3 records a shard: records 4..5 live in shard 1)
    read: list[str] = []
    original = ShardFile.array

    def spy(self, name):
        read.append(self.path.name)
        return original(self, name)

    monkeypatch.setattr(ShardFile, "array", spy)
    fresh = open_store(sent.path)
    read.clear()
    assert np.array_equal(fresh[4:6], allx[4:6]) and set(read) == {"shard-000001.safetensors"}


# ---- 4. inputs, counts, options ---------------------------------------------------------------------------------
def test_inputs_that_are_not_files(bert, tmp_path):
    with pytest.raises(ValueError, match="holds no corpus files"):
        extract(tmp_path, tmp_path / "s", model=bert)
    with pytest.raises(TypeError, match=r"input must be a file path, '-' \(stdin\), a directory of parquet files, "
                                        r"a datasets.Dataset or a pyarrow.Table; got builtins.list.*Extractor.stream"):
        lw.extract(["a", "b"], tmp_path / "s")
    with pytest.raises(TypeError, match=r"output must be the store's directory path, got list"):
        lw.extract(tmp_path / "in.txt", ["s"])
    assert not (tmp_path / "s").exists()
    # named before the model is loaded: a model that cannot load is not what the user hears about
    res = CliRunner().invoke(app, ["extract", str(tmp_path), "-o", str(tmp_path / "s2"), "--model",
                                   str(tmp_path / "nope")])
    assert res.exit_code == 2 and "holds no corpus files" in res.stderr


def test_summary_line_counts_in_the_singular(bert, tiny_dirs, tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("just one\n")
    line = extract(p, tmp_path / "s", model=bert).line()
    assert line.startswith("1 record, ") and "in 1 shard," in line and "(1 record)" in line
    assert "already complete (1 record)" in extract(p, tmp_path / "s", model=bert).line()
    two = tmp_path / "two.txt"
    two.write_text("a\n   \nb\n")
    res = CliRunner().invoke(app, ["extract", str(two), "-o", str(tmp_path / "t"), "--model", str(tiny_dirs["bert"])])
    assert res.exit_code == 0 and "2 records, " in res.stderr and "1 skipped record is listed in" in res.stderr


def test_extract_batch_tokens_zero_is_refused(bert, tiny_dirs, tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("a\n")
    res = CliRunner().invoke(
        app, ["extract", str(p), "-o", str(tmp_path / "s"), "--model", str(tiny_dirs["bert"]), "--batch-tokens", "0"]
    )
    assert res.exit_code == 2 and "batch_tokens must be a positive int, got 0" in res.stderr
    # 0 is a bad budget, not "unset": the engine refuses it before touching the store, however it got there
    options = lw.ExtractOptions()
    object.__setattr__(options, "batch_tokens", 0)
    with pytest.raises(ExtractError, match=r"batch_tokens must be a positive int \(tokens per batch\), got 0"):
        lw.extract(p, tmp_path / "s", model=bert, options=options)
    assert not (tmp_path / "s").exists()
    assert dataclasses.replace(options, batch_tokens=None).batch_tokens is None


def test_extract_says_what_it_ran_on(tiny_dirs, tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("a b\n")
    args = ["extract", str(p), "-o", str(tmp_path / "s"), "--model", str(tiny_dirs["bert"])]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0 and ": device cpu, dtype float32, backend auto" in res.stderr
    assert ": device cpu" not in CliRunner().invoke(app, [*args, "--quiet"]).stderr
