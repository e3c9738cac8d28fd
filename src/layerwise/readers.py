"""Streaming readers for the corpus formats users bring; a bad record never stops the read.

Every reader yields, in file order, either a :class:`Record` or a :class:`BadRecord` (line number and reason),
so the caller decides whether to skip bad records (and log them) or stop at the first (``strict``).
Nothing holds the whole file.

=============  ===========================  ===========================================================
format         file                         a record is
=============  ===========================  ===========================================================
``txt``        ``*.txt``, stdin             one non-empty line
``jsonl``      ``*.jsonl``, ``*.ndjson``    one JSON object per line; text from ``text_field``
``csv``        ``*.csv``                    one row (header row first); text from ``text_field``
``tsv``        ``*.tsv``                    one tab-separated row (header first; quotes are literal)
``parquet``    ``*.parquet``                one row; text from ``text_field``
``conll``      ``*.conll``, ``*.conll2003``  one sentence of CoNLL-2003 ``word POS chunk NER`` lines;
                                            ``-DOCSTART-`` lines start documents (``doc`` field)
``conllu``     ``*.conllu``                 one CoNLL-U sentence; multiword-token (``1-2``) and empty-node
                                            (``8.1``) lines are skipped, so words align with the tree
=============  ===========================  ===========================================================

Line numbers are 1-based lines of the file (a CoNLL sentence: its first word line; parquet: the row number).
For the CoNLL formats ``Record.words`` holds the words and ``Record.text`` is ``" ".join(words)``; per-word
columns are kept as lists: ``pos``, ``chunk``, ``ner`` (CoNLL-2003) and ``lemma``, ``upos``, ``xpos``, ``feats``,
``head``, ``deprel`` (CoNLL-U), plus ``sent_id`` and the ``# text`` comment as ``sent_text``.

Example::

    >>> from layerwise.readers import read_records
    >>> for rec in read_records("train.tsv", text_field="sentence", keep=["label"]):
    ...     print(rec.line, rec.text[:20], rec.fields)            # doctest: +SKIP
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Iterator, Sequence, Union

FORMATS = ("txt", "jsonl", "csv", "tsv", "parquet", "conll", "conllu")
_SUFFIXES = {
    ".txt": "txt", ".text": "txt", ".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".tsv": "tsv",
    ".parquet": "parquet", ".conll": "conll", ".conll2003": "conll", ".conllu": "conllu",
}
CONLL2003_COLUMNS = ("word", "pos", "chunk", "ner")
CONLLU_COLUMNS = ("id", "word", "lemma", "upos", "xpos", "feats", "head", "deprel", "deps", "misc")
TEXT_FIELD_GUESSES = ("text", "sentence")


@dataclass
class Record:
    """One input record.

    Attributes:
        line: 1-based line (parquet: row) where it starts.
        text: the text to encode (never empty).
        words: pre-tokenised words (CoNLL formats), else ``None``.
        fields: the kept columns (``keep=``), per-word lists for the CoNLL formats.
        context: with ``document_context``, the neighbouring words of the same document to encode around
            ``words`` (their features are not kept).
    """

    line: int
    text: str
    words: list[str] | None = None
    fields: dict[str, object] = field(default_factory=dict)
    context: tuple[list[str], list[str]] | None = None  # words before / after (CoNLL-2003 document context)


@dataclass
class BadRecord:
    """A record that cannot be encoded: where it is and why."""

    line: int
    reason: str


Item = Union[Record, BadRecord]


def detect_format(path: str | os.PathLike, format: str | None = None) -> str:
    """The format of ``path`` (``format`` if given, ``txt`` for stdin ``-``); ``ValueError`` lists the valid ones."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown input format {format!r}. Valid formats are: {', '.join(FORMATS)}")
        return format
    if os.fspath(path) == "-":
        return "txt"
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"cannot tell the format of {os.fspath(path)!r} from its suffix {suffix!r}; pass the format "
            f"(--format / format=) as one of: {', '.join(FORMATS)}"
        )
    return _SUFFIXES[suffix]


def _open_binary(path: str | os.PathLike, stdin: IO[bytes] | None) -> IO[bytes]:
    if os.fspath(path) == "-":
        return stdin if stdin is not None else sys.stdin.buffer
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"input file {os.fspath(path)!r} does not exist (or is not a file)")
    return open(p, "rb")


