"""Streaming readers for the corpus formats users bring; a bad record never stops the read.

Every reader yields, in file order, either a :class:`Record` or a :class:`BadRecord` (line number and reason),
so the caller decides whether to skip bad records (and log them) or stop at the first (``strict``).
Nothing holds the whole file.

=============  ===========================  ===========================================================
format         file                         a record is
=============  ===========================  ===========================================================
``txt``        ``*.txt``, stdin             one non-empty line (a ``.txt`` file holding CoNLL-2003 or CoNLL-U
                                            lines is read as that format, and said: :func:`sniff_txt`)
``jsonl``      ``*.jsonl``, ``*.ndjson``    one JSON object per line; text from ``text_field``
``csv``        ``*.csv``                    one row (header row first); text from ``text_field``
``tsv``        ``*.tsv``                    one tab-separated row (header first; quotes are literal)
``parquet``    ``*.parquet``, a directory   one row; text from ``text_field``; a directory's ``*.parquet``
               of them                      files are read in name order as one input
``conll``      ``*.conll``, ``*.conll2003``  one sentence of CoNLL-2003 ``word POS chunk NER`` lines;
                                            ``-DOCSTART-`` lines start documents (``doc`` field)
``conllu``     ``*.conllu``                 one CoNLL-U sentence; multiword-token (``1-2``) and empty-node
                                            (``8.1``) lines are skipped, so words align with the tree
=============  ===========================  ===========================================================

Kept columns (``keep``, the CLI's ``--keep``) follow one rule in every format: a kept value is what JSON reads. A
JSONL field is its JSON value; a TSV/CSV cell that is a JSON number (``0``, ``-3``, ``2.5``, ``1e-3``) is kept as that
number (``int`` or ``float``, as ``json.loads`` reads it), and every other cell as the text written (``"007"``,
``"+1"``, ``"1,5"``, ``"true"``, ``"pos"`` and an empty cell stay strings). So the label ``1`` is the int ``1``
whether it comes from ``train.tsv`` or ``train.jsonl``; parquet and tables keep their column types.

Line numbers are 1-based lines of the file (a CoNLL sentence: its first word line; parquet and tables: the row
number, counted on across a directory's files). :func:`read_table` reads an Arrow table in memory the same way.
For the CoNLL formats ``Record.words`` holds the words and ``Record.text`` is ``" ".join(words)``; per-word
columns are kept as lists: ``pos``, ``chunk``, ``ner`` (CoNLL-2003) and ``lemma``, ``upos``, ``xpos``, ``feats``,
``head``, ``deprel`` (CoNLL-U), plus ``sent_id`` and the ``# text`` comment as ``sent_text``.

Example::

    >>> from layerwise.corpus.readers import read_records
    >>> for rec in read_records("train.tsv", text_field="sentence", keep=["label"]):
    ...     print(rec.line, rec.text[:20], rec.fields)            # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Iterator, Sequence

from ..errors import InputError
from .conll import CONLL2003_COLUMNS, CONLLU_COLUMNS, read_conll2003, read_conllu, with_document_context
from .records import EMPTY_TEXT, BadRecord, Item, RangeStream, Record, is_blank, iter_lines

if TYPE_CHECKING:
    from .watch import ReadDigest

FORMATS = ("txt", "jsonl", "csv", "tsv", "parquet", "conll", "conllu")
_SUFFIXES = {
    ".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv",
    ".parquet": "parquet", ".conll": "conll", ".conll2003": "conll", ".conllu": "conllu",
}
TEXT_FIELD_GUESSES = ("text", "sentence")
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")  # RFC 8259's number, ASCII digits


def is_glob(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a glob pattern (``corpus/*.jsonl``) rather than a file that exists."""
    text = os.fspath(path)
    return text != "-" and any(c in text for c in "*?[") and not os.path.exists(text)


