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
stdin; also listed with the shard in the manifest). What the manifest says about a shard, the shard says too, so a
lost manifest can be rebuilt (:mod:`layerwise.store.recover`): ``store`` (the store's id), ``shard`` (its index),
``store_header`` (JSON: the run's spec, model, tokenizer, input, feature shape and format), ``after_line`` (the
last line of the shard before it, 0 for the first) and ``seal`` (the sha256 of the header without it and of every
tensor byte: :meth:`ShardFile.seal_ok`). No pickle anywhere: safetensors' header is JSON and its data
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
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ..encoding.vocab import VALUE_DTYPES
from ..errors import StoreCorruptError, StoreError, StoreFullError
from .lock import pid_alive

FORMAT = "layerwise-store"
FORMAT_VERSION = 3  # 3: every shard listed with its sha256 (format 2 listed sizes only; it still opens)
READABLE_VERSIONS = (2, 3, 4)  # 4: a store of part stores (layerwise.store.parts)
# output_dtype -> numpy dtype (binary: packed bits as int8)
STORE_DTYPES: dict[str, Any] = {name: np.dtype(value).type for name, value in VALUE_DTYPES.items()}
MANIFEST = "manifest.json"
ERRORS = "errors.jsonl"
SHARD_RE = re.compile(r"^shard-(\d{6})\.safetensors$")
PART_RE = re.compile(r"^part-(\d{5})$")  # a part store inside a store of parts (layerwise.store.parts)
# the temporary files layerwise itself writes (``.NAME.tmp-PID``), and only those
TEMP_RE = re.compile(r"^\.(shard-\d{6}\.safetensors|manifest\.json|errors\.jsonl)\.tmp-(\d+)$")
_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32, "F64": np.float64,
              "I8": np.int8, "U8": np.uint8}
_ST_NAMES = {np.dtype(v).name: k for k, v in _ST_DTYPES.items()}
# dtypes numpy lacks, held as their raw bits (a token-activation store's bfloat16 and float8 e4m3 values): written
# with their safetensors name (``kinds=`` of :func:`save_tensors`), read as the bits' numpy dtype
RAW_BITS = {"BF16": np.uint16, "F8_E4M3": np.uint8}
_ST_DTYPES.update(RAW_BITS)
MAX_HEADER = 100 << 20  # safetensors' own limit on the JSON header
SEAL = "seal"  # a shard's metadata key: the sha256 of its header (without it) and its tensors' bytes
RESTORE = "rerun the extract command to recompute it (a resume repairs the store), or restore the file from a copy"


