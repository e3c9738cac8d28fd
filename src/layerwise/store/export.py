"""Export a feature store to files that other tools read without layerwise (streamed shard by shard).

==========  ==================================================================================================
format      what is written
==========  ==================================================================================================
``npy``     a directory (not named ``*.npy``; a sentence-level store exported to ``NAME.npy`` is that one array,
            with its manifest in ``NAME.npy.json``): ``features.npy``
            (``[records, *F]``, or flat ``[N, *F]`` rows for token/word level), ``offsets.npy`` (token/word level,
            ``[records + 1]``), ``token_ids.npy`` (token level, ``[N]``, the tokenizer's ids of the rows),
            ``words.json`` (word level: one word list per record), ``lines.npy``, one ``<column>.npy`` per kept
            column (numbers, or fixed-width unicode; lists are stored as JSON strings), ``manifest.json``
``hdf5``    one file: datasets ``features``, ``offsets``, ``token_ids`` (token level), ``words`` (word level: flat,
            one per row, delimited by ``offsets``), ``lines``, ``columns/<name>``; the manifest as the JSON
            attribute ``manifest``
``parquet`` one file, one row per record: ``line``, the kept columns, ``token_ids`` (token level) or
            ``words`` (word level) as lists, and ``features`` (fixed-size lists following the feature shape, or a
            list of them at token/word level; see :mod:`layerwise.store.arrow`)
==========  ==================================================================================================

Token ids and words are streamed like the features (no format holds the whole store in memory): token ids
are the tokenizer's ids of the rows, special tokens included (``store.token_ids(i)``), words the words whose
rows they are (``store.words(i)``). A kept column may not take a name the format uses itself (npy: ``features``,
``offsets``, ``token_ids``, ``lines``, ``manifest``; parquet: ``line``, ``features``, ``token_ids``, ``words``):
such an export is refused before any work, naming the column and the formats that hold it apart.

An export never replaces what layerwise did not write: an existing output that is not a layerwise export of
the same format (a file of yours, a non-empty directory, an export whose manifest is gone) is refused, even with
``overwrite=True``; an earlier layerwise export (recognised by the store manifest it carries: ``manifest.json``,
the hdf5 attribute ``manifest``, the parquet schema metadata ``layerwise_manifest``) is replaced only with
``overwrite=True`` (CLI ``--overwrite``), and in an npy directory only the files that export wrote are replaced.
Both are checked before any work. Files are written under a temporary name and renamed into place, so a failed
export leaves no half-written output behind (the rule and the placement are :class:`~layerwise.outputs.OwnedOutput`'s,
shared by every output layerwise writes).

Example::

    >>> from layerwise.store import open_store, export
    >>> export(open_store("feats"), "feats.h5", to="hdf5")          # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..errors import StoreError
from ..outputs import OwnedOutput
from .arrow import OWN_COLUMNS, record_batches
from .layout import FORMAT
from .reader import FeatureStore

ExportFormat = Literal["npy", "hdf5", "parquet"]
EXPORT_FORMATS = ("npy", "hdf5", "parquet")
CHUNK = 4096  # records per streamed chunk
_NPY_OWN = ("features", "offsets", "token_ids", "lines", "manifest")  # npy: <name>.npy files of the export itself
_PARQUET_OWN = OWN_COLUMNS  # parquet: the export's own columns


def _column_array(values: list) -> np.ndarray:
    if values and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return np.asarray(values)
    text = [v if isinstance(v, str) else json.dumps(v, ensure_ascii=False) for v in values]
    return np.asarray(text, dtype=str)


def _flat_rows(store: FeatureStore) -> int:
    return len(store) if store.level == "sentence" else store.num_rows


def _chunks(store: FeatureStore):
    """``(rows [n, *F] flat, lengths or None)`` per shard-sized chunk, in record order."""
    for batch in store.iter_chunks(size=CHUNK):
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


def _fill_token_ids(store: FeatureStore, ids) -> None:
    """Token level: copy every row's token id into the array-like ``ids`` ``[N]``, chunk by chunk."""
    pos = 0
    for batch in store.iter_token_ids(size=CHUNK):
        flat = np.concatenate(batch) if batch else np.zeros(0, np.int32)
        ids[pos : pos + len(flat)] = flat
        pos += len(flat)


