"""Hashing and provenance in one place: file and weight fingerprints, timestamps, and option differences.

Stores, the frozen feature cache of heads and the ONNX export cache all identify their inputs by content:
:func:`file_sha256` for input files, :func:`tensors_fingerprint` for a model's weights (names, shapes and values, so
a model fine-tuned in memory gets a new fingerprint), and :func:`content_key` for a dict of options. stdin has no
file to hash beforehand: :class:`HashingStream` hashes its bytes as they are read.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
from datetime import datetime, timezone
from typing import IO, TYPE_CHECKING, Any, Iterable, Mapping

from .version import __version__

if TYPE_CHECKING:
    import torch


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read ``chunk`` bytes at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def input_sha256(path: str | os.PathLike) -> str:
    """sha256 of an input: a file's bytes, or for several files (a directory, a glob pattern) each file's name and
    sha256 in name order (renaming, adding or changing a file changes it)."""
    from pathlib import Path

    from .corpus.readers import corpus_files, is_glob

    if not os.path.isdir(path) and not is_glob(path):
        return file_sha256(path)
    h = hashlib.sha256()
    for f in corpus_files(path):
        h.update(f"{Path(f).name}\t{file_sha256(f)}\n".encode())
    return h.hexdigest()


def table_sha256(table: Any, rows: int = 65536) -> str:
    """sha256 of a ``pyarrow.Table``'s schema and values: Arrow IPC of slices of ``rows`` rows, so the same rows
    hash the same whatever their chunking."""
    import pyarrow as pa

    h = hashlib.sha256(table.schema.remove_metadata().serialize().to_pybytes())
    for start in range(0, table.num_rows, rows):
        part = table.slice(start, rows)
        # concatenating with an empty array copies into fresh buffers: a slice's offset never reaches the bytes
        arrays = [pa.concat_arrays([*col.chunks, pa.array([], col.type)]) for col in part.columns]
        h.update(pa.RecordBatch.from_arrays(arrays, schema=part.schema).serialize().to_pybytes())
    return h.hexdigest()


def tensors_fingerprint(state: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over every tensor's name, shape and float32 values, in name order (one pass over the weights).

    ``state`` is a mapping, or ``(name, tensor)`` pairs already in name order (read one at a time: a model whose
    blocks are read from its checkpoint as they are hashed)."""
    h = hashlib.sha256()
    pairs = sorted(state.items()) if isinstance(state, Mapping) else state
    for name, t in pairs:
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def content_key(obj: Any, length: int = 20) -> str:
    """A short, stable hash of a JSON-able object (keys sorted)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:length]


def differences(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Human-readable differences between two nested dicts: ``"spec.pool (store: "mean", now: "max")"``."""
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(differences(a, b, f"{prefix}{key}."))
        elif a != b:
            out.append(f"{prefix}{key} (store: {json.dumps(a)}, now: {json.dumps(b)})")
    return out


def now() -> str:
    """The current UTC time, ISO 8601, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def stamp() -> dict[str, str]:
    """What wrote a file and when: ``{"layerwise_version": ..., "created": ...}``."""
    return {"layerwise_version": __version__, "created": now()}


class HashingStream(io.RawIOBase):
    """A readable byte stream that hashes what passes through it (stdin has no file to hash beforehand).

    Wrap it in ``io.BufferedReader`` to iterate lines; :meth:`hexdigest` is the sha256 of the bytes read so far and
    :attr:`count` their number. It reads with ``read1`` where the wrapped stream has it, so a slow pipe is passed on
    as its data arrives instead of waiting for a full buffer.

    Example::

        >>> import io
        >>> s = HashingStream(io.BytesIO(b"a\\nb\\n"))
        >>> [line for line in io.BufferedReader(s)], s.count
        ([b'a\\n', b'b\\n'], 4)
    """

    def __init__(self, raw: IO[bytes], *, owns: bool = False):
        super().__init__()
        self._raw = raw
        self._owns = owns  # close ``raw`` with this stream (a file opened for it), not stdin
        self._read = getattr(raw, "read1", raw.read)
        self._hash = hashlib.sha256()
        self.count = 0
        self.at_end = False  # a read found the end of the stream

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        """The wrapped stream's file descriptor."""
        return self._raw.fileno()

    def readinto(self, buffer: Any) -> int:
        """Read into ``buffer``, hashing the bytes."""
        data = self._read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self._hash.update(data)
        self.count += n
        if n == 0 and len(buffer):
            self.at_end = True
        return n

    def close(self) -> None:
        """Close this stream (and the wrapped one when it was opened for it: ``owns``)."""
        if self._owns and not self.closed:
            self._raw.close()
        super().close()

    def hexdigest(self) -> str:
        """sha256 of the bytes read so far."""
        return self._hash.hexdigest()

    def drain(self) -> None:
        """Read (and hash) the rest of the stream."""
        while self.read(1 << 20):
            pass
