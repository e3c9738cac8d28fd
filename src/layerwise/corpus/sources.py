"""Where an extraction's records come from, as one :class:`Source`: a corpus file, stdin, a directory of parquet
files, or a table in memory (a Hugging Face ``datasets.Dataset`` or a ``pyarrow.Table``).

A source names the input in messages, counts its records (for a progress bar), says what a store's manifest records
about it (its ``input`` section: path, format and the sha256 of its content, which a resume compares) and yields its
records (:class:`~layerwise.corpus.readers.Record` / :class:`~layerwise.corpus.readers.BadRecord`) numbered from 1:
lines of text
files, rows of tables and parquet files (so ``store.lines - 1`` are a dataset's row indices).

A table's sha256 is over its schema and the values of the columns read (:func:`~layerwise.provenance.table_sha256`),
so the same rows give the same hash however they are chunked or wherever they were loaded from; a parquet
directory's is over its files' names and bytes. A ``datasets.Dataset`` is read through its Arrow table (with any
``select``/``shuffle`` applied), keeps its row order, and stays a ``Dataset`` when a source is pickled (memory-mapped
datasets travel to Ray workers as file references).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import IO, Any, Iterator

from ..errors import InputError
from ..provenance import input_sha256, table_sha256
from .readers import (
    Item,
    ReadOptions,
    corpus_files,
    count_records,
    detect_format,
    is_glob,
    pick_column,
    read_records,
    read_table,
)
from .watch import ReadDigest

TABLE_FORMAT = "table"  # the manifest's input.format for tables in memory


def _as_table(data: Any) -> Any | None:
    """A ``pyarrow.Table`` for a table input (``datasets.Dataset`` / ``pyarrow.Table``), ``None`` for a path."""
    if isinstance(data, (str, os.PathLike)):
        return None
    module = type(data).__module__.split(".")[0]
    kind = type(data).__name__
    if module == "pyarrow" and kind == "Table":
        return data
    if module == "datasets":
        if kind == "Dataset":
            return data.with_format("arrow")[:]
        if kind in ("DatasetDict", "IterableDatasetDict"):
            raise TypeError(f"input is a datasets.{kind} with splits {list(data)}; pick one, e.g. data['train']")
        if kind == "IterableDataset":
            raise TypeError(
                "input is a streaming datasets.IterableDataset, which has no length or content hash to resume by; "
                "load it without streaming=True, or write it to parquet first (data.to_parquet(...) per shard)"
            )
    raise TypeError(
        f"input must be a file path, '-' (stdin), a directory of parquet files, a datasets.Dataset or a "
        f"pyarrow.Table; got {type(data).__module__}.{kind}. To encode records held in a list use "
        f"Extractor.stream(records, spec) (or Extractor.encode(texts)), or write them to a .txt/.jsonl file first"
    )


@dataclass
class Source:
    """One input of an extraction.

    Attributes:
        data: the path (``"-"`` for stdin) or the table object as given.
        fmt: one of :data:`layerwise.corpus.readers.FORMATS`, or ``"table"``.
        name: what messages call it (the path, ``-``, or ``a datasets.Dataset of 3,000 rows``).
        header: csv/tsv: whether the first row names the columns (:attr:`ReadOptions.header`).
    """

    data: Any
    fmt: str
    name: str
    header: bool = True

    @property
    def hashed_as_read(self) -> bool:
        """Its bytes can be hashed as they are read (a text file, or several): not stdin (hashed apart), parquet
        (read by seeking) or a table."""
        return self.fmt not in (TABLE_FORMAT, "parquet") and not self.is_stdin

    @property
    def is_stdin(self) -> bool:
        """The input is standard input (read once, hashed as it streams)."""
        return self.fmt != TABLE_FORMAT and os.fspath(self.data) == "-"

    def table(self) -> Any:
        """The ``pyarrow.Table`` of a table input."""
        return _as_table(self.data)

    def identity(self, reading: ReadOptions, *, quick: bool = False) -> dict[str, Any]:
        """The manifest's ``input`` section: how it was read, where from, and its content's sha256.

        ``quick``: files are named by their names, sizes and modification times (``files``, ``bytes``,
        ``stat_sha256``) instead of a read of every byte, for a parallel run whose parts hash their own bytes.
        """
        info: dict[str, Any] = {**reading.to_dict(), "format": self.fmt}
        if quick and self.fmt != TABLE_FORMAT and not self.is_stdin:
            h, total, files = hashlib.sha256(), 0, self.files()
            for f in files:
                st = os.stat(f)
                total += st.st_size
                h.update(f"{os.path.basename(f)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
            info.update(path=os.path.abspath(self.data), files=len(files), bytes=total, stat_sha256=h.hexdigest())
            return info
        if self.fmt == TABLE_FORMAT:
            table = self.table()
            text = pick_column(table.column_names, reading.text_field, reading.keep, "the table")
            columns = [text, *[k for k in reading.keep if k != text]]
            info.update(path=None, kind=type(self.data).__name__, rows=table.num_rows,
                        sha256=table_sha256(table.select(columns)))
        elif self.is_stdin:
            info.update(path="-", sha256=None)
        else:
            info.update(path=os.path.abspath(self.data), sha256=input_sha256(self.data))
        return info

    def records(self, reading: ReadOptions, stdin: IO[bytes] | None = None,
                digest: ReadDigest | None = None) -> Iterator[Item]:
        """The records in input order (``stdin``: the stream to read for ``"-"``; ``digest``: hash the bytes read
        from files, see :mod:`layerwise.corpus.watch`)."""
        if self.fmt == TABLE_FORMAT:
            if reading.context is not None:
                raise InputError("context='document' needs a CoNLL-2003 file, not a table")
            return read_table(self.table(), reading.text_field, reading.keep)
        return read_records(self.data, self.fmt, text_field=reading.text_field, keep=reading.keep, stdin=stdin,
                            document_context=reading.context == "document", digest=digest, header=reading.header)

    def files(self) -> list[str]:
        """The files read, in order (one for a file, a directory's or a pattern's files; none for a table)."""
        if self.fmt == TABLE_FORMAT:
            return []
        return corpus_files(self.data, self.fmt)

    def count(self) -> int | None:
        """How many records (rows, lines, sentences) it has; ``None`` for stdin."""
        if self.fmt == TABLE_FORMAT:
            return int(self.table().num_rows)
        return None if self.is_stdin else count_records(self.data, self.fmt, self.header)


def open_source(data: Any, reading: ReadOptions | None = None) -> Source:
    """The :class:`Source` for ``data``: a path (file, parquet directory, ``"-"``), a ``datasets.Dataset`` or a
    ``pyarrow.Table``.

    Raises:
        TypeError: ``data`` is none of these (a list of texts, a ``DatasetDict``, a streaming dataset).
        ValueError: a missing file, an unknown format, a directory without parquet files.
    """
    reading = reading or ReadOptions()
    table = _as_table(data)
    if table is not None:
        if reading.format is not None:
            raise InputError(f"a {type(data).__name__} input is read as a table, not as {reading.format!r}: leave "
                             f"the format out")
        return Source(data, TABLE_FORMAT, f"a {type(data).__name__} of {table.num_rows:,} rows")
    path = os.fspath(data)
    fmt = detect_format(path, reading.format)
    if path != "-" and not os.path.exists(path) and not is_glob(path):
        raise InputError(f"input file {path!r} does not exist")
    return Source(path, fmt, path, header=reading.header)


__all__ = ["TABLE_FORMAT", "Source", "open_source"]