def corpus_files(path: str | os.PathLike, fmt: str | None = None) -> list[str]:
    """The files of an input, in name order: the file itself; a directory's ``*.parquet`` files, else its files of
    one corpus format (``fmt`` when given); the matches of a glob pattern.

    Raises:
        InputError: a directory or pattern without corpus files, or with files of several formats.
    """
    text = os.fspath(path)
    if text == "-":
        return [text]
    if is_glob(text):
        import glob

        found = sorted(f for f in glob.glob(text) if os.path.isfile(f))
        where = f"the pattern {text!r}"
    elif Path(text).is_dir():
        found = sorted(os.fspath(f) for f in Path(text).iterdir() if f.is_file() and not f.name.startswith("."))
        where = f"the directory {text!r}"
    else:
        return [text]
    kinds = {f: _SUFFIXES.get(Path(f).suffix.lower()) for f in found}
    if "parquet" in kinds.values() and fmt not in (None, "parquet"):
        raise InputError(f"input {text!r} is a directory of parquet files; it cannot be read as {fmt!r} (leave the "
                         f"format out, or give format='parquet')")
    if fmt is None:
        formats = sorted({k for k in kinds.values() if k is not None})
        if len(formats) > 1 and "parquet" not in formats:
            raise InputError(f"{where} holds files of several formats ({', '.join(formats)}); give one format with "
                             f"--format (format=), or a pattern such as {os.path.join(text, '*.' + formats[0])!r}")
        fmt = "parquet" if "parquet" in formats else (formats[0] if formats else None)
    files = [f for f, k in kinds.items() if k == fmt] or ([] if fmt in (None, "parquet") else found)
    if not files:
        raise InputError(
            f"{where} holds no corpus files (.txt, .jsonl, .csv, .tsv, .parquet, .conll, .conllu); give one corpus "
            f"file (or '-' for stdin), a directory of them, or a pattern, e.g. "
            f"{os.path.join(text if not is_glob(text) else '.', 'corpus.txt')!r}"
        )
    return files


def parquet_files(path: str | os.PathLike) -> list[Path]:
    """The parquet files of an input: the file itself, or a directory's ``*.parquet`` files in name order."""
    p = Path(path)
    if not p.is_dir() and not is_glob(path):
        return [p]
    files = [Path(f) for f in corpus_files(path, "parquet")]
    if not files:
        raise InputError(
            f"input {os.fspath(path)!r} is a directory without .parquet files; give one corpus file (or '-' for "
            f"stdin) or a directory of .parquet files, e.g. {os.path.join(os.fspath(path), 'corpus.txt')!r}"
        )
    return files


def detect_format(path: str | os.PathLike, format: str | None = None) -> str:
    """The format of ``path`` (``format`` if given, ``txt`` for stdin ``-``; a directory or glob pattern: the format
    of its files, ``parquet`` when it holds parquet files); ``ValueError`` lists the valid ones."""
    if format is not None and format not in FORMATS:
        raise InputError(f"unknown input format {format!r}. Valid formats are: {', '.join(FORMATS)}")
    if isinstance(path, (str, os.PathLike)) and os.fspath(path) != "-" and (Path(path).is_dir() or is_glob(path)):
        files = corpus_files(path, format)
        if format is not None:
            return format
        found = _SUFFIXES.get(Path(files[0]).suffix.lower()) or "txt"
        sniffed = sniff_txt(files[0]) if found == "txt" else found
        return _read_as(path, sniffed) if sniffed != found else found
    if format is not None:
        return format
    if os.fspath(path) == "-":
        return "txt"
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise InputError(
            f"cannot tell the format of {os.fspath(path)!r} from its suffix {suffix!r}; pass the format "
            f"(--format / format=) as one of: {', '.join(FORMATS)}"
        )
    if _SUFFIXES[suffix] == "txt" and (sniffed := sniff_txt(path)) != "txt":
        return _read_as(path, sniffed)
    return _SUFFIXES[suffix]


