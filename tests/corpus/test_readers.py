"""Every input format of ``layerwise extract`` round-trips into a store equal to ``Extractor.encode``/``encode_words``.

Fixtures are small strings written to ``tmp_path``; the tiny BERT (one tiny RoBERTa case, one default-model case)
keeps the whole file fast. Bad records are checked line by line, skipped or (``strict``) fatal.
"""

from __future__ import annotations

import csv
import io
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from layerwise import ExtractError
from layerwise.cli.main import app
from layerwise.store import open_store

from tiny import extract

TEXTS = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn",
    'naïve cafés, "quoted" text',
    "I love Paris in the springtime",
    "a",
]
LABELS = ["pos", "neg", "pos", "neu", "neg"]
CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER

-DOCSTART- -X- -X- O

Brussels NNP B-NP B-LOC
"""
CONLL_WORDS = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"], ["Brussels"]]
CONLLU = (
    "# sent_id = s1\n# text = I cannot go\n"
    "1\tI\tI\tPRON\tPRP\t_\t4\tnsubj\t_\t_\n"
    "2-3\tcannot\t_\t_\t_\t_\t_\t_\t_\t_\n"
    "2\tcan\tcan\tAUX\tMD\t_\t4\taux\t_\t_\n"
    "3\tnot\tnot\tPART\tRB\t_\t4\tadvmod\t_\t_\n"
    "4\tgo\tgo\tVERB\tVB\t_\t0\troot\t_\t_\n"
    "4.1\tgone\tgo\tVERB\tVB\t_\t_\t_\t4:conj\t_\n"
    "\n# sent_id = s2\n"
    "1\tHello\thello\tINTJ\tUH\t_\t2\tdiscourse\t_\t_\n"
    "2\tParis\tParis\tPROPN\tNNP\t_\t0\troot\t_\t_\n"
)


@pytest.fixture(scope="module")
def bert(tiny_extractors):
    return tiny_extractors["bert"]


def write_input(fmt: str, tmp_path):
    """(path, extract kwargs, expected kept columns) for ``TEXTS`` in ``fmt`` (text in a non-default column)."""
    ids = list(range(10, 10 + len(TEXTS)))
    if fmt in ("txt", "stdin"):
        p = tmp_path / "in.txt"
        p.write_text("\n".join(TEXTS) + "\n", encoding="utf-8")
        if fmt == "stdin":
            return "-", {"stdin": io.BytesIO(p.read_bytes())}, {}
        return p, {}, {}
    if fmt == "jsonl":
        p = tmp_path / "in.jsonl"
        rows = [
            json.dumps({"id": i, "body": t, "label": lab}, ensure_ascii=False) for i, t, lab in zip(ids, TEXTS, LABELS)
        ]
        p.write_text("\n".join(rows) + "\n", encoding="utf-8")
        return p, {"text_field": "body", "keep": ["id", "label"]}, {"id": ids, "label": LABELS}
    if fmt == "csv":
        p = tmp_path / "in.csv"
        with open(p, "w", encoding="utf-8", newline="") as fh:  # quoting: a text holds a comma and quotes
            csv.writer(fh).writerows([["id", "review", "label"], *zip(ids, TEXTS, LABELS)])
        return p, {"text_field": "review", "keep": ["id", "label"]}, {"id": ids, "label": LABELS}  # numbers, as JSON
    if fmt == "tsv":  # quotes are literal in TSV
        p = tmp_path / "in.tsv"
        rows = ["id\treview\tlabel", *[f"{i}\t{t}\t{lab}" for i, t, lab in zip(ids, TEXTS, LABELS)]]
        p.write_text("\n".join(rows) + "\n", encoding="utf-8")
        return p, {"text_field": "review", "keep": ["id", "label"]}, {"id": ids, "label": LABELS}  # numbers, as JSON
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        p = tmp_path / "in.parquet"
        pq.write_table(pa.table({"id": ids, "content": TEXTS, "label": LABELS}), p)
        return p, {"text_field": "content", "keep": ["id", "label"]}, {"id": ids, "label": LABELS}
    raise AssertionError(fmt)


def reference(ex, level, items, layers, **kw):
    """What the in-memory API returns: ``[n, D]`` (sentence) or a list of ``[n_i, D]``."""
    if level == "sentence":
        return ex.encode(items, layers=layers, combine="concat", pool=kw.get("pool", "mean"))
    if level == "token":
        return ex.encode(items, layers=layers, combine="concat", pool=None)
    words = [w if isinstance(w, list) else w.split() for w in items]
    return ex.encode_words(words, layers=layers, combine="concat", subword=kw.get("subword", "first"))


def assert_store_equals(st, ref, level, tol=1e-5):
    assert len(st) == len(ref)
    for i, want in enumerate(ref):
        got = np.asarray(st[i], dtype=np.float32)
        assert got.shape == want.shape, (i, got.shape, want.shape)
        assert np.abs(got - want).max() <= tol, i
    if level == "sentence":
        assert np.abs(st.to_numpy() - np.asarray(ref)).max() <= tol


@pytest.mark.parametrize("level", ["sentence", "token", "word"])
@pytest.mark.parametrize("fmt", ["txt", "jsonl", "csv", "tsv", "parquet", "stdin"])
def test_format_roundtrip_equals_encode(bert, tmp_path, fmt, level):
    path, kw, cols = write_input(fmt, tmp_path)
    summary = extract(path, tmp_path / "store", model=bert, layers=[1, 2], level=level, shard_records=2, **kw)
    assert summary.status == "complete" and summary.records == len(TEXTS) and summary.skipped == 0
    st = open_store(tmp_path / "store")
    assert_store_equals(st, reference(bert, level, TEXTS, [1, 2]), level)
    assert st.lines.tolist() == ([2, 3, 4, 5, 6] if fmt in ("csv", "tsv") else [1, 2, 3, 4, 5])
    assert st.columns == list(cols) and {c: st.column(c) for c in cols} == cols
    if level == "token":
        ids = [bert.tokenizer(t)["input_ids"] for t in TEXTS]
        for i, want in enumerate(ids):
            assert st.token_ids(i).tolist() == want
        assert summary.tokens == sum(map(len, ids))
    if level == "word":
        assert [st.words(i) for i in range(len(st))] == [t.split() for t in TEXTS]


@pytest.mark.parametrize("level", ["sentence", "token"])
def test_float16_store_within_fp16_rounding(bert, tmp_path, level):
    path, kw, _ = write_input("csv", tmp_path)
    extract(path, tmp_path / "s16", model=bert, layers="all", level=level, output_dtype="float16", **kw)
    st = open_store(tmp_path / "s16")
    ref = reference(bert, level, TEXTS, "all")
    assert st.dtype == np.float16 and st.manifest["spec"]["output_dtype"] == "float16"
    for i, want in enumerate(ref):
        assert st[i].dtype == np.float16
        want16 = want.astype(np.float16).astype(np.float32)
        np.testing.assert_allclose(st[i].astype(np.float32), want16, rtol=1e-3, atol=1e-3)


def test_roberta_token_level_jsonl(tiny_extractors, tmp_path):
    rob = tiny_extractors["roberta"]
    path, kw, cols = write_input("jsonl", tmp_path)
    extract(path, tmp_path / "rob", model=rob, layers=-1, level="token", **kw)
    st = open_store(tmp_path / "rob")
    assert_store_equals(st, reference(rob, "token", TEXTS, -1), "token")
    assert [st.token_ids(i).tolist() for i in range(len(st))] == [rob.tokenizer(t)["input_ids"] for t in TEXTS]
    assert st.column("label") == LABELS and st.manifest["model"]["family"] == "roberta"


def test_default_model_txt_sentence(default_extractor, tmp_path):
    path, _, _ = write_input("txt", tmp_path)
    extract(path, tmp_path / "d", model=default_extractor, layers="-4:", pool="max")
    st = open_store(tmp_path / "d")
    assert st.feature_shape == (1536,)
    assert_store_equals(st, reference(default_extractor, "sentence", TEXTS, "-4:", pool="max"), "sentence")


@pytest.mark.parametrize("level", ["word", "sentence", "token"])
def test_conll2003_docstart_words_and_columns(bert, tmp_path, level):
    p = tmp_path / "train.conll"
    p.write_text(CONLL, encoding="utf-8")
    sub = {"subword": "mean"} if level == "word" else {}  # subword applies to level word only
    extract(p, tmp_path / "c", model=bert, layers="-2:", level=level, keep=["ner", "doc", "pos"], **sub)
    st = open_store(tmp_path / "c")
    items = CONLL_WORDS if level == "word" else [" ".join(w) for w in CONLL_WORDS]
    assert_store_equals(st, reference(bert, level, items, "-2:", subword="mean"), level)
    assert st.lines.tolist() == [3, 8, 13]
    assert st.column("ner") == [["B-ORG", "O", "B-MISC", "O"], ["B-PER", "I-PER"], ["B-LOC"]]
    assert st.column("pos") == [["NNP", "VBZ", "JJ", "NN"], ["NNP", "NNP"], ["NNP"]]
    assert st.column("doc") == [0, 0, 1]
    if level == "word":
        assert [st.words(i) for i in range(3)] == CONLL_WORDS
        assert st.num_rows == sum(map(len, CONLL_WORDS))  # one vector per word, DOCSTART lines excluded


def test_conllu_skips_multiword_and_empty_nodes(bert, tmp_path):
    p = tmp_path / "ud.conllu"
    p.write_text(CONLLU, encoding="utf-8")
    extract(
        p, tmp_path / "u", model=bert, layers=[0, 2], level="word", subword="last", keep=["upos", "head", "sent_id"]
    )
    st = open_store(tmp_path / "u")
    words = [["I", "can", "not", "go"], ["Hello", "Paris"]]
    assert [st.words(i) for i in range(len(st))] == words
    assert [st[i].shape[0] for i in range(len(st))] == [4, 2] and st.num_rows == 6
    assert_store_equals(st, reference(bert, "word", words, [0, 2], subword="last"), "word")
    assert st.column("upos") == [["PRON", "AUX", "PART", "VERB"], ["INTJ", "PROPN"]]
    assert st.column("head") == [[4, 4, 4, 0], [2, 0]]
    assert st.column("sent_id") == ["s1", "s2"]
    assert st.lines.tolist() == [3, 11]


BAD_CASES = {
    "txt": (
        b"first good line\n\n   \t \n\xff\xfe bad bytes\nsecond good\n",
        {},
        [(2, "empty text"), (3, "empty text"), (4, "invalid UTF-8")],
        ["first good line", "second good"],
    ),
    "jsonl": (
        b'{"text": "good one", "id": 1}\n{"text": 5, "id": 2}\n{"text": "oops"\n{"id": 4}\n'
        b'{"text": "\xff\xfe", "id": 5}\n{"text": "  ", "id": 6}\n[1, 2]\n{"text": null, "id": 8}\n'
        b'{"text": "good two", "id": 9}\n',
        {"keep": ["id"]},
        [
            (2, "is not a string"),
            (3, "invalid JSON"),
            (4, "missing field 'text'"),
            (5, "invalid UTF-8"),
            (6, "empty text"),
            (7, "must hold an object"),
            (8, "missing value"),
        ],
        ["good one", "good two"],
    ),
    "csv": (
        b'id,text\n1,good one\n2,too,many\n3\n4,"broken "quote"\n5,\xff\xfe\n6," "\n7,good two\n',
        {"keep": ["id"]},
        [
            (3, "row has 3 fields, the header has 2"),
            (4, "row has 1 fields, the header has 2"),
            (5, "malformed CSV row"),
            (6, "invalid UTF-8"),
            (7, "empty text"),
        ],
        ["good one", "good two"],
    ),
}


@pytest.mark.parametrize("fmt", list(BAD_CASES))
def test_bad_records_logged_with_line_and_skipped(bert, tmp_path, fmt):
    raw, kw, bad, good = BAD_CASES[fmt]
    p = tmp_path / f"bad.{fmt}"
    p.write_bytes(raw)
    summary = extract(p, tmp_path / "s", model=bert, shard_records=1, **kw)
    st = open_store(tmp_path / "s")
    assert summary.skipped == len(bad) and summary.records == len(good)
    assert [e["line"] for e in st.errors] == [n for n, _ in bad]
    for entry, (_, reason) in zip(st.errors, bad):
        assert reason in entry["reason"], entry
    logged = [json.loads(x) for x in (tmp_path / "s" / "errors.jsonl").read_text().splitlines()]
    assert logged == st.errors and st.manifest["counts"]["skipped"] == len(bad)
    assert np.abs(st.to_numpy() - bert.encode(good, layers=-1)).max() <= 1e-5

    with pytest.raises(ExtractError) as info:
        extract(p, tmp_path / "strict", model=bert, shard_records=1, strict=True, **kw)
    line, reason = bad[0]
    assert re.search(rf"line {line}\b", str(info.value)) and reason in str(info.value)
    partial = open_store(tmp_path / "strict")  # shards finished before the bad record stay readable
    assert len(partial) == 1 and partial.lines.tolist() == [st.lines[0]]
    assert np.abs(partial[0] - st[0]).max() == 0


def test_parquet_null_text_reported_by_row(bert, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    p = tmp_path / "n.parquet"
    pq.write_table(pa.table({"text": ["good one", None, "   ", "good two"]}), p)
    extract(p, tmp_path / "s", model=bert)
    st = open_store(tmp_path / "s")
    assert [(e["line"], e["reason"].split(" ")[0]) for e in st.errors] == [(2, "missing"), (3, "empty")]
    assert st.lines.tolist() == [1, 4]


@pytest.mark.parametrize(
    "name, raw, kw, message",
    [
        ("a.csv", "id,sentence\n1,hello\n", {"text_field": "text"}, "has no column 'text'"),
        ("a.tsv", "id\ttext\n1\thello\n", {"keep": ["label"]}, "has no column 'label'"),
        ("a.csv", "id,body\n1,hello\n", {}, "no 'text' or 'sentence' column"),
        ("a.txt", "hello\n", {"keep": ["id"]}, "needs columns"),
        ("a.conll", CONLL, {"keep": ["lemma"]}, "not a CoNLL-2003 column"),
    ],
)
def test_whole_file_errors_create_no_store(bert, tmp_path, name, raw, kw, message):
    p = tmp_path / name
    p.write_text(raw, encoding="utf-8")
    with pytest.raises(ValueError, match=re.escape(message)):
        extract(p, tmp_path / "never", model=bert, **kw)
    assert not (tmp_path / "never").exists()


def test_cli_extract_stdin_and_csv(bert, tiny_dirs, tmp_path):
    runner = CliRunner()
    model = ["--model", str(tiny_dirs["bert"]), "--device", "cpu"]
    text = "\n".join(TEXTS[:2]) + "\n\n" + TEXTS[3] + "\n"
    res = runner.invoke(
        app, ["extract", "-", "-o", str(tmp_path / "s"), "--layers", "0,2", "--pool", "max", *model], input=text
    )
    assert res.exit_code == 0, res.output
    m = re.search(
        r"([\d,]+) records, ([\d,]+) tokens in [\d.]+s \([\d,]+ tokens/s\), ([\d.,]+) MB\b"
        r".*?([\d,]+) skipped",
        " ".join(res.stderr.split()),
    )
    assert m and res.stdout == "", res.stderr
    want_tokens = sum(len(bert.tokenizer(t)["input_ids"]) for t in [TEXTS[0], TEXTS[1], TEXTS[3]])
    assert [int(m[i].replace(",", "")) for i in (1, 2, 4)] == [3, want_tokens, 1]
    st = open_store(tmp_path / "s")
    assert abs(float(m[3]) - st.nbytes / 1e6) <= 0.05
    assert st.lines.tolist() == [1, 2, 4] and st.errors[0]["line"] == 3
    assert_store_equals(st, bert.encode([TEXTS[0], TEXTS[1], TEXTS[3]], layers=[0, 2], pool="max"), "sentence")

    path, _, cols = write_input("csv", tmp_path)
    args = [
        "extract",
        str(path),
        "-o",
        str(tmp_path / "c"),
        "--layers",
        "1",
        "--level",
        "word",
        "--subword",
        "max",
        "--text-column",
        "review",
        "--keep",
        "id,label",
        "--shard-records",
        "2",
        "--output-dtype",
        "float16",
        "--quiet",
    ]
    res = runner.invoke(app, [*args, *model])
    assert res.exit_code == 0, res.output
    assert res.stderr == "" and res.stdout == ""
    st = open_store(tmp_path / "c")
    assert st.num_shards == 3 and st.column("id") == cols["id"] and st.column("label") == LABELS
    ref = reference(bert, "word", TEXTS, 1, subword="max")
    for i, want in enumerate(ref):
        np.testing.assert_allclose(st[i].astype(np.float32), want, rtol=1e-3, atol=1e-3)


def test_kept_values_follow_one_rule_in_tsv_csv_and_jsonl(tmp_path):
    """A kept value is what JSON reads: numbers are numbers in TSV/CSV as in JSONL, other cells their text (issue 41,
    item 8)."""
    from layerwise.corpus.readers import kept_value, read_records

    rows = [("a", 1, "x1"), ("b", 0, "007"), ("c", -3, "pos"), ("d", 2.5, ""), ("e", 1e-3, "+1"), ("f", 0.0, "true")]
    (tmp_path / "t.tsv").write_text("text\tlabel\tid\n" + "".join(f"{t}\t{json.dumps(v)}\t{i}\n" for t, v, i in rows))
    (tmp_path / "t.csv").write_text("text,label,id\n" + "".join(f"{t},{json.dumps(v)},{i}\n" for t, v, i in rows))
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"text": t, "label": v, "id": i}) + "\n" for t, v, i in rows))
    got = {}
    for name in ("t.tsv", "t.csv", "t.jsonl"):
        got[name] = [r.fields for r in read_records(tmp_path / name, keep=["label", "id"])]
    assert got["t.tsv"] == got["t.csv"] == got["t.jsonl"]
    assert [type(f["label"]) for f in got["t.tsv"]] == [int, int, int, float, float, float]
    assert [f["id"] for f in got["t.tsv"]] == ["x1", "007", "pos", "", "+1", "true"]
    assert kept_value("12") == 12 and kept_value("1.50") == 1.5 and kept_value("1e999") == "1e999"
    assert kept_value("٣") == "٣" and kept_value(" 1") == " 1" and kept_value("NaN") == "NaN"
