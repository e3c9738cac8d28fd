"""Splitting an input into independently read parts (the parallel reads of ``--engine ray``): every format, read
split by split with each split's line base, gives exactly the records of one sequential read; planning never reads
the records (1,000 files, or one 10 GB file, plan in well under a second); several files are one input locally too."""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import layerwise as lw
from layerwise.corpus.readers import ReadOptions
from layerwise.corpus.sources import open_source
from layerwise.corpus.splits import plan_splits, read_split, uncut_reason


def _by_splits(src, reading, records):
    """The items of every split, lines made global from each split's line count; and the splits."""
    splits = plan_splits(src, src.files(), records)
    out, base = [], 0
    for split in splits:
        reader = read_split(src, split, reading)
        for item in reader.items():
            item.line += base
            out.append(item)
        base += reader.lines
    return out, splits


def _key(items):
    return [(i.line, getattr(i, "text", None), getattr(i, "fields", None), getattr(i, "reason", None),
             getattr(i, "words", None), getattr(i, "context", None)) for i in items]


def _jsonl(path, n, bad_every=37):
    rows = []
    for i in range(n):
        if i % bad_every == 5:
            rows.append("{not json")
        elif i % 53 == 7:
            rows.append("")  # a blank line: not a record, but a line
        else:
            rows.append(json.dumps({"text": f"record {i} é " + "w " * (i % 11), "id": i}, ensure_ascii=False))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def _conll(path, docs=6, sents=7):
    out = []
    for d in range(docs):
        out += ["-DOCSTART- -X- -X- O", ""]
        for s in range(sents):
            out += [f"W{d}{s}{k} NN B-NP {'B-PER' if k == 0 else 'O'}" for k in range(1 + (s % 4))] + [""]
    path.write_text("\n".join(out), encoding="utf-8")
    return path


@pytest.mark.parametrize("records", [1, 7, 40, 100_000])
def test_jsonl_and_txt_byte_ranges_read_as_one(tmp_path, records):
    src_path = _jsonl(tmp_path / "c.jsonl", 400)
    for path, reading in ((src_path, ReadOptions(keep=("id",))),):
        src = open_source(path, reading)
        got, splits = _by_splits(src, reading, records)
        assert _key(got) == _key(src.records(reading))
        assert (len(splits) > 1) == (records < 400)
    txt = tmp_path / "c.txt"
    txt.write_bytes(b"first\n\nthird \xff bad\n" + "".join(f"line {i}\r\n" for i in range(300)).encode()
                    + b"no newline at the end")
    src = open_source(txt)
    got, splits = _by_splits(src, ReadOptions(), records)
    assert _key(got) == _key(src.records(ReadOptions())) and got[-1].line == 304


@pytest.mark.parametrize("fmt", ["csv", "tsv", "conll", "conllu"])
def test_formats_split_per_file(tmp_path, fmt):
    if fmt in ("csv", "tsv"):
        sep = "," if fmt == "csv" else "\t"
        path = tmp_path / f"c.{fmt}"
        path.write_text(f"text{sep}label\n" + "".join(f"row {i}{sep}{i % 2}\n" for i in range(50)), encoding="utf-8")
        reading = ReadOptions(keep=("label",))
    elif fmt == "conll":
        path, reading = _conll(tmp_path / "c.conll"), ReadOptions(keep=("ner",), context="document")
    else:
        path = tmp_path / "c.conllu"
        path.write_text("".join(f"# sent_id = s{i}\n1\tHello\thello\tINTJ\t_\t_\t0\troot\t_\t_\n2\tworld\tworld\tNOUN"
                                f"\t_\t_\t1\tvocative\t_\t_\n\n" for i in range(20)), encoding="utf-8")
        reading = ReadOptions(keep=("upos",))
    src = open_source(path, reading)
    got, splits = _by_splits(src, reading, 3)
    # csv/tsv: cut every 3 rows where the csv reader ends a row; CoNLL: a document is never cut
    assert len(splits) == (17 if fmt in ("csv", "tsv") else 1)
    assert _key(got) == _key(src.records(reading))
    why = uncut_reason(src, src.files(), 3)
    assert (why is None) if fmt in ("csv", "tsv") else (f"{fmt} files are read whole" in why)


