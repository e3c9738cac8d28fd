"""Record types shared by the corpus readers: a record to encode, or a bad record with its line and reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Iterator, Union


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
