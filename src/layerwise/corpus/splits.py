"""Splitting an input into parts that are read independently, in parallel, without a serial pass over the input.

:func:`plan_splits` cuts a :class:`~layerwise.corpus.sources.Source` into :class:`Split` s from what the file system
and the file footers say, never from the records themselves:

==================================  ===============================================================================
input                               splits
==================================  ===============================================================================
one ``txt`` / ``jsonl`` file        byte ranges of about ``records`` records each (the record size estimated from
                                    the first 64 KiB), each starting at the first line start at or after its offset
one ``csv`` / ``tsv`` file          byte ranges of ``records`` rows each, cut where the csv reader ends a row (a
                                    quoted field holding newlines is never cut): the one format planned by reading
                                    it, one pass of the csv reader (:func:`csv_row_starts`); every split after the
                                    first is read after the file's header row
several files (a directory, a       each file on its own (and each large ``txt`` / ``jsonl`` / ``csv`` / ``tsv``
glob)                               file cut as above); CoNLL-2003 and CoNLL-U files whole, so a document is never
                                    cut
parquet files                       runs of row groups of about ``records`` rows (row counts from the footers)
a table in memory                   row slices of ``records`` rows
==================================  ===============================================================================

A split is read by :func:`read_split`, which numbers its records' lines from 1 within the split and counts the
lines (or rows) it covers. A record's line in the whole input is the line count of every split before its own plus
its line in the split, the numbering a sequential read of the same input gives (lines counted on across files);
the count of the splits before is known only after they are read, so the store that holds the parts adds it when
it is opened (:mod:`layerwise.store.reader`). Planning reads one footer per parquet file and 64 KiB of the first
text file: a directory of 1,000 files or one 10 GB txt file plans in well under a second. A csv/tsv file is read
once by the planner (the csv reader's speed, tens of MB/s), since only that reader knows where a row ends.
"""

from __future__ import annotations

import csv
import hashlib
import io
import math
import os
from dataclasses import asdict, dataclass, replace
from typing import IO, Any, Iterator

from ..errors import InputError
from .records import Item, RangeStream

SAMPLE_BYTES = 64 << 10
BYTE_RANGE_FORMATS = ("txt", "jsonl")  # formats whose records never span a line break
ROW_FORMATS = ("csv", "tsv")  # formats cut where the csv reader ends a row, each split read after the header


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


def _byte_lines(fh: IO[bytes], counter: list[int]) -> Iterator[str]:
    """The lines of a binary file decoded as the csv readers decode them, adding each line's bytes to ``counter[0]``
    as it is handed out (so after a row, ``counter[0]`` is the offset of the next row's first byte)."""
    first = True
    for raw in fh:
        counter[0] += len(raw)
        line = raw.decode("utf-8", "surrogateescape")
        if first:
            line, first = line.lstrip("\ufeff"), False
        yield line


def _csv_reader(lines: Iterator[str], fmt: str) -> Any:
    """The csv reader the ``csv``/``tsv`` format reads rows with (:mod:`layerwise.corpus.readers`), over ``lines``."""
    return csv.reader(lines, delimiter="\t" if fmt == "tsv" else ",",
                      quoting=csv.QUOTE_NONE if fmt == "tsv" else csv.QUOTE_MINIMAL, strict=True)


def csv_row_starts(path: str, fmt: str, every: int, header: bool = True) -> tuple[int, list[int]]:
    """One pass of the csv reader over a ``csv``/``tsv`` file: the byte offset where its header row ends, and the
    offsets where every ``every``-th row after it starts (rows the reader ends, so a quoted field holding newlines
    is never cut; a malformed row counts as one). The reader asks for one line at a time and returns a row only
    at the end of a line outside quotes, so the bytes handed out when it returns are exactly the rows read.
    ``header=False``: the file has no header row (its end is 0; the first row is a record)."""
    counter = [0]
    with open(path, "rb") as fh:
        reader = _csv_reader(_byte_lines(fh, counter), fmt)
        starts: list[int] = []
        try:
            if header:
                next(reader)
        except StopIteration:
            return counter[0], starts
        except csv.Error:
            pass  # a malformed header: the reader of the first split names it
        header_end, rows = counter[0], 0
        while True:
            try:
                next(reader)
            except StopIteration:
                break
            except csv.Error:
                pass  # a malformed row is a bad record of its split; it still ends where the reader stopped
            rows += 1
            if rows % every == 0:
                starts.append(counter[0])
    size = os.path.getsize(path)
    return header_end, [s for s in starts if s < size]


