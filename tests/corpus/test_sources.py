"""Inputs beyond files (datasets.Dataset, pyarrow.Table, a directory of parquet files) and a store as Arrow / datasets.

The tables are small fixtures written here: a few good rows, an empty text and a None among them (bad records).
"""

from __future__ import annotations

import datasets  # the [hf] extra, part of the test set-up
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tests.tiny import extract
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.store import export

TEXTS = ["a good film", "", "bad movie", None, "it was fine", "the plot was thin and long", "ok"] * 3
LABELS = list(range(len(TEXTS)))


@pytest.fixture(scope="module")
def bert(tiny_extractors):
    return tiny_extractors["bert"]


def _good() -> list[tuple[int, str]]:
    return [(i + 1, t) for i, t in enumerate(TEXTS) if t]


def test_a_dataset_is_an_input_like_a_file(bert, tmp_path):
    ds = datasets.Dataset.from_dict({"sentence": TEXTS, "label": LABELS})
    s = extract(ds, tmp_path / "s", model=bert, keep=("label",), layers="-2:", combine="concat")
    store = lw.open_store(tmp_path / "s")
    good = _good()
    assert s.records == len(good) and s.skipped == len(TEXTS) - len(good)
    assert store.lines.tolist() == [line for line, _ in good]  # rows numbered from 1
    assert store.column("label") == [line - 1 for line, _ in good]
    want = bert.encode([t for _, t in good], layers=[-2, -1], combine="concat", return_tensors="np")
    np.testing.assert_allclose(store.to_numpy(), want, atol=1e-5)
    info = store.manifest["input"]
    assert info["format"] == "table" and info["rows"] == len(TEXTS) and info["kind"] == "Dataset"
    errors = (tmp_path / "s" / "errors.jsonl").read_text()
    assert '"line": 2' in errors and "empty text" in errors and "missing value for text field 'sentence'" in errors


def test_a_table_is_identified_by_its_rows_not_its_chunking(bert, tmp_path):
    table = pa.table({"text": TEXTS})
    extract(table, tmp_path / "s", model=bert)
    rechunked = pa.concat_tables([table.slice(0, 5), table.slice(5)])
    assert rechunked.column("text").num_chunks == 2
    assert extract(rechunked, tmp_path / "s", model=bert).status == "already_complete"
    # a dataset with the same column and rows is the same input
    again = extract(datasets.Dataset.from_dict({"text": TEXTS}), tmp_path / "s", model=bert)
    assert again.status == "already_complete"
    other = pa.table({"text": [t if t != "ok" else "okay" for t in TEXTS]})
    with pytest.raises(ValueError, match=r"the input .*changed since the store .*its sha256 is"):
        extract(other, tmp_path / "s", model=bert)


def test_a_selected_or_shuffled_dataset_is_read_in_its_own_order(bert, tmp_path):
    ds = datasets.Dataset.from_dict({"text": TEXTS}).select([6, 4, 0])
    extract(ds, tmp_path / "s", model=bert)
    want = bert.encode(["ok", "it was fine", "a good film"], return_tensors="np")
    np.testing.assert_allclose(lw.open_store(tmp_path / "s").to_numpy(), want, atol=1e-5)


def test_inputs_that_are_not_tables(bert, tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})})
    with pytest.raises(TypeError, match=r"DatasetDict with splits \['train'\]; pick one, e.g. data\['train'\]"):
        extract(dd, tmp_path / "s", model=bert)
    streaming = datasets.Dataset.from_dict({"text": ["a"]}).to_iterable_dataset()
    with pytest.raises(TypeError, match="streaming datasets.IterableDataset"):
        extract(streaming, tmp_path / "s", model=bert)
    with pytest.raises(ValueError, match=r"has no column 'txt'; its columns are \['text'\]"):
        extract(pa.table({"text": ["a"]}), tmp_path / "s", model=bert, text_field="txt")
    with pytest.raises(ValueError, match="read as a table, not as 'jsonl'"):
        extract(pa.table({"text": ["a"]}), tmp_path / "s", model=bert, format="jsonl")
    assert not (tmp_path / "s").exists()


def _parquet_dir(path, texts, split=(4, 11)) -> None:
    path.mkdir()
    bounds = [0, *split, len(texts)]
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):  # names sort in input order, not creation order
        pq.write_table(pa.table({"text": texts[a:b], "label": LABELS[a:b]}), path / f"part-{k:03d}.parquet")


