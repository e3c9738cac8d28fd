"""Issue 12, stores: stdin is hashed, exports keep ids and words and never replace foreign files, slicing, inputs."""

from __future__ import annotations

import io
import json

import h5py
import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise import ExtractError
from layerwise.cli.main import app
from layerwise.store import export, open_store
from tiny import extract

TEXTS = [f"sentence {i} about layer {i % 3}" for i in range(10)]


@pytest.fixture(scope="module")
def bert(tiny_extractors):
    return tiny_extractors["bert"]


def _stdin(texts):
    return io.BytesIO(("\n".join(texts) + "\n").encode())


def test_a_finished_stdin_store_refuses_other_input(bert, tmp_path):
    store = tmp_path / "s"
    assert extract("-", store, model=bert, stdin=_stdin(TEXTS)).status == "complete"
    assert open_store(store).manifest["input"]["sha256"] is not None
    assert extract("-", store, model=bert, stdin=_stdin(TEXTS)).status == "already_complete"  # same input
    with pytest.raises(ExtractError, match="stdin: the input differs from the one this store was made from"):
        extract("-", store, model=bert, stdin=_stdin(TEXTS[:-1] + ["changed"]))


def test_an_unfinished_stdin_store_resumes_only_the_same_input(bert, tmp_path):
    store = tmp_path / "s"
    extract("-", store, model=bert, stdin=_stdin(TEXTS), max_records=4, shard_records=2)
    with pytest.raises(ExtractError, match=r"its records up to line 4 hash to"):
        extract("-", store, model=bert, stdin=_stdin(["other"] + TEXTS[1:]), shard_records=2)
    summary = extract("-", store, model=bert, stdin=_stdin(TEXTS), shard_records=2)
    assert summary.status == "complete" and summary.resumed_from == 4 and summary.records == 6
    clean = tmp_path / "clean"
    extract("-", clean, model=bert, stdin=_stdin(TEXTS), shard_records=2)
    assert np.abs(open_store(store).to_numpy() - open_store(clean).to_numpy()).max() <= 1e-5


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
    export(tok, tmp_path / "t.npy", to="npy")
    assert np.array_equal(np.load(tmp_path / "t.npy" / "token_ids.npy"), ids)
    export(word, tmp_path / "w.npy", to="npy")
    assert json.loads((tmp_path / "w.npy" / "words.json").read_text()) == words
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
        tok.token_ids(i).tolist() for i in range(len(tok))]
    assert pq.read_table(tmp_path / "w.parquet")["words"].to_pylist() == words


@pytest.mark.parametrize("to,name", [("npy", "x.npy"), ("hdf5", "x.h5"), ("parquet", "x.parquet")])
def test_export_never_replaces_a_foreign_file_and_asks_before_its_own(stores, tmp_path, to, name):
    out = tmp_path / name
    if to == "npy":
        out.mkdir()
        (out / "mine.txt").write_text("keep me")
    else:
        out.write_text("my input text\n")
    with pytest.raises(ValueError, match="exists and is not a layerwise .* export .*never replaces what it did not"):
        export(stores["sent"], out, to=to, overwrite=True)
    assert (out / "mine.txt" if to == "npy" else out).read_text() in ("keep me", "my input text\n")
    fresh = tmp_path / f"fresh-{name}"
    export(stores["sent"], fresh, to=to)
    with pytest.raises(ValueError, match="holds an earlier layerwise .* export; pass --overwrite"):
        export(stores["tok"], fresh, to=to)
    export(stores["tok"], fresh, to=to, overwrite=True)
    res = CliRunner().invoke(app, ["export", str(stores["sent"].path), "--to", to, "-o", str(out)])
    assert res.exit_code == 2 and "never replaces what it did not write" in res.stderr


def test_store_slicing(stores):
    sent, tok = stores["sent"], stores["tok"]
    allx = sent.to_numpy()
    assert np.array_equal(sent[2:7], allx[2:7]) and np.array_equal(sent[::-3], allx[::-3])
    assert sent[5:5].shape == (0, 32)
    parts = tok[1:4]
    assert isinstance(parts, list) and [p.shape for p in parts] == [tok[i].shape for i in (1, 2, 3)]


def test_inputs_that_are_not_files(bert, tmp_path):
    with pytest.raises(ValueError, match="is a directory; give one corpus file"):
        extract(tmp_path, tmp_path / "s", model=bert)
    with pytest.raises(TypeError, match=r"input must be a file path or '-' \(stdin\), got list.*Extractor.stream"):
        lw.extract(["a", "b"], tmp_path / "s")
    res = CliRunner().invoke(app, ["extract", ".", "-o", str(tmp_path / "s2")])
    assert res.exit_code == 2 and "is a directory" in res.stderr


def test_summary_line_counts_in_the_singular(bert, tmp_path):
    p = tmp_path / "one.txt"
    p.write_text("just one\n")
    line = extract(p, tmp_path / "s", model=bert).line()
    assert line.startswith("1 record, ") and "in 1 shard," in line and "(1 record)" in line
    assert "already complete (1 record)" in extract(p, tmp_path / "s", model=bert).line()


def test_extract_batch_tokens_zero_is_refused(tiny_dirs, tmp_path):
    p = tmp_path / "in.txt"
    p.write_text("a\n")
    res = CliRunner().invoke(app, ["extract", str(p), "-o", str(tmp_path / "s"), "--model", str(tiny_dirs["bert"]),
                                   "--batch-tokens", "0"])
    assert res.exit_code == 2 and "batch_tokens must be a positive int, got 0" in res.stderr