def _to_npy(store: FeatureStore, out: Path) -> None:
    feats = np.lib.format.open_memmap(out / "features.npy", mode="w+", dtype=store.dtype,
                                      shape=(_flat_rows(store),) + store.feature_shape)
    offsets = _fill(store, feats)
    feats.flush()
    del feats
    if store.level != "sentence":
        np.save(out / "offsets.npy", offsets)
    if store.level == "token":
        ids = np.lib.format.open_memmap(out / "token_ids.npy", mode="w+", dtype=np.int32, shape=(store.num_rows,))
        _fill_token_ids(store, ids)
        ids.flush()
        del ids
    if store.level == "word":  # one JSON list of word lists, written record by record
        with open(out / "words.json", "w", encoding="utf-8") as fh:
            fh.write("[")
            first = True
            for batch in store.iter_words(size=CHUNK):
                for words in batch:
                    fh.write(("" if first else ",\n") + json.dumps(words, ensure_ascii=False))
                    first = False
            fh.write("]\n")
    np.save(out / "lines.npy", store.lines)
    for name in store.columns:
        np.save(out / f"{name}.npy", _column_array(store.column(name)), allow_pickle=False)
    (out / "manifest.json").write_text(json.dumps(store.manifest, indent=2), encoding="utf-8")


def _to_hdf5(store: FeatureStore, out: Path) -> None:
    try:
        import h5py
    except ImportError as exc:  # pragma: no cover - h5py is a dependency
        raise StoreError("export to hdf5 needs h5py: pip install h5py") from exc
    with h5py.File(out, "w") as f:
        feats = f.create_dataset("features", shape=(_flat_rows(store),) + store.feature_shape, dtype=store.dtype,
                                 chunks=True)
        offsets = _fill(store, feats)
        if store.level != "sentence":
            f.create_dataset("offsets", data=offsets)
        if store.level == "token":
            _fill_token_ids(store, f.create_dataset("token_ids", shape=(store.num_rows,), dtype=np.int32))
        if store.level == "word":  # flat, one per row: record i's words are words[offsets[i]:offsets[i+1]]
            words = f.create_dataset("words", shape=(0,), maxshape=(None,), dtype=h5py.string_dtype(),
                                     chunks=(CHUNK,))
            for batch in store.iter_words(size=CHUNK):
                flat = [w for ws in batch for w in ws]
                words.resize((words.shape[0] + len(flat),))
                words[words.shape[0] - len(flat) :] = np.asarray(flat, dtype=object)
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
    import pyarrow.parquet as pq

    sch, batches = record_batches(store, "lists", CHUNK)
    with pq.ParquetWriter(out, sch) as writer:
        for batch in batches:
            writer.write_batch(batch)


# ---- what is at the output path ------------------------------------------------------------------------------
def _export_manifest(out: Path, to: str) -> dict[str, Any] | None:
    """The store manifest that a layerwise ``to`` export at ``out`` carries, or ``None`` if it is not one."""
    try:
        if to == "npy":
            if not (out / "features.npy").is_file():
                return None
            text = (out / "manifest.json").read_text(encoding="utf-8")
        elif to == "hdf5":
            import h5py

            with h5py.File(out, "r") as f:
                if "features" not in f:
                    return None
                text = f.attrs["manifest"]
        else:
            import pyarrow.parquet as pq

            text = (pq.read_schema(out).metadata or {})[b"layerwise_manifest"].decode("utf-8")
        manifest = json.loads(text)
    except Exception:  # noqa: BLE001 - anything unreadable is not ours
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == FORMAT else None


def check_npy_name(out: Path, to: str, store: FeatureStore | None = None) -> None:
    """Refuse an npy export named ``*.npy`` that would be more than one array: a token/word level store's rows need
    their offsets (and ids or words), so its export is a directory of ``.npy`` files. A sentence-level store is one
    array ``[records, *F]``, written as that one file (:func:`export`)."""
    if to == "npy" and out.suffix.lower() == ".npy" and (store is None or store.level != "sentence"):
        other = out.with_name(f"{out.stem}-npy")
        level = f"a {store.level}-level store" if store is not None else "this store"
        raise StoreError(
            f"{str(out)!r} names one array, but {level} exports several (features.npy with its rows, offsets.npy "
            f"where each record's rows start, token ids or words, lines, the kept columns): write them to a "
            f"directory with layerwise export {store.path if store is not None else 'STORE'} --to npy -o {other} "
            f"(then np.load('{other / 'features.npy'}'))"
        )


def _sidecar(out: Path) -> Path:
    """Where a one-array npy export keeps the store manifest it was written from: ``NAME.npy.json``."""
    return out.with_name(out.name + ".json")


