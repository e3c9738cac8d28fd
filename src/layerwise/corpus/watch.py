"""The input as it is read: its files watched for a change (size, modification time, the file itself) and the
sha256 of the bytes the reader took in, in the form a store's manifest records (``input.sha256``).

A run records the sha256 of its input. Hashing the file before reading it proves nothing about what was read: a
file rewritten during the run (``cat other.tsv > corpus.tsv``, same inode) would be recorded as the old one while
its later records hold the new text. So the extraction engine (:mod:`layerwise.extraction.engine`)

* takes an :class:`InputWatch` before it hashes the input, and asks it for :meth:`~InputWatch.changes` before it
  writes each shard and at the end: a shard is written only when every file still has its size, modification time
  and inode, so each written shard was read from the input the run started with;
* hashes the bytes the reader reads (:class:`ReadDigest`: the same stream that is parsed and tokenised), and at the
  end compares that hash with the one taken before the run: it catches a rewrite that kept the size and the
  modification time.

A single text file is hashed as its bytes are read, several files (a directory, a pattern) each as it is read, in
the form :func:`~layerwise.provenance.input_sha256` gives. Parquet is read by seeking (its footer first), so it is
hashed before the run and watched by size and modification time only.

Example::

    >>> watch = InputWatch(["corpus.tsv"])        # doctest: +SKIP
    >>> watch.changes()                           # doctest: +SKIP
    ['corpus.tsv: 120,001 bytes when the run started, 98,304 now; modified 10:00:01.52 then, 10:00:21.07 now']
"""

from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO

from ..provenance import HashingStream


@dataclass(frozen=True)
class FileState:
    """What :class:`InputWatch` compares: a file's size, modification time (ns) and identity (device, inode)."""

    size: int
    mtime_ns: int
    inode: tuple[int, int]

    @classmethod
    def of(cls, path: str | os.PathLike) -> "FileState | None":
        """The state of ``path`` now; ``None`` when it is gone."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        return cls(st.st_size, st.st_mtime_ns, (st.st_dev, st.st_ino))


def _time(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f")[:-4] + " UTC"


def describe_change(name: str, before: FileState | None, now: FileState | None) -> str:
    """One line saying how a file changed between two states."""
    if now is None:
        return f"{name}: removed (or renamed) during the run"
    if before is None:
        return f"{name}: appeared during the run"
    what = []
    if now.inode != before.inode:
        what.append("replaced by another file (a new inode)")
    if now.size != before.size:
        what.append(f"{before.size:,} bytes when the run started, {now.size:,} now")
    if now.mtime_ns != before.mtime_ns:
        what.append(f"modified {_time(before.mtime_ns)} then, {_time(now.mtime_ns)} now")
    return f"{name}: {'; '.join(what)}"


class InputWatch:
    """The files of an input as they were when the watch was made; :meth:`changes` says what differs now."""

    def __init__(self, files: list[str]):
        self.files = list(files)
        self.start = {f: FileState.of(f) for f in self.files}

    def changes(self) -> list[str]:
        """One line per file whose size, modification time or inode changed (or that is gone); empty: unchanged."""
        out = []
        for f, before in self.start.items():
            now = FileState.of(f)
            if now != before:
                out.append(describe_change(f, before, now))
        return out


class ReadDigest:
    """The sha256 of the bytes an input's reader takes in, in the form of
    :func:`~layerwise.provenance.input_sha256`: one file's bytes, or for several files each file's name and sha256.

    :meth:`open` gives the reader a file to read through the hash; :meth:`add_file` takes the hash of a file read
    another way (:class:`~layerwise.corpus.records.RangeStream` hashes what it reads). :attr:`complete` says whether
    each file was read to its end.
    """

    def __init__(self) -> None:
        self._files: list[tuple[str, str, bool]] = []  # (name, sha256, read to the end)
        self._open: list[tuple[str, HashingStream]] = []

    def open(self, path: str | os.PathLike) -> IO[bytes]:
        """``path`` opened for reading, its bytes hashed as they are read (close it as usual)."""
        raw = HashingStream(open(path, "rb", buffering=0), owns=True)
        self._open.append((Path(path).name, raw))
        return io.BufferedReader(raw, buffer_size=1 << 16)

    def add_file(self, name: str, sha256: str, complete: bool = True) -> None:
        """Take the sha256 of a file read elsewhere (``complete``: it was read to its end)."""
        self._files.append((name, sha256, complete))

    def _all(self) -> list[tuple[str, str, bool]]:
        opened = [(name, s.hexdigest(), s.at_end) for name, s in self._open]
        return self._files + opened

    @property
    def complete(self) -> bool:
        """Every file was read to its end (only then is :meth:`hexdigest` the whole input's)."""
        files = self._all()
        return bool(files) and all(done for _, _, done in files)

    def hexdigest(self) -> str:
        """The sha256 of what was read: a single file's own, else over ``name\\tsha256`` lines."""
        files = self._all()
        if len(files) == 1:
            return files[0][1]
        h = hashlib.sha256()
        for name, sha, _ in files:
            h.update(f"{name}\t{sha}\n".encode())
        return h.hexdigest()


__all__ = ["FileState", "InputWatch", "ReadDigest", "describe_change"]
