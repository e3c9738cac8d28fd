"""Splitting an input into parts that are read independently, in parallel, without a serial pass over the input.

:func:`plan_splits` cuts a :class:`~layerwise.corpus.sources.Source` into :class:`Split` s from what the file system
and the file footers say, never from the records themselves:

==================================  ===============================================================================
input                               splits
==================================  ===============================================================================
one ``txt`` / ``jsonl`` file        byte ranges of about ``records`` records each (the record size estimated from
                                    the first 64 KiB), each starting at the first line start at or after its offset
several files (a directory, a       each file on its own (and a large ``txt`` / ``jsonl`` file cut in byte ranges);
glob)                               ``csv``, CoNLL-2003 and CoNLL-U files whole, so a quoted field or a document is
                                    never cut
parquet files                       runs of row groups of about ``records`` rows (row counts from the footers)
a table in memory                   row slices of ``records`` rows
==================================  ===============================================================================

A split is read by :func:`read_split`, which numbers its records' lines from 1 within the split and counts the
lines (or rows) it covers. A record's line in the whole input is the line count of every split before its own plus
its line in the split, the numbering a sequential read of the same input gives (lines counted on across files);
the count of the splits before is known only after they are read, so the store that holds the parts adds it when
it is opened (:mod:`layerwise.store.reader`). Planning reads one footer per parquet file and 64 KiB of the first
text file: a directory of 1,000 files or one 10 GB file plans in well under a second.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from ..errors import InputError
from .records import Item, RangeStream

SAMPLE_BYTES = 64 << 10
BYTE_RANGE_FORMATS = ("txt", "jsonl")  # formats whose records never span a line break


@dataclass(frozen=True)
class Split:
    """One independently readable part of an input.

    Attributes:
        file: index of the file in the input's files (0 for a single file or a table).
        path: the file (``None`` for a table in memory).
        unit: ``bytes`` (``start``/``end`` are byte offsets), ``row_groups`` (parquet row groups) or ``rows``.
        start, end: the half-open range in ``unit``; a ``bytes`` range holds the lines that start in it.
    """

    file: int
    path: str | None
    unit: str
    start: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: what a part store records about its split."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Split":
        """The split :meth:`to_dict` wrote."""
        return cls(**{k: data[k] for k in ("file", "path", "unit", "start", "end")})


def _records_per_byte(path: str, fmt: str) -> float:
    """Records per byte in the first :data:`SAMPLE_BYTES` of ``path`` (blank lines are not records)."""
    with open(path, "rb") as fh:
        sample = fh.read(SAMPLE_BYTES)
    if not sample:
        return 1.0
    if len(sample) == SAMPLE_BYTES and b"\n" in sample:
        sample = sample[: sample.rindex(b"\n") + 1]
    records = sum(1 for line in sample.split(b"\n") if line.strip())
    return max(records, 1) / len(sample)


def _byte_splits(file: int, path: str, size: int, target: int) -> list[Split]:
    n = max(1, math.ceil(size / max(target, 1)))
    bounds = [size * i // n for i in range(n + 1)]
    return [Split(file, path, "bytes", a, b) for a, b in zip(bounds, bounds[1:])]


def plan_splits(source: Any, files: list[str], records: int) -> list[Split]:
    """The splits of ``source`` (its ``files``, from :func:`~layerwise.corpus.readers.corpus_files`) of about
    ``records`` records each, in input order (see the module docstring)."""
    if records < 1:
        raise InputError(f"records per split must be a positive int, got {records!r}")
    if source.fmt == "table":
        rows = int(source.table().num_rows)
        return [Split(0, None, "rows", a, min(rows, a + records)) for a in range(0, max(rows, 1), records)]
    if source.fmt == "parquet":
        import pyarrow.parquet as pq

        out: list[Split] = []
        for i, path in enumerate(files):
            meta = pq.read_metadata(path)
            start, rows = 0, 0
            for g in range(meta.num_row_groups):
                rows += meta.row_group(g).num_rows
                if rows >= records:
                    out.append(Split(i, path, "row_groups", start, g + 1))
                    start, rows = g + 1, 0
            if start < meta.num_row_groups or meta.num_row_groups == 0:
                out.append(Split(i, path, "row_groups", start, meta.num_row_groups))
        return out
    if source.fmt not in BYTE_RANGE_FORMATS:
        return [Split(i, path, "bytes", 0, os.path.getsize(path)) for i, path in enumerate(files)]
    target = int(records / _records_per_byte(files[0], source.fmt))
    out = []
    for i, path in enumerate(files):
        out.extend(_byte_splits(i, path, os.path.getsize(path), target))
    return out


class _CountingRaw(io.RawIOBase):
    """A whole file read as raw bytes, counting its lines and hashing its bytes as they pass (for readers that need a
    real file object: csv's text wrapper)."""

    def __init__(self, path: str):
        self.fh = open(path, "rb")
        self.newlines, self.last, self.size, self.hash = 0, b"\n", 0, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self.fh.readinto(buffer)
        if n:
            chunk = bytes(memoryview(buffer)[:n])
            self.newlines += chunk.count(b"\n")
            self.last, self.size = chunk[-1:], self.size + n
            self.hash.update(chunk)
        return n or 0

    def close(self) -> None:
        self.fh.close()
        super().close()

    @property
    def lines(self) -> int:
        """Lines read so far (a last line without a newline counts)."""
        return self.newlines + (1 if self.size and self.last != b"\n" else 0)


class SplitReader:
    """The records of one split (:meth:`items`, lines numbered from 1 within the split); once they are read,
    ``lines`` is how many lines (rows) the split covers and ``sha256`` the hash of its bytes (``None`` for rows)."""

    def __init__(self, source: Any, split: Split, reading: Any):
        self.source, self.split, self.reading = source, split, reading
        self.lines = 0
        self.sha256: str | None = None

    def items(self) -> Iterator[Item]:
        """The split's records and bad records, in order."""
        from .readers import read_stream, read_table

        s, reading = self.split, self.reading
        if s.unit == "rows":
            table = self.source.table().slice(s.start, s.end - s.start)
            self.lines = int(table.num_rows)
            yield from read_table(table, reading.text_field, reading.keep)
            return
        if s.unit == "row_groups":
            import pyarrow.parquet as pq

            from .readers import read_row_groups

            pf = pq.ParquetFile(s.path)
            groups = list(range(s.start, s.end))
            self.lines = sum(pf.metadata.row_group(g).num_rows for g in groups)
            yield from read_row_groups(pf, groups, reading.text_field, reading.keep, str(s.path))
            return
        if self.source.fmt not in BYTE_RANGE_FORMATS:  # a whole file (csv needs a real file object)
            raw = _CountingRaw(str(s.path))
            try:
                yield from read_stream(io.BufferedReader(raw), self.source.fmt, reading)
            finally:
                raw.close()
            self.lines, self.sha256 = raw.lines, raw.hash.hexdigest()
            return
        stream = RangeStream(str(s.path), s.start, s.end)
        try:
            yield from read_stream(stream, self.source.fmt, reading)
        finally:
            stream.close()
        self.lines, self.sha256 = stream.lines, stream.sha256()


def read_split(source: Any, split: Split, reading: Any) -> SplitReader:
    """A :class:`SplitReader` for ``split`` of ``source`` read with ``reading`` (:class:`ReadOptions`)."""
    return SplitReader(source, split, reading)


__all__ = ["BYTE_RANGE_FORMATS", "Split", "SplitReader", "plan_splits", "read_split"]