_SNIFF_BYTES = 64 << 10  # how much of a .txt file is looked at to tell CoNLL from plain lines
_IOB = re.compile(r"^(?:O|[BIES]-\S+)$")  # a CoNLL-2003 tag: O, B-PER, I-ORG, E-LOC, S-MISC
_said: set[str] = set()  # the files whose read-as format was already said (once per file and process)


def sniff_txt(path: str | os.PathLike) -> str:
    """What a ``.txt`` file holds: ``"conll"`` (CoNLL-2003: a ``-DOCSTART-`` first line, or blank-line separated
    ``word POS chunk NER`` lines whose last column is an IOB tag), ``"conllu"`` (tab-separated lines of 10 columns
    whose first is a word index), else ``"txt"`` (one text per line). Reads the first 64 KiB."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(_SNIFF_BYTES).decode("utf-8", errors="replace")
    except OSError:
        return "txt"
    lines = head.splitlines()[:-1] if len(head) == _SNIFF_BYTES else head.splitlines()  # the last may be cut
    words = [line for line in lines if line.strip() and not line.startswith("#")]
    if not words:
        return "txt"
    if words[0].split()[0] == "-DOCSTART-":
        return "conll"
    blanks = sum(1 for line in lines if not line.strip())
    sample = words[:200]
    if all(len(cells := line.split("\t")) == 10 and cells[0].split("-")[0].split(".")[0].isdigit()
           for line in sample):
        return "conllu"
    if len(sample) >= 3 and blanks and all(len(cells := line.split()) == 4 and _IOB.match(cells[3])
                                            for line in sample):
        return "conll"
    return "txt"


def _read_as(path: str | os.PathLike, fmt: str) -> str:
    """``fmt`` for a ``.txt`` file found to hold CoNLL (:func:`sniff_txt`), said once per file."""
    name = os.fspath(path)
    if name not in _said:
        _said.add(name)
        from ..notices import notice

        label = {"conll": "CoNLL-2003 (word POS chunk NER lines, a blank line between sentences)",
                 "conllu": "CoNLL-U (10 tab-separated columns, a blank line between sentences)"}[fmt]
        notice(f"reading {name!r} as {label}, one record per sentence; give --format txt (format='txt') to read "
               f"each line as a text")
    return fmt


def _open_binary(path: str | os.PathLike, stdin: IO[bytes] | None) -> IO[bytes]:
    if os.fspath(path) == "-":
        return stdin if stdin is not None else sys.stdin.buffer
    p = Path(path)
    if not p.is_file():
        raise InputError(f"input file {os.fspath(path)!r} does not exist (or is not a file)")
    return open(p, "rb")


def _check_text(value: object, name: str, line: int) -> BadRecord | str:
    if value is None:
        return BadRecord(line, f"missing value for text field {name!r}")
    if not isinstance(value, str):
        return BadRecord(line, f"text field {name!r} is not a string ({type(value).__name__}: {value!r:.40})")
    if is_blank(value):
        return BadRecord(line, EMPTY_TEXT)
    if any("\udc80" <= ch <= "\udcff" for ch in value):
        return BadRecord(line, "invalid UTF-8")
    return value


def column_index(columns: Sequence[str], name: str) -> int | None:
    """Where the column ``name`` is in ``columns``: by its name, else by its 1-based position when ``name`` is a
    number (``"2"``: the second column, as ``cut -f 2`` counts); ``None`` when neither."""
    if name in columns:
        return list(columns).index(name)
    if name.isdigit() and 1 <= int(name) <= len(columns):
        return int(name) - 1
    return None


def pick_column(columns: Sequence[str], wanted: str | None, keep: Sequence[str], where: str) -> str:
    """The text column among ``columns`` (``wanted``, else ``text``, else ``sentence``); ``ValueError`` naming the
    columns when it or a ``keep`` column is missing (``where`` says what was read). A column may be named by its
    1-based position (:func:`column_index`)."""
    if wanted is None:
        wanted = next((c for c in TEXT_FIELD_GUESSES if c in columns), None)
        if wanted is None:
            raise InputError(
                f"{where} has no 'text' or 'sentence' column; its columns are {list(columns)}: name the text "
                f"column with --text-column / text_field= (a name, or a position: --text-column 2); a file "
                f"without a header row: --no-header (header=False) and the columns' positions"
            )
    missing = [c for c in [wanted, *keep] if column_index(columns, c) is None]
    if missing:
        raise InputError(f"{where} has no column {missing[0]!r}; its columns are {list(columns)} (name one, or give "
                         f"its position from 1)")
    return wanted


def _read_txt(fh: IO[bytes], keep: Sequence[str]) -> Iterator[Item]:
    if keep:
        raise InputError(f"--keep {list(keep)} needs columns; a .txt input read as text has only the text (one per "
                         f"line). A CoNLL file named .txt: give --format conll (or conllu); a table: --format tsv "
                         f"or csv")
    for n, line in iter_lines(fh):
        if line is None:
            yield BadRecord(n, "invalid UTF-8")
        elif is_blank(line):
            yield BadRecord(n, EMPTY_TEXT)
        else:
            yield Record(n, line)


def _read_jsonl(fh: IO[bytes], text_field: str | None, keep: Sequence[str]) -> Iterator[Item]:
    for n, line in iter_lines(fh):
        if line is None:
            yield BadRecord(n, "invalid UTF-8")
            continue
        if not line.strip():
            continue  # blank lines between JSON objects are not records
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield BadRecord(n, f"invalid JSON: {exc.msg} at column {exc.colno}")
            continue
        if not isinstance(obj, dict):
            yield BadRecord(n, f"a JSON line must hold an object, got {type(obj).__name__}")
            continue
        name = text_field or next((c for c in TEXT_FIELD_GUESSES if c in obj), "text")
        if name not in obj:
            yield BadRecord(n, f"missing field {name!r} (fields: {sorted(obj)[:8]})")
            continue
        text = _check_text(obj[name], name, n)
        if isinstance(text, BadRecord):
            yield text
            continue
        lost = [k for k in keep if k not in obj]
        if lost:
            yield BadRecord(n, f"missing field {lost[0]!r} asked for with --keep")
            continue
        yield Record(n, text, fields={k: obj[k] for k in keep})


def _read_delimited(fh: IO[bytes], delimiter: str, text_field: str | None, keep: Sequence[str],
                    header_row: bool = True) -> Iterator[Item]:
    stream = io.TextIOWrapper(fh, encoding="utf-8-sig", errors="surrogateescape", newline="")
    reader = csv.reader(
        stream, delimiter=delimiter, quoting=csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL, strict=True
    )
    kind = "TSV" if delimiter == "\t" else "CSV"
    first: list[str] | None = None
    try:
        header = next(reader)
    except StopIteration:
        return
    except csv.Error as exc:
        raise InputError(f"the {kind}'s first row is malformed: {exc}") from None
    if not header_row:  # the columns are their positions; the first row is a record
        first, header = header, [str(i + 1) for i in range(len(header))]
        if text_field is None and len(header) != 1:
            raise InputError(f"a {kind} without a header row has columns 1..{len(header)}: name the text column by "
                             f"its position (--text-column N / text_field='N')")
        text_field = text_field or "1"
    where = f"the {kind} header" if header_row else f"the {kind} (no header row; columns by position)"
    name = pick_column(header, text_field, keep, where)
    col = {c: i for c in dict.fromkeys([name, *keep]) if (i := column_index(header, c)) is not None}
    width = "the header" if header_row else "the first row"
    if first is not None:
        item = _delimited_row(first, 1, len(header), col, name, keep, width)
        if item is not None:
            yield item
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield BadRecord(start, f"malformed {kind} row: {exc}")
            continue
        item = _delimited_row(row, start, len(header), col, name, keep, width)
        if item is not None:
            yield item


def _delimited_row(row: list[str], start: int, fields: int, col: dict[str, int], name: str, keep: Sequence[str],
                   width: str) -> Item | None:
    """One csv/tsv row as a record (``None`` for a blank line): ``fields`` columns wide as ``width`` (the header, or
    the first row of a file without one) says; ``col``: each column's index."""
    if not row or (len(row) == 1 and not row[0].strip() and fields > 1):
        return None  # blank line
    if len(row) != fields:
        return BadRecord(start, f"row has {len(row)} fields, {width} has {fields}")
    text = _check_text(row[col[name]], name, start)
    if isinstance(text, BadRecord):
        return text
    if any("\udc80" <= ch <= "\udcff" for k in keep for ch in row[col[k]]):
        return BadRecord(start, "invalid UTF-8")
    return Record(start, text, fields={k: kept_value(row[col[k]]) for k in keep})


