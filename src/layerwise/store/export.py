"""Export a feature store to files that other tools read without layerwise (streamed shard by shard).

==========  ==================================================================================================
format      what is written
==========  ==================================================================================================
``npy``     a directory: ``features.npy`` (``[records, *F]``, or flat ``[N, *F]`` rows for token/word level),
            ``offsets.npy`` (token/word level, ``[records + 1]``), ``token_ids.npy`` (token level, ``[N]``, the
            tokenizer's ids of the rows), ``words.json`` (word level: one word list per record), ``lines.npy``,
            one ``<column>.npy`` per kept column (numbers, or fixed-width unicode; lists are stored as JSON
            strings), ``manifest.json``
``hdf5``    one file: datasets ``features``, ``offsets``, ``token_ids`` (token level), ``words`` (word level: flat,
            one per row, delimited by ``offsets``), ``lines``, ``columns/<name>``; the manifest as the JSON
            attribute ``manifest``
``parquet`` one file, one row per record: ``line``, the kept columns, ``token_ids`` (token level) or
            ``words`` (word level) as lists, and ``features`` (a list of floats, or a list of per-row lists at
            token/word level)
==========  ==================================================================================================

An export never replaces what layerwise did not write: an existing output that is not a layerwise export of
the same format (a file of yours, a non-empty directory) is refused, even with ``overwrite=True``; an earlier
layerwise export is replaced only with ``overwrite=True`` (CLI ``--overwrite``). Both are checked before any work.

Example::

    >>> from layerwise.store import open_store, export
    >>> export(open_store("feats"), "feats.h5", to="hdf5")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

import numpy as np

from .reader import FeatureStore

ExportFormat = Literal["npy", "hdf5", "parquet"]
EXPORT_FORMATS = ("npy", "hdf5", "parquet")


def _column_array(values: list) -> np.ndarray:
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return np.asarray(values)
    text = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
    return np.asarray(text, dtype=str)


def _token_ids(store: FeatureStore) -> np.ndarray:
    """Token level: the tokenizer ids of every row, ``[N]`` int32, in record order."""
    return np.concatenate([store.token_ids(i) for i in range(len(store))]) if len(store) else np.zeros(0, np.int32)


def _words(store: FeatureStore) -> list[list[str]]:
    """Word level: the word list of every record."""
    return [store.words(i) for i in range(len(store))]


def _flat_rows(store: FeatureStore) -> int:
    return len(store) if store.level == "sentence" else store.num_rows


def _chunks(store: FeatureStore):
    """``(rows [n, *F] flat, lengths or None)`` per shard-sized chunk, in record order."""
    for batch in store.iter_chunks(size=4096):
        if store.level == "sentence":
            yield np.asarray(batch), None
        else:
            lengths = [b.shape[0] for b in batch]
            rows = np.concatenate(batch) if batch else np.zeros((0,) + store.feature_shape, store.dtype)
            yield rows, lengths


def _fill(store: FeatureStore, feats) -> np.ndarray:
    """Copy every feature row into the array-like ``feats`` chunk by chunk; returns the record offsets."""
    offsets = [0]
    pos = 0
    for rows, lengths in _chunks(store):
        feats[pos : pos + len(rows)] = rows
        pos += len(rows)
        if lengths is not None:
            offsets.extend(np.cumsum(lengths) + offsets[-1])
    return np.asarray(offsets, dtype=np.int64)


def _to_npy(store: FeatureStore, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    feats = np.lib.format.open_memmap(out / "features.npy", mode="w+", dtype=store.dtype,
                                      shape=(_flat_rows(store),) + store.feature_shape)
    offsets = _fill(store, feats)
    feats.flush()
    del feats
    if store.level != "sentence":
        np.save(out / "offsets.npy", offsets)
    if store.level == "token":
        np.save(out / "token_ids.npy", _token_ids(store))
    if store.level == "word":
        (out / "words.json").write_text(json.dumps(_words(store), ensure_ascii=False), encoding="utf-8")
    np.save(out / "lines.npy", store.lines)
    for name in store.columns:
        np.save(out / f"{name}.npy", _column_array(store.column(name)), allow_pickle=False)
    (out / "manifest.json").write_text(json.dumps(store.manifest, indent=2), encoding="utf-8")


def _to_hdf5(store: FeatureStore, out: Path) -> None:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise ValueError("export to hdf5 needs h5py: pip install h5py") from exc
    with h5py.File(out, "w") as f:
        feats = f.create_dataset("features", shape=(_flat_rows(store),) + store.feature_shape, dtype=store.dtype,
                                 chunks=True)
        offsets = _fill(store, feats)
        if store.level != "sentence":
            f.create_dataset("offsets", data=offsets)
        if store.level == "token":
            f.create_dataset("token_ids", data=_token_ids(store))
        if store.level == "word":
            flat = [w for ws in _words(store) for w in ws]
            f.create_dataset("words", data=np.asarray(flat, dtype=object), dtype=h5py.string_dtype())
        f.create_dataset("lines", data=store.lines)
        group = f.create_group("columns")
        for name in store.columns:
            arr = _column_array(store.column(name))
            if arr.dtype.kind == "U":
                group.create_dataset(name, data=arr.astype(object), dtype=h5py.string_dtype())
            else:
                group.create_dataset(name, data=arr)
        f.attrs["manifest"] = json.dumps(store.manifest)
        f.attrs["level"] = store.level


def _to_parquet(store: FeatureStore, out: Path) -> None:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as exc:  # pragma: no cover - pyarrow is a dependency
        raise ValueError("export to parquet needs pyarrow: pip install pyarrow") from exc
    columns = {}
    for name in store.columns:  # one type per column over all records (a null-only shard must not fix it)
        values = [_plain(v) for v in store.column(name)]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[name] = pa.array([None if v is None else str(v) for v in values])
    value = pa.float16() if store.dtype == np.float16 else pa.float32()
    width = int(np.prod(store.feature_shape))
    feat_type = pa.list_(value, width) if store.level == "sentence" else pa.list_(pa.list_(value, width))
    if store.level == "token":
        starts = np.concatenate([[0], np.cumsum([len(store.token_ids(i)) for i in range(len(store))])])
        ids = _token_ids(store)
        columns["token_ids"] = pa.array([ids[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])],
                                        type=pa.list_(pa.int32()))
    if store.level == "word":
        columns["words"] = pa.array(_words(store), type=pa.list_(pa.string()))
    schema = pa.schema(
        [("line", pa.int64()), *[(k, a.type) for k, a in columns.items()], ("features", feat_type)],
        metadata={b"layerwise_manifest": json.dumps(store.manifest).encode()},
    )
    lines = store.lines
    start = 0
    with pq.ParquetWriter(out, schema) as writer:
        for batch in store.iter_chunks(size=4096):
            n = len(batch)
            if store.level == "sentence":
                flat = np.asarray(batch).reshape(n, width)
                feats = pa.FixedSizeListArray.from_arrays(pa.array(flat.ravel(), type=value), width)
            else:
                rows = [b.reshape(b.shape[0], width) for b in batch]
                inner = pa.FixedSizeListArray.from_arrays(
                    pa.array(np.concatenate(rows).ravel() if rows else np.zeros(0), type=value), width)
                offsets = pa.array(np.concatenate([[0], np.cumsum([r.shape[0] for r in rows])]).astype(np.int32))
                feats = pa.ListArray.from_arrays(offsets, inner)
            data = [pa.array(lines[start : start + n], type=pa.int64())]
            data += [a.slice(start, n) for a in columns.values()]
            writer.write_table(pa.Table.from_arrays(data + [feats], schema=schema))
            start += n


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, list)) or value is None else json.dumps(value)


def _is_layerwise_export(out: Path, to: str) -> bool:
    """Whether ``out`` is an export that layerwise wrote in format ``to`` (it carries a store manifest)."""
    try:
        if to == "npy":
            manifest = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
            return manifest.get("format") == "layerwise-store" and (out / "features.npy").is_file()
        if to == "hdf5":
            import h5py

            with h5py.File(out, "r") as f:
                return "manifest" in f.attrs and "features" in f
        import pyarrow.parquet as pq

        return b"layerwise_manifest" in (pq.read_schema(out).metadata or {})
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return False


def check_output(out: Path, to: str, overwrite: bool) -> None:
    """Refuse an output that layerwise did not write; refuse replacing its own export without ``overwrite``."""
    if not out.exists() or (out.is_dir() and to == "npy" and not any(out.iterdir())):
        return
    kind = "directory" if out.is_dir() else "file"
    if not _is_layerwise_export(out, to):
        raise ValueError(
            f"{str(out)!r} exists and is not a layerwise {to} export ({kind} not written by layerwise); layerwise "
            f"never replaces what it did not write: choose another output path (-o)"
        )
    if not overwrite:
        raise ValueError(f"{str(out)!r} holds an earlier layerwise {to} export; pass --overwrite (overwrite=True) to "
                         f"replace it, or choose another output path (-o)")


def export(
    store: FeatureStore | str | os.PathLike, out: str | os.PathLike, *, to: str, overwrite: bool = False
) -> Path:
    """Write ``store`` to ``out`` as ``npy`` (a directory), ``hdf5`` or ``parquet``; returns ``out``.

    ``overwrite`` replaces an earlier layerwise export at ``out``; anything else there is never replaced.
    """
    if not isinstance(store, FeatureStore):
        store = FeatureStore(store)
    if to not in EXPORT_FORMATS:
        raise ValueError(f"unknown export format {to!r}. Valid formats are: {', '.join(EXPORT_FORMATS)}")
    out = Path(out)
    check_output(out, to, overwrite)
    if to == "npy" and out.is_dir():  # replacing our own export: nothing of the old one may linger
        for old in [*out.glob("*.npy"), out / "words.json", out / "manifest.json"]:
            old.unlink(missing_ok=True)
    {"npy": _to_npy, "hdf5": _to_hdf5, "parquet": _to_parquet}[to](store, out)
    return out
