"""Files read as users have them (issue 55): CoNLL-2003 and CoNLL-U distributed as ``.txt``, CSV/TSV without a
header row, columns named by position; every refusal that a format would fix names the format."""

from __future__ import annotations

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.corpus.readers import BadRecord, ReadOptions, count_records, read_records, sniff_txt
from layerwise.corpus.splits import csv_row_starts
from layerwise.errors import InputError
from layerwise.store import open_store

from tiny import extract

CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
"""
CONLL_NO_DOCSTART = CONLL.split("\n\n", 1)[1]
CONLLU = ("# sent_id = s1\n1\tI\tI\tPRON\tPRP\t_\t2\tnsubj\t_\t_\n2\tgo\tgo\tVERB\tVB\t_\t0\troot\t_\t_\n\n"
          "1\tHello\thello\tINTJ\tUH\t_\t0\troot\t_\t_\n")
TEXTS = ["Fears for T N pension after talks", "The Race is On", "Ky. Company Wins Grant", "a, b, and c"]
LABELS = [3, 4, 4, 2]


@pytest.fixture(scope="module")
def bert(tiny_extractors):
    return tiny_extractors["bert"]


def test_a_conll_2003_file_named_txt_is_read_as_conll_and_said(bert, tmp_path, capfd):
    for name, text in (("dev.txt", CONLL), ("plain.txt", CONLL_NO_DOCSTART)):
        src = tmp_path / name
        src.write_text(text)
        assert sniff_txt(src) == "conll"
        capfd.readouterr()
        extract(src, tmp_path / f"{name}.store", model=bert, level="word", layers=-1, keep=["ner"], progress=False)
        said = capfd.readouterr().err
        assert f"reading '{src}' as CoNLL-2003" in said and "--format txt" in said, said
        st = open_store(tmp_path / f"{name}.store")
        assert len(st) == 2  # two sentences, not one record per token line
        assert st.column("ner")[1] == ["B-PER", "I-PER"]
        np.testing.assert_allclose(st[1], bert.encode_words([["Peter", "Blackburn"]], layers=-1)[0], atol=1e-5)


def test_a_conllu_file_named_txt_is_read_as_conllu(tmp_path):
    src = tmp_path / "ewt.txt"
    src.write_text(CONLLU)
    records = [r for r in read_records(src, keep=["upos"])]
    assert [r.words for r in records] == [["I", "go"], ["Hello"]] and records[0].fields["upos"] == ["PRON", "VERB"]


def test_plain_text_lines_stay_texts_even_with_four_words(tmp_path):
    src = tmp_path / "four.txt"
    src.write_text("I love my dog\nthe cat sat down\n\nwe went home O\n")  # 4 words, but no IOB tags
    assert sniff_txt(src) == "txt"
    want = ["I love my dog", "the cat sat down", "we went home O"]
    assert [r.text for r in read_records(src) if not isinstance(r, BadRecord)] == want


def test_format_txt_reads_a_conll_file_line_by_line_when_asked(tmp_path):
    src = tmp_path / "dev.txt"
    src.write_text(CONLL)
    assert len([r for r in read_records(src, "txt") if not isinstance(r, BadRecord)]) == 7  # the user's word wins


def test_a_refusal_a_format_would_fix_names_format_conll(tmp_path):
    src = tmp_path / "texts.txt"
    src.write_text("EU rejects German call\nPeter Blackburn\n")
    with pytest.raises(InputError, match="give --format conll"):
        list(read_records(src, keep=["ner"]))
    from layerwise.probe.data import check_task

    with pytest.raises(InputError, match="give --format conll"):
        check_task("tagging", src, None, None)


def _headerless(tmp_path, sep="\t"):
    src = tmp_path / ("news.tsv" if sep == "\t" else "news.csv")
    src.write_text("".join(f"{label}{sep}{text if sep == chr(9) else chr(34) + text + chr(34)}\n"
                           for label, text in zip(LABELS, TEXTS)))
    return src


@pytest.mark.parametrize("sep", ["\t", ","])
def test_a_headerless_file_is_read_by_column_position(tmp_path, sep):
    src = _headerless(tmp_path, sep)
    records = list(read_records(src, text_field="2", keep=["1"], header=False))
    assert [r.text for r in records] == TEXTS and [r.fields["1"] for r in records] == LABELS
    assert [r.line for r in records] == [1, 2, 3, 4]  # the first row is a record
    assert count_records(src, "tsv" if sep == "\t" else "csv", header=False) == 4
    with pytest.raises(InputError, match=r"without a header row has columns 1..2: name the text column by its "
                                         r"position \(--text-column N"):
        list(read_records(src, header=False))
    with pytest.raises(InputError, match=r"has no column '3'"):
        list(read_records(src, text_field="3", header=False))


def test_without_no_header_the_first_row_taken_as_a_header_says_how_to_fix_it(tmp_path):
    src = _headerless(tmp_path)
    with pytest.raises(InputError, match="--no-header"):
        list(read_records(src))


def test_a_column_position_works_with_a_header_too(tmp_path):
    src = tmp_path / "t.tsv"
    src.write_text("label\tsentence\n1\tgood film\n0\tbad film\n")
    records = list(read_records(src, text_field="2", keep=["1"]))
    assert [(r.text, r.fields["1"]) for r in records] == [("good film", 1), ("bad film", 0)]


def test_a_headerless_row_of_another_width_is_a_bad_record_named_against_the_first_row(tmp_path):
    src = tmp_path / "t.tsv"
    src.write_text("1\tgood\n0\tbad\textra\n")
    items = list(read_records(src, text_field="2", header=False))
    assert isinstance(items[1], BadRecord) and "the first row has 2" in items[1].reason


def test_headerless_parts_start_at_the_first_row(tmp_path):
    src = _headerless(tmp_path)
    end, starts = csv_row_starts(str(src), "tsv", 2, header=False)
    first_row = len(src.read_bytes().split(b"\n")[0]) + 1
    assert end == 0 and starts[0] == 2 * first_row + len(src.read_bytes().split(b"\n")[1]) + 1 - first_row


def test_extract_no_header_text_column_2_cli(bert, tmp_path, tiny_dirs):
    src = _headerless(tmp_path)
    res = CliRunner().invoke(app, ["extract", str(src), "-o", str(tmp_path / "s"), "--model", str(tiny_dirs["bert"]),
                                   "--no-header", "--text-column", "2", "--keep", "1", "--layers", "-1", "-q"])
    assert res.exit_code == 0, res.output
    st = open_store(tmp_path / "s")
    assert len(st) == 4 and st.column("1") == LABELS
    assert st.manifest["input"]["header"] is False
    np.testing.assert_allclose(st.to_numpy(), bert.encode(TEXTS, layers=-1), atol=1e-5)


def test_read_options_say_what_header_and_text_field_take():
    with pytest.raises(InputError, match="header must be True or False"):
        ReadOptions(header="no")
    with pytest.raises(InputError, match=r"a 1-based position as a string \(e.g. '2'\)"):
        ReadOptions(text_field=2)
    assert "header" not in ReadOptions().to_dict() and ReadOptions(header=False).to_dict()["header"] is False


def test_train_reads_a_headerless_tsv_by_position(tiny_dirs, tmp_path):
    src = tmp_path / "train.tsv"
    rows = [(i % 2, f"{'good great fine' if i % 2 else 'bad awful poor'} film number {i}") for i in range(500)]
    src.write_text("".join(f"{label}\t{text}\n" for label, text in rows))
    res = CliRunner().invoke(app, ["train", "--train", str(src), "-o", str(tmp_path / "m"), "--model",
                                   str(tiny_dirs["bert"]), "--no-header", "--text-column", "2", "--label-column", "1",
                                   "--epochs", "2", "-q", "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 0, res.output
    assert "dev (held out of train)" in res.output
    clf = lw.heads.load(tmp_path / "m")
    assert clf.labels == ["0", "1"]