def _array_owned(path: Path) -> bool:
    try:
        manifest = json.loads(_sidecar(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


def _to_npy_array(store: FeatureStore, out: Path, overwrite: bool) -> Path:
    """A sentence-level store as the one array ``out`` (``[records, *F]``, ``np.load(out)``), its manifest beside
    it (``NAME.npy.json``: what computed it, and the mark that lets ``overwrite`` replace it)."""
    owned = OwnedOutput(out, "file", "layerwise npy array", owned=_array_owned,
                        marker=f"the store manifest beside it ({_sidecar(out).name})", error=StoreError)
    owned.check(overwrite)

    def write(staged: Path) -> None:
        feats = np.lib.format.open_memmap(staged, mode="w+", dtype=store.dtype,
                                          shape=(len(store),) + store.feature_shape)
        _fill(store, feats)
        feats.flush()
        del feats

    done = owned.write(write, overwrite=overwrite)
    _sidecar(out).write_text(json.dumps(store.manifest, indent=2), encoding="utf-8")
    return done


def owned_output(out: Path, to: str) -> OwnedOutput:
    """The export at ``out`` as an :class:`~layerwise.outputs.OwnedOutput`: its marker is the store manifest it
    carries; an npy directory's own entries are the files that export wrote."""
    return OwnedOutput(
        out, "directory" if to == "npy" else "file", f"layerwise {to} export",
        owned=lambda path: _export_manifest(path, to) is not None,
        marker={"npy": "manifest.json of a layerwise export", "hdf5": "layerwise manifest attribute",
                "parquet": "layerwise_manifest schema metadata"}[to],
        own_entries=lambda path: _npy_files(_export_manifest(path, "npy") or {}), error=StoreError,
    )


def check_output(out: Path, to: str, overwrite: bool) -> None:
    """Refuse an output that layerwise did not write, even with ``overwrite``; refuse replacing its own export
    without ``overwrite``. An absent path (or an empty directory for ``npy``) is free."""
    owned_output(out, to).check(overwrite)


def _check_columns(store: FeatureStore, to: str) -> None:
    """A kept column may not take the name of a file (npy) or column (parquet) the export writes itself."""
    own = {"npy": _NPY_OWN, "parquet": _PARQUET_OWN}.get(to, ())
    clash = [c for c in store.columns if c in own]
    if clash:
        where = f"{clash[0]}.npy" if to == "npy" else f"the column {clash[0]!r}"
        raise StoreError(
            f"the store kept a column named {clash[0]!r}, which would collide with {where} of the {to} export "
            f"itself; export to hdf5 (kept columns live under columns/) or extract with another column name"
        )


def _npy_files(manifest: dict[str, Any]) -> list[str]:
    """The files an npy export of the store with ``manifest`` wrote."""
    keep = (manifest.get("input") or {}).get("keep") or []
    return [f"{n}.npy" for n in ("features", "offsets", "token_ids", "lines", *keep)] + ["words.json", "manifest.json"]


def export(
    store: FeatureStore | str | os.PathLike, out: str | os.PathLike, *, to: str, overwrite: bool = False
) -> Path:
    """Write ``store`` to ``out`` as ``npy`` (a directory; or, for a sentence-level store and ``out`` named
    ``*.npy``, that one array ``[records, *F]`` with the manifest beside it as ``NAME.npy.json``), ``hdf5`` or
    ``parquet``; returns ``out``.

    ``overwrite`` replaces an earlier layerwise export at ``out``; anything else there is never replaced (a
    ``StoreError`` names the path). Everything is checked before anything is written, the store's every shard
    by its sha256 too (an export never carries damaged bytes into files that no longer say where they came from).

    Raises:
        StoreError: an unknown format, an npy output named ``*.npy`` for a token/word level store (its export is a
            directory: the message says the command), or an output that is not an earlier layerwise export.
        StoreCorruptError: the store is damaged (naming the file).
    """
    if to not in EXPORT_FORMATS:
        raise StoreError(f"unknown export format {to!r}. Valid formats are: {', '.join(EXPORT_FORMATS)} (and "
                         f"sae-lens for a token-activation store)")
    out = Path(out)
    if not isinstance(store, FeatureStore):
        store = FeatureStore(store)
    check_npy_name(out, to, store)
    if to == "npy" and out.suffix.lower() == ".npy":  # a sentence-level store: one array
        store.verify(raise_on_damage=True)
        return _to_npy_array(store, out, overwrite)
    check_output(out, to, overwrite)
    store.verify(raise_on_damage=True)
    _check_columns(store, to)
    writer = {"npy": _to_npy, "hdf5": _to_hdf5, "parquet": _to_parquet}[to]
    return owned_output(out, to).write(lambda staged: writer(store, staged), overwrite=overwrite)
