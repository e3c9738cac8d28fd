"""A feature store as Arrow record batches: the one conversion behind ``store.to_arrow()``, ``store.to_dataset()``
and the parquet export, readable without layerwise or Ray.

One row per record: ``line``, the kept columns, ``token_ids`` (token level) or ``words`` (word level), and
``features``, whose type depends on who reads it (``D`` is the store's feature shape, e.g. ``[384]`` or ``[4, 384]``):

=====================  ==============================================  ==============================================
form                   sentence level                                  token / word level (``n`` rows per record)
=====================  ==============================================  ==============================================
``tensor`` (Arrow)     ``arrow.fixed_shape_tensor(D)``: the canonical   ``list<arrow.fixed_shape_tensor(D)>``
                       extension type (``.to_numpy_ndarray()`` gives
                       ``[records, *D]``)
``lists`` (parquet,    nested fixed-size lists following ``D``          ``list<`` nested fixed-size lists ``>``
datasets)              (``datasets`` reads them as ``List(..., length)``,
                       numpy format gives ``[records, *D]``)
=====================  ==============================================  ==============================================

The store's manifest is the schema metadata ``layerwise_manifest`` (JSON). Batches are streamed ``size`` records
at a time, so writing a parquet file or an Arrow file never holds the whole store.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any, Iterator, Literal

import numpy as np

from ..errors import MissingExtraError, StoreError

if TYPE_CHECKING:  # the reader imports this module (store.to_arrow); this one only reads a store it is given
    from .reader import FeatureStore

Form = Literal["tensor", "lists"]
OWN_COLUMNS = ("line", "features", "token_ids", "words")  # the conversion's own columns; kept columns may not use them


def _plain(value: Any) -> Any:
    """A kept value Arrow can type: numbers, strings, lists and None as they are, anything else as JSON."""
    if isinstance(value, np.generic):
        return value.item()
    return value if isinstance(value, (str, int, float, bool, list)) or value is None else json.dumps(value)


def _kept(store: FeatureStore) -> dict[str, Any]:
    """The kept columns as Arrow arrays: one type per column over all records (a null-only shard must not fix it)."""
    import pyarrow as pa

    columns = {}
    for name in store.columns:
        values = [_plain(v) for v in store.column(name)]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            columns[name] = pa.array([None if v is None else str(v) for v in values])
    return columns


def _value_type(store: FeatureStore) -> Any:
    import pyarrow as pa

    return pa.from_numpy_dtype(store.dtype)


def feature_type(store: FeatureStore, form: Form) -> Any:
    """The Arrow type of one record's features (see the module docstring)."""
    import pyarrow as pa

    shape = [int(d) for d in store.feature_shape]
    if form == "tensor":
        row: Any = pa.fixed_shape_tensor(_value_type(store), shape)
    else:
        row = _value_type(store)
        for d in reversed(shape):
            row = pa.list_(row, d)
    return row if store.level == "sentence" else pa.list_(row)


def _rows(flat: np.ndarray, store: FeatureStore, form: Form) -> Any:
    """``flat`` ``[n, *D]`` as an Arrow array of ``n`` rows of the record type (sentence level's row type)."""
    import pyarrow as pa

    shape = [int(d) for d in store.feature_shape]
    if form == "tensor":
        return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(flat.reshape(-1, *shape)))
    arr: Any = pa.array(flat.ravel(), type=_value_type(store))
    for d in reversed(shape):
        arr = pa.FixedSizeListArray.from_arrays(arr, d)
    return arr


def schema(store: FeatureStore, form: Form, kept: dict[str, Any]) -> Any:
    """The schema of :func:`record_batches`: line, kept columns, token ids / words, features; manifest metadata."""
    import pyarrow as pa

    extra: list[tuple[str, Any]] = []
    if store.level == "token":
        extra = [("token_ids", pa.list_(pa.int32()))]
    elif store.level == "word":
        extra = [("words", pa.list_(pa.string()))]
    features = ("features", feature_type(store, form))
    return pa.schema(
        [("line", pa.int64()), *[(k, a.type) for k, a in kept.items()], *extra, features],
        metadata={b"layerwise_manifest": json.dumps(store.manifest).encode()},
    )


