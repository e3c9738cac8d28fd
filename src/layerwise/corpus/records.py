"""Record types shared by the corpus readers (a record to encode, or a bad record with its line and reason) and the
line streams they read: every line of a file, or the lines that start in a byte range, counted and hashed."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import IO, Iterator, Union

EMPTY_TEXT = "empty text (nothing left after stripping whitespace)"
# a character that str.strip() keeps (an ECMA/Python regex class): a text holding one is not blank; JSON schemas say
# the rule with it (tests/test_encode_shared.py checks it against str.isspace over every code point)
NON_BLANK = "[^\\t\\n\\x0b\\x0c\\r\\x1c-\\x1f \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000]"


def is_blank(text: str) -> bool:
    """Whether ``text`` is empty once whitespace is stripped: a bad record for ``layerwise extract``, a refused input
    for the service."""
    return not text.strip()


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


def iter_lines(fh: IO[bytes]) -> Iterator[tuple[int, str | None]]:
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


class RangeStream:
    """A binary stream of the lines of ``path`` that start in ``[start, end)``, counting them and hashing their
    bytes (``lines``, ``sha256()``). The line holding byte ``start - 1`` belongs to the split before."""

    def __init__(self, path: str, start: int, end: int):
        self.fh: IO[bytes] = open(path, "rb")
        self.end, self.lines, self.hash = end, 0, hashlib.sha256()
        if start > 0:
            self.fh.seek(start - 1)
            self.fh.readline()  # the rest of the line that started before this split
        self.pos = self.fh.tell()

    def __iter__(self) -> Iterator[bytes]:
        while self.pos < self.end:
            line = self.fh.readline()
            if not line:
                return
            self.pos += len(line)
            self.lines += 1
            self.hash.update(line)
            yield line

    def close(self) -> None:
        """Close the file."""
        self.fh.close()

    def sha256(self) -> str:
        """sha256 of the bytes read so far (the split's whole range once it is read to the end)."""
        return self.hash.hexdigest()