def test_a_directory_of_parquet_files_is_one_input(bert, tmp_path):
    _parquet_dir(tmp_path / "in", TEXTS)
    (tmp_path / "in" / "README.md").write_text("not data")
    extract(tmp_path / "in", tmp_path / "s", model=bert, keep=("label",))
    extract(pa.table({"text": TEXTS, "label": LABELS}), tmp_path / "t", model=bert, keep=("label",))
    a, b = lw.open_store(tmp_path / "s"), lw.open_store(tmp_path / "t")
    assert a.lines.tolist() == b.lines.tolist() and a.column("label") == b.column("label")
    np.testing.assert_array_equal(a.to_numpy(), b.to_numpy())
    assert a.manifest["input"]["format"] == "parquet"
    # a changed file is another input
    pq.write_table(pa.table({"text": ["changed"], "label": [0]}), tmp_path / "in" / "part-001.parquet")
    with pytest.raises(ValueError, match=r"the input .*changed since the store .*its sha256 is"):
        extract(tmp_path / "in", tmp_path / "s", model=bert, keep=("label",))
    with pytest.raises(ValueError, match="is a directory of parquet files; it cannot be read as 'txt'"):
        extract(tmp_path / "in", tmp_path / "u", model=bert, format="txt")


def test_the_cli_reads_a_parquet_directory(tiny_dirs, tmp_path):
    _parquet_dir(tmp_path / "in", TEXTS)
    res = CliRunner().invoke(app, ["extract", str(tmp_path / "in"), "-o", str(tmp_path / "s"), "--model",
                                   str(tiny_dirs["bert"]), "--quiet"])
    assert res.exit_code == 0, res.output
    assert len(lw.open_store(tmp_path / "s")) == len(_good())


# ---- a store as Arrow and as a datasets.Dataset ---------------------------------------------------------------
@pytest.mark.parametrize("combine,shape", [("concat", (64,)), ("stack", (2, 32))])
def test_sentence_store_to_arrow_and_dataset(bert, tmp_path, combine, shape):
    extract(pa.table({"text": TEXTS, "label": LABELS}), tmp_path / "s", model=bert, keep=("label",),
            layers="-2:", combine=combine)
    store = lw.open_store(tmp_path / "s")
    table = store.to_arrow()
    assert table.column_names == ["line", "label", "features"]
    assert str(table.schema.field("features").type.extension_name) == "arrow.fixed_shape_tensor"
    feats = table["features"].combine_chunks().to_numpy_ndarray()
    assert feats.shape == (len(store), *shape)
    np.testing.assert_array_equal(feats, store.to_numpy())
    # readable without layerwise: through an Arrow IPC file, the canonical extension type comes back as a tensor
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    back = pa.ipc.open_file(str(tmp_path / "x.arrow")).read_all()
    np.testing.assert_array_equal(back["features"].combine_chunks().to_numpy_ndarray(), feats)
    ds = store.to_dataset()
    got = ds.with_format("numpy")[:]
    assert got["features"].shape == (len(store), *shape) and got["label"].tolist() == store.column("label")
    np.testing.assert_array_equal(got["features"], feats)
    mapped = store.to_dataset(tmp_path / "d.arrow")  # streamed to a file, memory-mapped
    np.testing.assert_array_equal(mapped.with_format("numpy")[:]["features"], feats)


@pytest.mark.parametrize("level", ["token", "word"])
def test_ragged_store_to_arrow_and_dataset(bert, tmp_path, level):
    extract(pa.table({"text": TEXTS}), tmp_path / "s", model=bert, level=level)
    store = lw.open_store(tmp_path / "s")
    table = store.to_arrow()
    side = "token_ids" if level == "token" else "words"
    assert table.column_names == ["line", side, "features"]
    for i in (0, 3, len(store) - 1):
        row = table["features"][i].values.to_numpy_ndarray()
        np.testing.assert_array_equal(row, store[i])
    ds = store.to_dataset().with_format("numpy")
    assert np.stack(ds[0]["features"]).shape == store[0].shape
    if level == "token":
        assert table["token_ids"][2].as_py() == store.token_ids(2).tolist()
    else:
        assert table["words"][1].as_py() == store.words(1)


def test_parquet_export_keeps_the_feature_shape(bert, tmp_path):
    extract(pa.table({"text": TEXTS}), tmp_path / "s", model=bert, layers="-2:", combine="stack")
    store = lw.open_store(tmp_path / "s")
    out = export(store, tmp_path / "x.parquet", to="parquet")
    col = pq.read_table(out)["features"]
    assert str(col.type) == "fixed_size_list<element: fixed_size_list<element: float>[32]>[2]"
    np.testing.assert_array_equal(np.array(col.to_pylist(), dtype=np.float32), store.to_numpy())