def csv_header(path: str, fmt: str) -> bytes:
    """The bytes of a ``csv``/``tsv`` file's header row (its first row, as the csv reader ends it)."""
    counter = [0]
    with open(path, "rb") as fh:
        try:
            next(_csv_reader(_byte_lines(fh, counter), fmt))
        except (StopIteration, csv.Error):
            pass
        fh.seek(0)
        return fh.read(counter[0])


def _row_splits(file: int, path: str, fmt: str, records: int, header: bool = True) -> list[Split]:
    header_end, starts = csv_row_starts(path, fmt, records, header)
    bounds = [0, *starts, os.path.getsize(path)]
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
    if source.fmt in ROW_FORMATS:
        return [split for i, path in enumerate(files)
                for split in _row_splits(i, path, source.fmt, records, source.header)]
    if source.fmt not in BYTE_RANGE_FORMATS:
        return [Split(i, path, "bytes", 0, os.path.getsize(path)) for i, path in enumerate(files)]
    target = int(records / _records_per_byte(files[0], source.fmt))
    out = []
    for i, path in enumerate(files):
        out.extend(_byte_splits(i, path, os.path.getsize(path), target))
    return out


def uncut_reason(source: Any, files: list[str], records: int) -> str | None:
    """Why some parts of :func:`plan_splits` may hold more than ``records`` records, in one line, or ``None``: CoNLL
    files are read whole (a document is never cut), and a parquet row group is never split."""
    if source.fmt in ("conll", "conllu"):
        return (f"{source.fmt} files are read whole, so a document is never cut: each of the {len(files):,} files is "
                f"one part, whatever its size (part_records={records:,} applies to txt, jsonl, csv, tsv and parquet)")
    if source.fmt == "parquet":
        import pyarrow.parquet as pq

        metas = [pq.read_metadata(path) for path in files]
        largest = max((m.row_group(g).num_rows for m in metas for g in range(m.num_row_groups)), default=0)
        if largest > records:
            return (f"a parquet row group is never split: row groups of up to {largest:,} rows make parts larger "
                    f"than part_records={records:,} (write the files with smaller row groups, e.g. "
                    f"pyarrow.parquet.write_table(..., row_group_size={records:,}), to cut them finer)")
    return None


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
        if self.source.fmt in ROW_FORMATS:
            yield from self._rows(s)
            return
        if self.source.fmt not in BYTE_RANGE_FORMATS:  # a whole file (CoNLL: documents are never cut)
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


    def _rows(self, s: Split) -> Iterator[Item]:
        """A ``csv``/``tsv`` split: its rows read after the file's header row (the split's lines numbered without
        the header's, which belongs to the first split)."""
        from .readers import read_stream

        header = b""
        if s.start > 0 and self.reading.header:
            header = csv_header(str(s.path), self.source.fmt)
        skip = header.count(b"\n")
        raw = _PrefixedRange(header, RangeStream(str(s.path), s.start, s.end))
        try:
            for item in read_stream(io.BufferedReader(raw), self.source.fmt, self.reading):
                yield replace(item, line=item.line - skip) if skip else item
        finally:
            raw.close()
        self.lines, self.sha256 = raw.range.lines, raw.range.sha256()


class _PrefixedRange(io.RawIOBase):
    """``prefix`` (a header row, not counted) then the lines of a :class:`RangeStream`, as a raw binary file (the csv
    reader needs a real file object)."""

    def __init__(self, prefix: bytes, rng: RangeStream):
        self.pending, self.range, self.lines_iter = prefix, rng, iter(rng)

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self.pending:
            line = next(self.lines_iter, None)
            if line is None:
                return 0
            self.pending = line
        n = min(len(buffer), len(self.pending))
        buffer[:n] = self.pending[:n]
        self.pending = self.pending[n:]
        return n

    def close(self) -> None:
        self.range.close()
        super().close()


def read_split(source: Any, split: Split, reading: Any) -> SplitReader:
    """A :class:`SplitReader` for ``split`` of ``source`` read with ``reading`` (:class:`ReadOptions`)."""
    return SplitReader(source, split, reading)


__all__ = ["BYTE_RANGE_FORMATS", "ROW_FORMATS", "Split", "SplitReader", "csv_header", "csv_row_starts", "plan_splits",
           "read_split", "uncut_reason"]