def _lines(fh: IO[bytes]) -> Iterator[tuple[int, str | None]]:
    """``(line number, decoded line without newline)``; ``None`` when the line is not valid UTF-8."""
    for n, raw in enumerate(fh, start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            yield n, None
            continue
        if n == 1:
            line = line.lstrip("\ufeff")
        yield n, line.rstrip("\r\n")


def _check_text(value: object, name: str, line: int) -> Item | str:
    if value is None:
        return BadRecord(line, f"missing value for text field {name!r}")
    if not isinstance(value, str):
        return BadRecord(line, f"text field {name!r} is not a string ({type(value).__name__}: {value!r:.40})")
    if not value.strip():
        return BadRecord(line, "empty text (nothing left after stripping whitespace)")
    if any("\udc80" <= ch <= "\udcff" for ch in value):
        return BadRecord(line, "invalid UTF-8")
    return value


def _pick_column(columns: Sequence[str], wanted: str | None, keep: Sequence[str], where: str) -> str:
    if wanted is None:
        wanted = next((c for c in TEXT_FIELD_GUESSES if c in columns), None)
        if wanted is None:
            raise ValueError(
                f"{where} has no 'text' or 'sentence' column; its columns are {list(columns)}: name the text "
                f"column with --text-column / text_field="
            )
    missing = [c for c in [wanted, *keep] if c not in columns]
    if missing:
        raise ValueError(f"{where} has no column {missing[0]!r}; its columns are {list(columns)}")
    return wanted


def _read_txt(fh: IO[bytes], keep: Sequence[str]) -> Iterator[Item]:
    if keep:
        raise ValueError(f"--keep {list(keep)} needs columns; a .txt input has only the text (one per line)")
    for n, line in _lines(fh):
        if line is None:
            yield BadRecord(n, "invalid UTF-8")
        elif not line.strip():
            yield BadRecord(n, "empty text (nothing left after stripping whitespace)")
        else:
            yield Record(n, line)


def _read_jsonl(fh: IO[bytes], text_field: str | None, keep: Sequence[str]) -> Iterator[Item]:
    for n, line in _lines(fh):
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


def _read_delimited(fh: IO[bytes], delimiter: str, text_field: str | None, keep: Sequence[str]) -> Iterator[Item]:
    stream = io.TextIOWrapper(fh, encoding="utf-8-sig", errors="surrogateescape", newline="")
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    reader = csv.reader(stream, delimiter=delimiter, quoting=quoting, strict=True)
    try:
        header = next(reader)
    except StopIteration:
        return
    kind = "TSV" if delimiter == "\t" else "CSV"
    name = _pick_column(header, text_field, keep, f"the {kind} header")
    col = {c: i for i, c in enumerate(header)}
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            yield BadRecord(start, f"malformed {kind} row: {exc}")
            continue
        if not row or (len(row) == 1 and not row[0].strip() and len(header) > 1):
            continue  # blank line
        if len(row) != len(header):
            yield BadRecord(start, f"row has {len(row)} fields, the header has {len(header)}")
            continue
        text = _check_text(row[col[name]], name, start)
        if isinstance(text, BadRecord):
            yield text
            continue
        values = {k: row[col[k]] for k in keep}
        if any("\udc80" <= ch <= "\udcff" for v in values.values() for ch in v):
            yield BadRecord(start, "invalid UTF-8")
            continue
        yield Record(start, text, fields=values)


def _read_parquet(path: str | os.PathLike, text_field: str | None, keep: Sequence[str]) -> Iterator[Item]:
    try:
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise ValueError("reading .parquet needs pyarrow: pip install pyarrow") from exc
    pf = pq.ParquetFile(path)
    name = _pick_column(pf.schema_arrow.names, text_field, keep, f"the parquet file {os.fspath(path)!r}")
    row = 0
    for batch in pf.iter_batches(columns=[name, *[k for k in keep if k != name]], batch_size=4096):
        cols = batch.to_pydict()
        for i in range(batch.num_rows):
            row += 1
            text = _check_text(cols[name][i], name, row)
            if isinstance(text, BadRecord):
                yield text
            else:
                yield Record(row, text, fields={k: cols[k][i] for k in keep})


def _sentences(fh: IO[bytes]) -> Iterator[tuple[int, list[tuple[int, str]] | BadRecord]]:
    """Blank-line separated blocks of ``(line number, line)``; a block with invalid UTF-8 is a BadRecord."""
    block: list[tuple[int, str]] = []
    bad: BadRecord | None = None
    for n, line in _lines(fh):
        if line is None:
            bad = bad or BadRecord(n, "invalid UTF-8")
            block.append((n, ""))
            continue
        if line.strip():
            block.append((n, line))
            continue
        if block:
            yield block[0][0], bad or block
        block, bad = [], None
    if block:
        yield block[0][0], bad or block


def _read_conll2003(fh: IO[bytes], keep: Sequence[str]) -> Iterator[Item]:
    allowed = set(CONLL2003_COLUMNS[1:]) | {"doc"}
    unknown = [k for k in keep if k not in allowed]
    if unknown:
        raise ValueError(f"--keep {unknown[0]!r} is not a CoNLL-2003 column. Valid columns are: pos, chunk, ner, doc")
    doc = 0
    seen_docstart = False
    for start, block in _sentences(fh):
        if isinstance(block, BadRecord):
            yield block
            continue
        if block[0][1].startswith("-DOCSTART-"):
            doc += 1 if seen_docstart else 0
            seen_docstart = True
            block = block[1:]
            if not block:
                continue
            start = block[0][0]
        rows = [line.split() for _, line in block]
        width = len(rows[0])
        odd = next(((n, r) for (n, _), r in zip(block, rows) if len(r) != width), None)
        if odd is not None:
            yield BadRecord(odd[0], f"line has {len(odd[1])} columns, the sentence's first line has {width}")
            continue
        if any(r[0].startswith("-DOCSTART-") for r in rows):
            n = next(n for (n, _), r in zip(block, rows) if r[0].startswith("-DOCSTART-"))
            yield BadRecord(n, "-DOCSTART- inside a sentence (a blank line must separate it)")
            continue
        cols = list(zip(*rows))
        fields: dict[str, object] = {}
        for k in keep:
            if k == "doc":
                fields["doc"] = doc
                continue
            idx = CONLL2003_COLUMNS.index(k) if width == 4 else {"pos": 1, "chunk": width - 2, "ner": width - 1}[k]
            if idx >= width or width < 2:
                yield BadRecord(start, f"sentence has {width} columns, no {k!r} column")
                break
            fields[k] = list(cols[idx])
        else:
            words = list(cols[0])
            yield Record(start, " ".join(words), words=words, fields=fields)


def with_document_context(items: Iterator[Item], max_words: int = 250) -> Iterator[Item]:
    """Give each CoNLL-2003 sentence its neighbours from the same document as context (BERT paper, section 5.3).

    Sentences of one document (same ``doc`` field) are buffered; each gets the nearest previous and next sentences,
    alternately, while the total stays within ``max_words`` words (so the window fits the model). Bad records pass
    through in order.
    """
    doc: list[Item] = []
    current = None

    def flush():
        good = [r for r in doc if isinstance(r, Record)]
        where = {id(r): i for i, r in enumerate(good)}
        for item in doc:
            if isinstance(item, Record):
                i = where[id(item)]
                left: list[str] = []
                right: list[str] = []
                total, lo, hi = len(item.words), i - 1, i + 1
                while lo >= 0 or hi < len(good):
                    grew = False
                    if lo >= 0 and total + len(good[lo].words) <= max_words:
                        left = good[lo].words + left
                        total += len(good[lo].words)
                        lo -= 1
                        grew = True
                    if hi < len(good) and total + len(good[hi].words) <= max_words:
                        right = right + good[hi].words
                        total += len(good[hi].words)
                        hi += 1
                        grew = True
                    if not grew:
                        break
                item.context = (left, right)
            yield item

    for item in items:
        d = item.fields.get("doc") if isinstance(item, Record) else current
        if d != current and doc:
            yield from flush()
            doc = []
        current = d
        doc.append(item)
    if doc:
        yield from flush()


def _read_conllu(fh: IO[bytes], keep: Sequence[str]) -> Iterator[Item]:
    allowed = set(CONLLU_COLUMNS[2:]) | {"sent_id", "sent_text"}
    unknown = [k for k in keep if k not in allowed]
    if unknown:
        raise ValueError(f"--keep {unknown[0]!r} is not a CoNLL-U column. Valid columns are: {', '.join(sorted(allowed))}")
    for start, block in _sentences(fh):
        if isinstance(block, BadRecord):
            yield block
            continue
        meta: dict[str, str] = {}
        rows: list[list[str]] = []
        bad = None
        for n, line in block:
            if line.startswith("#"):
                key, _, value = line[1:].partition("=")
                meta[key.strip()] = value.strip()
                continue
            cells = line.split("\t")
            if len(cells) != 10:
                bad = BadRecord(n, f"CoNLL-U word line has {len(cells)} tab-separated columns, expected 10")
                break
            if "-" in cells[0] or "." in cells[0]:
                continue  # multiword token range or empty node: not a word of the tree
            rows.append(cells)
        if bad is not None:
            yield bad
            continue
        if not rows:
            yield BadRecord(start, "sentence without word lines")
            continue
        first = next(n for n, line in block if not line.startswith("#"))
        cols = dict(zip(CONLLU_COLUMNS, zip(*rows)))
        fields: dict[str, object] = {}
        for k in keep:
            if k == "sent_id":
                fields[k] = meta.get("sent_id")
            elif k == "sent_text":
                fields[k] = meta.get("text")
            elif k == "head":
                fields[k] = [int(h) if h.isdigit() else -1 for h in cols["head"]]
            else:
                fields[k] = list(cols[k])
        words = list(cols["word"])
        yield Record(first, " ".join(words), words=words, fields=fields)


def read_records(
    path: str | os.PathLike,
    format: str | None = None,
    *,
    text_field: str | None = None,
    keep: Sequence[str] = (),
    stdin: IO[bytes] | None = None,
    document_context: bool = False,
) -> Iterator[Item]:
    """Stream the records of ``path`` (``"-"`` = stdin) as :class:`Record` / :class:`BadRecord`.

    Args:
        path: input file, or ``"-"`` for standard input.
        format: one of :data:`FORMATS`; default from the suffix (stdin: ``txt``).
        text_field: column holding the text (jsonl/csv/tsv/parquet); default ``text``, else ``sentence``.
        keep: other columns to carry along (CoNLL: ``pos``/``chunk``/``ner``/``doc``; CoNLL-U: ``upos``...).
        stdin: a binary stream to read instead of ``sys.stdin`` (tests).
        document_context: CoNLL-2003 only: attach neighbouring sentences of the same document as ``context``.

    Raises:
        ValueError: missing file, unknown format, a header without the text or a kept column. Problems of one
            record are yielded as :class:`BadRecord` instead.
    """
    fmt = detect_format(path, format)
    keep = list(keep)
    if document_context:
        if fmt != "conll":
            raise ValueError(f"document context needs CoNLL-2003 input with -DOCSTART- documents, not {fmt}")
        inner = read_records(path, fmt, keep=list(dict.fromkeys([*keep, "doc"])), stdin=stdin)
        for item in with_document_context(inner):
            if isinstance(item, Record) and "doc" not in keep:
                item.fields.pop("doc", None)
            yield item
        return
    if fmt == "parquet":
        if os.fspath(path) == "-":
            raise ValueError("parquet cannot be read from stdin; pass the file path")
        if not Path(path).is_file():
            raise ValueError(f"input file {os.fspath(path)!r} does not exist (or is not a file)")
        yield from _read_parquet(path, text_field, keep)
        return
    fh = _open_binary(path, stdin)
    try:
        if fmt == "txt":
            yield from _read_txt(fh, keep)
        elif fmt == "jsonl":
            yield from _read_jsonl(fh, text_field, keep)
        elif fmt in ("csv", "tsv"):
            yield from _read_delimited(fh, "\t" if fmt == "tsv" else ",", text_field, keep)
        elif fmt == "conll":
            yield from _read_conll2003(fh, keep)
        else:
            yield from _read_conllu(fh, keep)
    finally:
        if fh is not stdin and os.fspath(path) != "-":
            fh.close()