def test_csv_is_cut_where_the_csv_reader_ends_a_row(tmp_path):
    """Quoted newlines (LF and CRLF), a BOM, quoted quotes and commas, a malformed row and a blank line: every split
    holds exactly ``records`` rows of the reader (the last fewer), each read after the header, and together they are
    one sequential read, line numbers included."""
    import csv as csvmod

    path = tmp_path / "q.csv"
    with open(path, "w", newline="", encoding="utf-8-sig") as fh:
        w = csvmod.writer(fh, lineterminator="\r\n")
        w.writerow(["text", "label"])
        for i in range(200):
            text = f'row {i} "quoted", and\nmore\r\nlines' if i % 3 == 0 else f"row {i}"
            w.writerow([text, i % 2])
            if i == 50:
                fh.write("\r\n")  # a blank line
            if i == 120:
                fh.write('"unterminated,1\r\nstill, in it\r\n"x"y,0\r\n')  # a malformed row
    reading = ReadOptions(keep=("label",))
    src = open_source(path, reading)
    got, splits = _by_splits(src, reading, 40)
    whole = list(src.records(reading))
    assert _key(got) == _key(whole) and len(whole) > 200
    counts = [sum(1 for _ in read_split(src, s, reading).items()) for s in splits]
    assert len(splits) == 6 and all(c <= 40 for c in counts) and sum(counts) == len(whole), counts
    assert splits[0].start == 0 and splits[-1].end == path.stat().st_size
    assert all(a.end == b.start for a, b in zip(splits, splits[1:]))


def test_parquet_row_groups_larger_than_a_part_are_said(tmp_path):
    pq.write_table(pa.table({"text": [f"row {i}" for i in range(100)]}), tmp_path / "one.parquet", row_group_size=50)
    src = open_source(tmp_path / "one.parquet")
    assert uncut_reason(src, src.files(), 50) is None
    assert "row groups of up to 50 rows make parts larger than part_records=20" in uncut_reason(src, src.files(), 20)


def test_parquet_row_groups_and_tables(tmp_path):
    folder = tmp_path / "pq"
    folder.mkdir()
    for k in range(3):
        table = pa.table({"text": [f"file {k} row {i}" if i % 17 else None for i in range(100)],
                          "label": list(range(100))})
        pq.write_table(table, folder / f"part-{k}.parquet", row_group_size=10)
    reading = ReadOptions(keep=("label",))
    src = open_source(folder, reading)
    got, splits = _by_splits(src, reading, 25)
    assert len(splits) == 3 * 4 and {s.unit for s in splits} == {"row_groups"}
    assert _key(got) == _key(src.records(reading))
    table = pq.read_table(folder / "part-0.parquet")
    src = open_source(table, reading)
    got, splits = _by_splits(src, reading, 30)
    assert len(splits) == 4 and _key(got) == _key(src.records(reading))


def test_planning_reads_no_records(tmp_path):
    """1,000 small files, and one 10 GB (sparse) file, plan in under a second each."""
    folder = tmp_path / "many"
    folder.mkdir()
    for k in range(1000):
        (folder / f"f{k:04d}.jsonl").write_text(json.dumps({"text": f"file {k}"}) + "\n")
    started = time.perf_counter()
    src = open_source(folder)
    splits = plan_splits(src, src.files(), 10_000)
    took = time.perf_counter() - started
    assert len(splits) == 1000 and took < 1.0, took
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.write(b"a short line of text\n" * 5000)
        fh.truncate(10 * 10**9)  # a 10 GB file that takes no disk
    started = time.perf_counter()
    src = open_source(big)
    splits = plan_splits(src, src.files(), 100_000)
    took = time.perf_counter() - started
    assert took < 1.0 and splits[0].start == 0 and splits[-1].end == 10 * 10**9 and len(splits) > 100, took


def test_several_files_are_one_input(tmp_path, tiny_extractors):
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "a.txt").write_text("one\ntwo\n\n", encoding="utf-8")
    (folder / "b.txt").write_text("three\nfour\n", encoding="utf-8")
    whole = tmp_path / "whole.txt"
    whole.write_text("one\ntwo\n\nthree\nfour\n", encoding="utf-8")
    spec = lw.EncodeSpec(layers="-1")
    ex = tiny_extractors["bert"]
    lw.extract(folder, tmp_path / "dir", spec, model=ex)
    lw.extract(str(folder / "*.txt"), tmp_path / "glob", spec, model=ex)
    lw.extract(whole, tmp_path / "whole", spec, model=ex)
    a, g, w = (lw.open_store(tmp_path / n) for n in ("dir", "glob", "whole"))
    assert a.lines.tolist() == g.lines.tolist() == w.lines.tolist() == [1, 2, 4, 5]
    assert a.errors == w.errors == [{"line": 3, "reason": "empty text (nothing left after stripping whitespace)"}]
    assert a.manifest["input"]["sha256"] == g.manifest["input"]["sha256"] != w.manifest["input"]["sha256"]
    (folder / "c.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(lw.LayerwiseError, match=r"holds files of several formats \(jsonl, txt\); give one format"):
        lw.extract(folder, tmp_path / "mixed", spec, model=ex)
    with pytest.raises(lw.LayerwiseError, match="holds no corpus files"):
        lw.extract(str(tmp_path / "nothing" / "*.txt"), tmp_path / "none", spec, model=ex)