def is_disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` is "no space left on device" (or over a disk quota)."""
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def guard_full(write: Any, what: str, store: Path, safe: str) -> Any:
    """Run ``write``; a full disk becomes one :class:`StoreFullError` naming the store, the file (``what``), what is
    safe (``safe``: "N records in M finished shards") and the fix."""
    try:
        return write()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        raise StoreFullError(
            f"no space left on the device while writing {what} of store {str(store)!r}: {safe} are safe. Free some "
            f"space and rerun the same command: it resumes after the last finished shard") from exc


def shard_name(index: int) -> str:
    """The file name of shard ``index``: ``shard-000003.safetensors``."""
    return f"shard-{index:06d}.safetensors"


def shard_index(name: str) -> int:
    """The index in a shard's file name (``shard-000003.safetensors`` -> 3); -1 for any other name."""
    m = SHARD_RE.match(name)
    return int(m.group(1)) if m else -1


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
    """Parse a JSON file of a store.

    Raises:
        StoreCorruptError: the file is not UTF-8 JSON (naming the file and the position).
    """
    try:
        return json.loads(Path(path).read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        raise StoreCorruptError(f"{str(path)!r} is damaged: not valid JSON ({exc}); restore it from a copy, or "
                                f"delete the store and rerun the extract command") from exc


@dataclass(frozen=True)
class Written:
    """What writing a file gave: its size in bytes and the sha256 of its bytes (hex)."""

    bytes: int
    sha256: str


def _canonical(header: dict[str, Any]) -> bytes:
    """A safetensors header as the bytes its seal covers: JSON with sorted keys, no spaces, without the seal."""
    meta = {k: v for k, v in (header.get("__metadata__") or {}).items() if k != SEAL}
    body = {**{k: v for k, v in header.items() if k != "__metadata__"}, "__metadata__": meta}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def save_tensors(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str], *,
                 seal: bool = True, kinds: dict[str, str] | None = None) -> Written:
    """Write ``tensors`` and string ``metadata`` as a safetensors file at ``path``, hashing the bytes as they are
    written (no second read, no copy of the data in memory). Any safetensors reader reads the file.

    The layout is safetensors' own: an 8-byte little-endian header length, the JSON header (tensors in name
    order, each with ``dtype``, ``shape`` and ``data_offsets``; ``__metadata__``), padded with spaces to a multiple
    of 8, then the tensors' little-endian bytes back to back.

    ``seal``: the metadata's ``seal`` is the sha256 of the header without it (:func:`_canonical`) and the tensors'
    bytes, so the file proves its own content when no manifest lists its sha256 (:meth:`ShardFile.seal_ok`,
    ``layerwise recover``).

    ``kinds``: tensor name -> safetensors dtype for the raw bits of a dtype numpy lacks (:data:`RAW_BITS`: ``BF16``
    from ``uint16``, ``F8_E4M3`` from ``uint8``).
    """
    kinds = kinds or {}
    arrays = {}
    for name in sorted(tensors):
        a = np.asarray(tensors[name])
        arrays[name] = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    meta = {k: v for k, v in metadata.items() if k != SEAL}
    header: dict[str, Any] = {"__metadata__": meta} if meta or seal else {}
    at = 0
    for name, a in arrays.items():
        kind = kinds.get(name) or _ST_NAMES[a.dtype.name]
        if np.dtype(_ST_DTYPES[kind]) != a.dtype:
            raise StoreError(f"tensor {name!r} is {a.dtype.name}; {kind} is written from {np.dtype(_ST_DTYPES[kind])}")
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    data: list[memoryview] = [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays.values()]  # type: ignore[arg-type]
    if seal:
        sealed = hashlib.sha256(_canonical(header))
        for part in data:
            sealed.update(part)
        meta[SEAL] = sealed.hexdigest()
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    digest = hashlib.sha256()
    chunks: list[bytes | memoryview] = [len(text).to_bytes(8, "little"), text, *data]
    with open(path, "wb") as fh:
        for chunk in chunks:
            digest.update(chunk)
            fh.write(chunk)
    return Written(8 + len(text) + at, digest.hexdigest())


def file_sha256(path: Path, chunk: int = 4 << 20) -> str:
    """The sha256 (hex) of a file's bytes, read ``chunk`` bytes at a time."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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


def write_shard(path: Path, tensors: dict[str, np.ndarray], metadata: dict[str, str], *,
                kinds: dict[str, str] | None = None) -> Written:
    """Save one shard atomically as safetensors (straight to a temporary file, no copy in memory); returns its size
    and sha256, computed while writing.

    On any error (a full disk included) the temporary file is removed and the error re-raised; ``path`` is then
    absent or the previous file.
    """
    tmp = _tmp_name(path)
    try:
        written = save_tensors(tmp, tensors, metadata, kinds=kinds)
        _commit(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return written


class ShardFile:
    """A safetensors shard opened for reading: header parsed and checked once, tensors memory-mapped on demand.

    Attributes:
        path: the file. size: its size in bytes. metadata: the string metadata.

    Raises:
        StoreCorruptError: the file cannot be read as safetensors (a bad header length, a header that is not
            JSON, a tensor entry that is malformed or points past the end of the file), naming the file.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self.size = os.fstat(fh.fileno()).st_size
                head = fh.read(8)
                size = int.from_bytes(head, "little")
                if len(head) < 8 or size > min(MAX_HEADER, self.size - 8):
                    self._bad(f"its header length ({size if len(head) == 8 else 'cut short'}) does not fit a "
                              f"file of {self.size} bytes")
                header = json.loads(fh.read(size))
        except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested beyond reason
            self._bad(f"its header is not valid JSON ({exc})")
        if not isinstance(header, dict):
            self._bad("its header is not a JSON object")
        self._base = 8 + size
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            self._bad("its __metadata__ is not a map of strings")
        self.metadata: dict[str, str] = metadata
        for name, entry in header.items():
            self._check_entry(name, entry)
        self._entries: dict[str, dict] = header
        self._cache: dict[str, np.ndarray] = {}

    def _bad(self, what: str) -> Any:
        raise StoreCorruptError(f"shard {str(self.path)!r} is damaged: {what}; {RESTORE}", file=str(self.path),
                                problem=what)

    def _check_entry(self, name: str, entry: Any) -> None:
        ok = isinstance(entry, dict) and entry.get("dtype") in _ST_DTYPES
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        if not (ok and isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            self._bad(f"tensor {name!r} has a malformed entry {str(entry)[:80]}")
            return
        begin, end = offsets
        need = int(np.prod(shape, dtype=np.int64)) * np.dtype(_ST_DTYPES[entry["dtype"]]).itemsize
        if not 0 <= begin <= end or end - begin != need:
            self._bad(f"tensor {name!r} of shape {shape} claims bytes {begin}..{end}")
        if self._base + end > self.size:
            self._bad(f"tensor {name!r} ends at byte {self._base + end}, past the end of the file "
                      f"({self.size} bytes): the file was cut short")

    def keys(self) -> list[str]:
        return list(self._entries)

    def seal_ok(self, chunk: int = 4 << 20) -> bool | None:
        """Whether the file's content is what its writer sealed (:func:`save_tensors`): ``None`` when it has no
        seal (written before layerwise recorded one), else whether the header and every tensor byte hash to it (and
        nothing follows the last tensor)."""
        want = self.metadata.get(SEAL)
        if want is None:
            return None
        digest = hashlib.sha256(_canonical({**self._entries, "__metadata__": self.metadata}))
        end = self._base + max((int(e["data_offsets"][1]) for e in self._entries.values()), default=0)
        with open(self.path, "rb") as fh:
            fh.seek(self._base)
            left = end - self._base
            while left > 0 and (block := fh.read(min(chunk, left))):
                digest.update(block)
                left -= len(block)
        return left == 0 and self.size == end and digest.hexdigest() == want

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def kind(self, name: str) -> str:
        """The safetensors dtype of tensor ``name`` (``F32``, ``BF16``, ``F8_E4M3``, ...)."""
        return str(self._entries[name]["dtype"])

    def dtype(self, name: str) -> np.dtype:
        """The numpy dtype of tensor ``name`` (the raw bits' for ``BF16`` and ``F8_E4M3``: :data:`RAW_BITS`)."""
        return np.dtype(_ST_DTYPES[self._entries[name]["dtype"]])

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def data_offset(self, name: str) -> int:
        """Where tensor ``name``'s bytes start in the file."""
        return self._base + int(self._entries[name]["data_offsets"][0])

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

    def forget(self, name: str) -> None:
        """Let go of the mapped tensor ``name`` (unmapped once no array refers to it; :meth:`array` maps it again)."""
        self._cache.pop(name, None)

    def json_meta(self, key: str, default: Any = None) -> Any:
        """The metadata value ``key`` parsed as JSON (``default`` when absent).

        Raises:
            StoreCorruptError: the value is not JSON.
        """
        value = self.metadata.get(key)
        if value is None:
            return default
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            return self._bad(f"its metadata {key!r} is not JSON ({exc})")


def list_shards(store: Path) -> list[Path]:
    """The finished shards of a store, in order (temporary files of an interrupted write are not listed)."""
    if not store.is_dir():
        return []
    return sorted(p for p in store.iterdir() if SHARD_RE.match(p.name))


def _alive(pid: int) -> bool:
    # this process is not writing the file any more: it is opening the store
    return pid != os.getpid() and pid_alive(pid)


def remove_temporaries(store: Path) -> int:
    """Delete the half-written files an interrupted run left: only names layerwise writes (``.shard-000003
    .safetensors.tmp-PID``, ``.manifest.json.tmp-PID``, ``.errors.jsonl.tmp-PID``) whose process has ended (a
    running writer's file is left alone). Returns how many were removed."""
    n = 0
    for p in store.iterdir():
        m = TEMP_RE.match(p.name)
        if m and p.is_file() and not _alive(int(m.group(2))):
            p.unlink(missing_ok=True)
            n += 1
    return n
