"""The on-disk layout of a feature store: files, atomic writes, the manifest, safetensors shards read by memory map.

A store is a directory::

    STORE/
      manifest.json             spec, model, input and counts (written first, rewritten atomically after every shard)
      shard-000000.safetensors  features of consecutive records (written to a temporary name, then renamed)
      shard-000001.safetensors
      errors.jsonl              skipped records: {"line": 12, "reason": "empty text ..."} one per line

Each shard holds (``R`` records, ``N`` rows; ``N == R`` at sentence level, the records' token or word count
otherwise, stored flat and never padded):

===============  ===============  =================================================================
tensor           shape, dtype     meaning
===============  ===============  =================================================================
``features``     ``[N, D]`` f32/f16  one row per record (sentence) or per token / word
``offsets``      ``[R + 1]`` i64  record ``r`` owns rows ``offsets[r]:offsets[r+1]`` (token/word only)
``lines``        ``[R]`` i64      the line of the input each record came from
``token_ids``    ``[N]`` i32      the tokenizer's ids of the rows (token level only)
===============  ===============  =================================================================

and string metadata ``columns`` (JSON: kept column name -> list of R values), at word level ``words``
(JSON: R word lists) and, for an input read from stdin, ``input_prefix`` (JSON: ``line``, ``records`` and
``sha256`` of the records read up to the shard's last one, which a resume must find again at the start of its
stdin; also listed with the shard in the manifest). No pickle anywhere: safetensors' header is JSON and its data
raw little-endian arrays. :func:`shard_rows` is the one place that builds a shard's tensors and metadata (the
extraction engine and the merge both write through it).

The manifest (``format_version`` 2) holds ``spec`` (the resolved :class:`~layerwise.EncodeSpec`), ``model``
(``name``, ``fingerprint``: sha256 of the weights, ``family``, ``num_layers``, ``hidden_size``, ``backend``,
``precision``), ``model_options`` (the :class:`~layerwise.ModelOptions` the model was loaded with), ``tokenizer``
(class, vocabulary size, window length and stride), ``input`` (``path``, ``format``, ``sha256`` of the file,
``text_field``, ``keep``, ``context``; for stdin ``path`` is ``-`` and ``sha256`` and ``bytes`` are those of the
whole stream, recorded when it was read to the end), ``feature_shape``, ``status`` (``running | partial | complete``),
``counts`` and the list of ``shards`` with their record ranges.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np

FORMAT = "layerwise-store"
FORMAT_VERSION = 2
STORE_DTYPES: dict[str, type[np.floating[Any]]] = {"float32": np.float32, "float16": np.float16}
MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "F64": np.float64}


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is "no space left on device" (or over a disk quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``shard-000003.safetensors``."""
    return f"shard-{index:06d}.safetensors"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _commit(tmp: Path, path: Path) -> None:
    """fsync ``tmp``, rename it over ``path`` and fsync the directory: the file appears whole or not at all."""
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that a reader (or a crash) sees the old file or the new one, never a part.

    On any error (a full disk included) the temporary file is removed and the error re-raised.
    """
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        _commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented UTF-8 JSON, atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8"))


def read_json(path: Path) -> Any:
    """Parse a JSON file."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def save_tensors(tmp: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write ``tensors`` and string ``metadata`` as a safetensors file at ``tmp`` (no copy of the data in memory)."""
    from safetensors.numpy import save_file

    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(tmp), metadata=metadata)