def kept_value(cell: str) -> Any:
    """A TSV/CSV cell kept with ``keep``: the number JSON reads when the cell is a JSON number (``"1"`` -> ``1``,
    ``"2.50"`` -> ``2.5``), else the text as written (``"007"``, ``"pos"``, ``""``); see the module docstring."""
    if _JSON_NUMBER.fullmatch(cell):
        value = json.loads(cell)
        if not isinstance(value, float) or math.isfinite(value):
            return value
    return cell


def _read_batches(batches: Iterator[Any], name: str, keep: Sequence[str]) -> Iterator[Item]:
    row = 0
    for batch in batches:
        cols = batch.to_pydict()
        for i in range(batch.num_rows):
            row += 1
            text = _check_text(cols[name][i], name, row)
            if isinstance(text, BadRecord):
                yield text
            else:
                yield Record(row, text, fields={k: cols[k][i] for k in keep})


def _read_parquet(path: str | os.PathLike, text_field: str | None, keep: Sequence[str]) -> Iterator[Item]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise InputError("reading .parquet needs pyarrow: pip install pyarrow") from exc
    paths = parquet_files(path)
    files = [pq.ParquetFile(f) for f in paths]
    name = pick_column(files[0].schema_arrow.names, text_field, keep, f"the parquet file {os.fspath(paths[0])!r}")
    columns = [name, *[k for k in keep if k != name]]
    for f, pf in zip(paths[1:], files[1:]):  # every file of a directory has the columns
        pick_column(pf.schema_arrow.names, name, keep, f"the parquet file {os.fspath(f)!r}")
    yield from _read_batches((b for pf in files for b in pf.iter_batches(columns=columns, batch_size=4096)), name,
                             keep)