def record_batches(store: FeatureStore, form: Form = "tensor", size: int = 4096) -> tuple[Any, Iterator[Any]]:
    """``(schema, batches)``: the store as Arrow record batches of ``size`` records, in store order.

    Raises:
        ValueError: a kept column takes one of the conversion's own names (``line``, ``features``, ...).
    """
    clash = [c for c in store.columns if c in OWN_COLUMNS]
    if clash:
        raise StoreError(f"kept column {clash[0]!r} has the name of a column the Arrow form writes itself "
                         f"({', '.join(OWN_COLUMNS)}); export to npy or hdf5, which keep columns apart")
    kept = _kept(store)
    sch = schema(store, form, kept)
    return sch, _batches(store, form, size, kept, sch)


def _batches(store: FeatureStore, form: Form, size: int, kept: dict[str, Any], sch: Any) -> Iterator[Any]:
    import pyarrow as pa

    side: Iterator[Any] = iter(())
    if store.level == "token":
        side = store.iter_token_ids(size=size)
    elif store.level == "word":
        side = store.iter_words(size=size)
    lines = store.lines
    start = 0
    for batch in store.iter_chunks(size=size):
        n = len(batch)
        if store.level == "sentence":
            feats = _rows(np.asarray(batch), store, form)
        else:
            inner = _rows(np.concatenate(batch) if n else np.zeros((0, *store.feature_shape)), store, form)
            offsets = np.concatenate([[0], np.cumsum([b.shape[0] for b in batch])]).astype(np.int32)
            feats = pa.ListArray.from_arrays(pa.array(offsets), inner)
        data = [pa.array(lines[start : start + n], type=pa.int64()), *[a.slice(start, n) for a in kept.values()]]
        if store.level != "sentence":
            got = next(side)
            values = [np.asarray(x).tolist() for x in got] if store.level == "token" else got
            data.append(pa.array(values, type=sch.field("token_ids" if store.level == "token" else "words").type))
        yield pa.RecordBatch.from_arrays([*data, feats], schema=sch)
        start += n


def to_arrow(store: FeatureStore, size: int = 4096) -> Any:
    """The store as one ``pyarrow.Table`` (in memory) with ``arrow.fixed_shape_tensor`` features.

    ``table["features"].combine_chunks().to_numpy_ndarray()`` is ``[records, *D]`` at sentence level.
    """
    import pyarrow as pa

    sch, batches = record_batches(store, "tensor", size)
    return pa.Table.from_batches(list(batches), schema=sch)


_TEMPORARY: list[str] = []  # the temporary directories of to_dataset() without a path, removed at exit


def _remove_temporaries() -> None:
    import shutil

    for directory in _TEMPORARY:
        shutil.rmtree(directory, ignore_errors=True)


def to_dataset(store: FeatureStore, path: str | None = None, size: int = 4096) -> Any:
    """The store as a Hugging Face ``datasets.Dataset`` (features as nested fixed-size lists).

    The rows are streamed ``size`` records at a time to an Arrow file and the dataset is memory-mapped from it, so
    memory stays bounded (a chunk at a time) whatever the store's size: at ``path``, or without it a file in a
    temporary directory (under ``TMPDIR``; the dataset's own cache files go there too) removed when the process
    exits. ``ds.with_format("numpy")[:]["features"]`` is ``[records, *D]`` at sentence level.

    Raises:
        MissingExtraError: ``datasets`` is not installed (``pip install 'layerwise[hf]'``).
    """
    try:
        import datasets
    except ImportError as exc:
        raise MissingExtraError("store.to_dataset()", "hf", "Hugging Face datasets") from exc
    import pyarrow as pa

    if path is None:
        import atexit
        import tempfile

        directory = tempfile.mkdtemp(prefix="layerwise-dataset-")
        if not _TEMPORARY:
            atexit.register(_remove_temporaries)
        _TEMPORARY.append(directory)
        path = os.path.join(directory, "data.arrow")
    sch, batches = record_batches(store, "lists", size)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, sch) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return datasets.Dataset.from_file(str(path))


__all__ = ["OWN_COLUMNS", "feature_type", "record_batches", "schema", "to_arrow", "to_dataset"]