def shard_rows(
    level: str,
    lines: Sequence[int],
    features: np.ndarray | Sequence[np.ndarray],
    width: int,
    dtype: Any,
    *,
    token_ids: Sequence[Sequence[int]] = (),
    words: Sequence[Sequence[str]] = (),
    columns: dict[str, list[Any]] | None = None,
    tokens: int = 0,
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The tensors and metadata of one shard of ``R`` records (the layout in the module docstring).

    Args:
        level: ``sentence | token | word``.
        lines: the input line of each record (``R``).
        features: sentence level: ``[R, width]`` (used as is when it is already an array of ``dtype``) or R vectors;
            token/word level: R arrays ``[n_r, *D]`` with ``prod(D) == width``.
        width: ``D`` flattened, the width of one row.
        dtype: the store's dtype (numpy).
        token_ids: token level: each record's token ids. words: word level: each record's words.
        columns: kept column name -> R values. tokens: tokens encoded for these records.
    """
    tensors: dict[str, np.ndarray] = {"lines": np.asarray(lines, dtype=np.int64)}
    if level == "sentence":
        if isinstance(features, np.ndarray) and features.dtype == dtype:
            tensors["features"] = features.reshape(len(lines), width)
        else:
            tensors["features"] = np.stack([np.asarray(f, dtype=dtype).reshape(width) for f in features]) if len(
                features) else np.zeros((0, width), dtype)
    else:
        rows = [np.asarray(f, dtype=dtype).reshape(-1, width) for f in features]
        tensors["features"] = np.concatenate(rows) if rows else np.zeros((0, width), dtype)
        tensors["offsets"] = np.concatenate([[0], np.cumsum([r.shape[0] for r in rows])]).astype(np.int64)
        if level == "token":
            tensors["token_ids"] = (np.concatenate([np.asarray(i, dtype=np.int32) for i in token_ids]) if token_ids
                                    else np.zeros(0, np.int32))
    meta = {"tokens": str(tokens)}
    if columns:
        meta["columns"] = json.dumps(columns, ensure_ascii=False)
    if level == "word":
        meta["words"] = json.dumps([list(w) for w in words], ensure_ascii=False)
    return tensors, meta


def write_shard(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> int:
    """Save one shard atomically as safetensors (straight to a temporary file, no copy in memory); returns its size.

    On any error (a full disk included) the temporary file is removed and the error re-raised; ``path`` is then
    absent or the previous file.
    """
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb"):
            mode = os.stat(tmp).st_mode & 0o777  # the permissions the user's umask gives a new file
        save_tensors(tmp, tensors, metadata)
        os.chmod(tmp, mode)  # safetensors writes 0600 files; a store is shared like any other output
        _commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


class ShardFile:
    """A safetensors shard opened for reading: header parsed once, tensors memory-mapped on demand."""

    def __init__(self, path: Path):
        self.path = Path(path)
        with open(self.path, "rb") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
        self._base = 8 + size
        self.metadata: dict[str, str] = header.pop("__metadata__", {}) or {}
        self._entries: dict[str, dict] = header
        self._cache: dict[str, np.ndarray] = {}

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def array(self, name: str) -> np.ndarray:
        """The tensor ``name`` as a read-only ``np.memmap`` (no copy)."""
        if name not in self._cache:
            entry = self._entries[name]
            dtype = _ST_DTYPES[entry["dtype"]]
            begin, end = entry["data_offsets"]
            shape = tuple(entry["shape"])
            if end == begin:
                arr = np.zeros(shape, dtype=dtype)
            else:
                arr = np.memmap(self.path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r",
                                offset=self._base + begin, shape=shape)
            self._cache[name] = arr
        return self._cache[name]

    def json_meta(self, key: str, default: Any = None) -> Any:
        value = self.metadata.get(key)
        return default if value is None else json.loads(value)


def list_shards(store: Path) -> list[Path]:
    """The finished shards of a store, in order (temporary files of an interrupted write are not listed)."""
    if not store.is_dir():
        return []
    return sorted(p for p in store.iterdir() if SHARD_RE.match(p.name))


def remove_temporaries(store: Path) -> int:
    """Delete half-written files an interrupted run left (``.NAME.tmp-PID``); returns how many."""
    n = 0
    for p in store.iterdir():
        if p.name.startswith(".") and ".tmp-" in p.name:
            p.unlink(missing_ok=True)
            n += 1
    return n