def read_row_groups(pf: Any, groups: Sequence[int], text_field: str | None, keep: Sequence[str],
                    name: str) -> Iterator[Item]:
    """The rows of some row groups of a ``pyarrow.parquet.ParquetFile``, numbered from 1 (a split of a parquet
    input; ``name`` names the file in errors)."""
    column = pick_column(pf.schema_arrow.names, text_field, keep, f"the parquet file {name!r}")
    columns = [column, *[k for k in keep if k != column]]
    batches = pf.iter_batches(row_groups=list(groups), columns=columns, batch_size=4096) if groups else iter(())
    yield from _read_batches(batches, column, keep)


def read_table(table: Any, text_field: str | None = None, keep: Sequence[str] = ()) -> Iterator[Item]:
    """Stream the rows of a ``pyarrow.Table`` as :class:`Record` / :class:`BadRecord`, numbered from 1.

    ``text_field`` names the text column (default ``text``, else ``sentence``); ``keep`` the columns to carry along.
    """
    name = pick_column(table.column_names, text_field, keep, "the table")
    columns = [name, *[k for k in keep if k != name]]
    yield from _read_batches(iter(table.select(columns).to_batches(max_chunksize=4096)), name, keep)


@dataclass(frozen=True)
class ReadOptions:
    """How to read an input: its format, the text column, the columns to carry along, CoNLL document context.

    Attributes:
        format: one of :data:`FORMATS`; ``None`` = from the file suffix (stdin: ``txt``).
        text_field: the column or JSON field holding the text (default ``text``, else ``sentence``).
        keep: other columns to carry into results (e.g. ``("label",)``; CoNLL: ``pos``, ``chunk``, ``ner``, ``doc``).
        context: ``"document"`` (CoNLL-2003, word level): each sentence is encoded with its neighbours from the
            same ``-DOCSTART-`` document and keeps its own words' features (the BERT paper's NER setting).
        header: csv/tsv: whether the first row names the columns (default); ``False`` (the CLI's ``--no-header``):
            every row is a record and columns are named by their 1-based positions (``text_field="2"``).
    """

    format: str | None = None
    text_field: str | None = None
    keep: tuple[str, ...] = ()
    context: str | None = None
    header: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.keep, str) or not all(isinstance(k, str) for k in self.keep):
            raise InputError(f"keep must be a list of column names, got {self.keep!r}")
        object.__setattr__(self, "keep", tuple(self.keep))
        if self.format is not None and self.format not in FORMATS:
            raise InputError(f"unknown input format {self.format!r}. Valid formats are: {', '.join(FORMATS)}")
        if self.context not in (None, "document"):
            raise InputError(f"unknown context {self.context!r}. Valid values are: document (or None)")
        if not isinstance(self.header, bool):
            raise InputError(f"header must be True or False, got {self.header!r}")
        if self.text_field is not None and not isinstance(self.text_field, str):
            raise InputError(f"text_field must be a column name or a 1-based position as a string (e.g. '2'), "
                             f"got {self.text_field!r}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what a store's manifest records about how its input was read (``header`` only when
        ``False``)."""
        said = {"format": self.format, "text_field": self.text_field, "keep": list(self.keep), "context": self.context}
        return said if self.header else {**said, "header": False}


def count_records(path: str | os.PathLike, fmt: str, header: bool = True) -> int | None:
    """A quick count of the records of a file (for a progress bar's ETA); ``None`` for stdin. ``header``: whether a
    csv/tsv file's first row is its header."""
    if os.fspath(path) == "-":
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return sum(int(pq.ParquetFile(f).metadata.num_rows) for f in parquet_files(path))
    files = corpus_files(path, fmt)
    if len(files) > 1:
        return sum(count_records(f, fmt, header) or 0 for f in files)
    n = blocks = 0
    prev_blank = True
    with open(files[0], "rb") as fh:
        for line in fh:
            blank = not line.strip()
            n += not blank
            blocks += (not blank) and prev_blank
            prev_blank = blank
    if fmt in ("conll", "conllu"):
        return blocks
    return n - 1 if fmt in ("csv", "tsv") and header and n else n


def read_records(
    path: str | os.PathLike,
    format: str | None = None,
    *,
    text_field: str | None = None,
    keep: Sequence[str] = (),
    stdin: IO[bytes] | None = None,
    document_context: bool = False,
    digest: ReadDigest | None = None,
    header: bool = True,
) -> Iterator[Item]:
    """Stream the records of ``path`` (``"-"`` = stdin) as :class:`Record` / :class:`BadRecord`.

    Args:
        path: input file, a directory of parquet files, or ``"-"`` for standard input.
        format: one of :data:`FORMATS`; default from the suffix (stdin: ``txt``).
        text_field: column holding the text (jsonl/csv/tsv/parquet); default ``text``, else ``sentence``.
        keep: other columns to carry along (CoNLL: ``pos``/``chunk``/``ner``/``doc``; CoNLL-U: ``upos``...).
        stdin: a binary stream to read instead of ``sys.stdin`` (tests).
        document_context: CoNLL-2003 only: attach neighbouring sentences of the same document as ``context``.
        digest: hash the bytes read from the file(s) into this :class:`~layerwise.corpus.watch.ReadDigest` (not
            stdin, not parquet: see :mod:`layerwise.corpus.watch`).
        header: csv/tsv: whether the first row names the columns; ``False``: columns by 1-based position.

    Raises:
        ValueError: missing file, unknown format, a header without the text or a kept column. Problems of one
            record are yielded as :class:`BadRecord` instead.
    """
    fmt = detect_format(path, format)
    keep = list(keep)
    if document_context:
        if fmt != "conll":
            raise InputError(f"document context needs CoNLL-2003 input with -DOCSTART- documents, not {fmt}")
        inner = read_records(path, fmt, keep=list(dict.fromkeys([*keep, "doc"])), stdin=stdin, digest=digest)
        for item in with_document_context(inner):
            if isinstance(item, Record) and "doc" not in keep:
                item.fields.pop("doc", None)
            yield item
        return
    if fmt == "parquet":
        if os.fspath(path) == "-":
            raise InputError("parquet cannot be read from stdin; pass the file path")
        if not Path(path).exists():
            raise InputError(f"input file {os.fspath(path)!r} does not exist")
        yield from _read_parquet(path, text_field, keep)
        return
    files = corpus_files(path, fmt)
    if len(files) > 1:  # several files read as one input: lines counted on across them
        yield from _read_files(files, fmt, text_field, keep, digest, header)
        return
    fh = digest.open(files[0]) if digest is not None and os.fspath(path) != "-" else _open_binary(files[0], stdin)
    try:
        yield from _dispatch(fh, fmt, text_field, keep, header)
    finally:
        if fh is not stdin and os.fspath(path) != "-":
            fh.close()


def _dispatch(fh: Any, fmt: str, text_field: str | None, keep: Sequence[str], header: bool = True) -> Iterator[Item]:
    if fmt == "txt":
        yield from _read_txt(fh, keep)
    elif fmt == "jsonl":
        yield from _read_jsonl(fh, text_field, keep)
    elif fmt in ("csv", "tsv"):
        yield from _read_delimited(fh, "\t" if fmt == "tsv" else ",", text_field, keep, header)
    elif fmt == "conll":
        yield from read_conll2003(fh, keep)
    else:
        yield from read_conllu(fh, keep)


def _read_files(files: Sequence[str], fmt: str, text_field: str | None, keep: Sequence[str],
                digest: ReadDigest | None, header: bool = True) -> Iterator[Item]:
    base = 0
    for f in files:
        stream = RangeStream(f, 0, os.path.getsize(f))  # counts the file's lines: the next file's start after them
        try:
            for item in _dispatch(stream, fmt, text_field, keep, header):
                item.line += base
                yield item
        finally:
            stream.close()
            if digest is not None:  # what RangeStream hashed as it read
                digest.add_file(Path(f).name, stream.sha256(), complete=stream.pos >= stream.end)
        base += stream.lines


def read_stream(fh: Any, fmt: str, reading: "ReadOptions") -> Iterator[Item]:
    """The records of a binary stream of lines (one split of a file: :mod:`layerwise.corpus.splits`) in format
    ``fmt``, read with ``reading``; lines numbered from 1 within the stream."""
    keep = list(reading.keep)
    if reading.context == "document":
        inner = _dispatch(fh, fmt, reading.text_field, list(dict.fromkeys([*keep, "doc"])))
        for item in with_document_context(inner):
            if isinstance(item, Record) and "doc" not in keep:
                item.fields.pop("doc", None)
            yield item
        return
    yield from _dispatch(fh, fmt, reading.text_field, keep, reading.header)


__all__ = [
    "CONLL2003_COLUMNS", "CONLLU_COLUMNS", "FORMATS", "BadRecord", "Item", "ReadOptions", "Record", "column_index",
    "corpus_files",
    "count_records", "detect_format", "is_glob", "kept_value", "parquet_files", "pick_column", "read_records",
    "read_row_groups", "read_stream", "read_table", "sniff_txt", "with_document_context",
]
