"""Reading a feature store: ``lw.open_store(path)``, memory-mapped, record by record or in chunks.

Example::

    >>> import layerwise as lw
    >>> store = lw.open_store("feats")                       # doctest: +SKIP
    >>> len(store), store.level, store.feature_shape          # doctest: +SKIP
    (20000, 'sentence', (1536,))
    >>> X = store.to_numpy()                                  # [records, D]; one shard: a memory map  # doctest: +SKIP
    >>> y = store.column("label")                             # kept with --keep label  # doctest: +SKIP
    >>> store[3].shape                                        # token/word level: [n_tokens_3, D]  # doctest: +SKIP
    >>> store[0:10].shape                                     # a slice: [10, D]        # doctest: +SKIP
"""

from __future__ import annotations

import bisect
import json
import os
import warnings
from pathlib import Path
from typing import Any, Iterator, overload

import numpy as np

from ..encoding.spec import EncodeSpec
from ..errors import StoreCorruptError, StoreError
from .integrity import Expected, VerifyReport, open_shard, size_problems, unlisted_files, verify_store
from .layout import ERRORS, RESTORE, STORE_DTYPES, ShardFile
from .manifest import read_manifest
from .parts import is_parted, part_order, read_parts
from .rows import StoredRows


class StoreWarning(UserWarning):
    """Something in a store directory that layerwise ignores (shard files its manifest does not list)."""


class _Segment:
    """One store directory whose shards a :class:`FeatureStore` reads (the store itself, or one of its parts), with
    the base its records' lines are counted from."""

    def __init__(self, path: Path, manifest: dict[str, Any], line_base: int):
        self.path, self.manifest, self.line_base = path, manifest, line_base
        self.entries: list[dict[str, Any]] = manifest["shards"]
        self.expected = Expected.of(manifest)


class FeatureStore:
    """A finished (or partly written) feature store, opened read-only.

    The manifest is the truth: exactly the shards it lists are read, in its order. Opening checks the manifest
    and every listed shard's size (a ``stat`` each); a shard's header is checked against the manifest when it is
    first read (its shapes, dtypes, index, store id and first and last line); ``verify=True`` (or
    :meth:`verify`) also checks every byte's sha256. Shard-named files the manifest does not list are ignored
    with a :class:`StoreWarning` naming them. Anything damaged raises :class:`~layerwise.StoreCorruptError`
    naming the file; data is never returned from a shard that failed a check.

    Attributes:
        path: the store directory.
        manifest: the parsed ``manifest.json`` (spec, model, input, counts; see :mod:`layerwise.store.layout`).
        spec: the :class:`~layerwise.EncodeSpec` the features were computed with (layers resolved).
        level: ``sentence``, ``token`` or ``word``.
        feature_shape: ``(D,)``, or ``(K, width)`` for ``combine="stack"``.

    Indexing: ``store[i]`` is record ``i``'s features: ``[*feature_shape]`` at sentence level, else
    ``[n_i, *feature_shape]`` (tokens or words of record ``i``); negative ``i`` counts from the end. Arrays are
    read-only memory maps.

    Slicing: ``store[a:b:step]`` takes Python's slice rules (negative bounds and steps included, out-of-range bounds
    clipped, an empty slice is empty) and reads only the records it names, shard by shard, never the whole store:

    - sentence level: one in-memory ``np.ndarray`` ``[n, *feature_shape]`` (a copy of just those rows);
    - token / word level: a list of ``n`` read-only ``[n_i, *feature_shape]`` arrays, one per record.

    Example::

        >>> store = open_store("feats")                # doctest: +SKIP
        >>> store[0:10].shape, store[::-2].shape       # sentence level      # doctest: +SKIP
        ((10, 384), (5000, 384))
        >>> [x.shape for x in tok_store[:2]]           # token level         # doctest: +SKIP
        [(12, 384), (9, 384)]
    """

    def __init__(self, path: str | os.PathLike, *, verify: bool = False):
        self.path = Path(path)
        self.manifest: dict[str, Any] = read_manifest(self.path)
        self.spec = EncodeSpec.from_dict(self.manifest["spec"])
        self.level: str = self.spec.level
        self.feature_shape: tuple[int, ...] = tuple(self.manifest["feature_shape"])
        # a plain store is one segment; a store of parts one per part (layerwise.store.parts), read in order
        if is_parted(self.manifest):
            self._segments = [_Segment(p.path, p.manifest, p.line_base) for p in read_parts(self.path, self.manifest)]
        else:
            self._segments = [_Segment(self.path, self.manifest, 0)]
        self._entries: list[dict[str, Any]] = []
        self._segment_of: list[int] = []
        for k, seg in enumerate(self._segments):
            self._check_sizes(seg, path)
            self._entries += seg.entries
            self._segment_of += [k] * len(seg.entries)
        if verify:
            self.verify(raise_on_damage=True)
        self._open: dict[int, ShardFile] = {}
        counts = [e["records"] for e in self._entries]
        self._starts = list(np.concatenate([[0], np.cumsum(counts)]).astype(int)) if counts else [0]
        # parts interleaved by line (the parts of --num-shards): record i is flat record _order[i]
        self._order: np.ndarray | None = None
        if is_parted(self.manifest) and part_order(self.manifest) == "lines":
            self._order = self._line_order()

    def _flat_lines(self) -> np.ndarray:
        """The lines of every record in shard order (segments one after another), line bases added."""
        if not self._entries:
            return np.zeros(0, np.int64)
        bases = [self._segments[k].line_base for k in self._segment_of]
        return np.concatenate([self._shard(s).array("lines") + bases[s] for s in range(len(self._entries))])

    def _line_order(self) -> np.ndarray:
        flat = self._flat_lines()
        order = np.argsort(flat, kind="stable")
        in_order = flat[order]
        twice = np.flatnonzero(np.diff(in_order) == 0)
        if len(twice):
            line = int(in_order[twice[0]])
            raise StoreCorruptError(
                f"store {str(self.path)!r} is damaged: line {line} of the input is held by two of its parts; the "
                f"parts are not the disjoint parts of one run: relink them (layerwise merge --link) from the right "
                f"part stores", problem=f"line {line} held twice")
        return order

    @staticmethod
    def _check_sizes(seg: "_Segment", path: str | os.PathLike) -> None:
        problems = size_problems(seg.path, seg.entries)
        if problems:
            raise StoreCorruptError(
                f"store {os.fspath(path)!r} is damaged: {'; '.join(problems[:5])}"
                f"{f' (and {len(problems) - 5} more)' if len(problems) > 5 else ''}; {RESTORE}",
                file=str(seg.path / problems[0].split(":")[0]) if len(problems) == 1 else None,
                problem="; ".join(problems))
        stray = unlisted_files(seg.path, seg.entries)
        if stray:
            warnings.warn(StoreWarning(
                f"store {os.fspath(seg.path)!r}: {len(stray)} shard file(s) not listed in its manifest are ignored: "
                f"{', '.join(stray[:5])}{' ...' if len(stray) > 5 else ''} (a copy, or left by a repaired run; "
                f"delete them once you no longer need them)"), stacklevel=4)

    def _shard(self, s: int) -> ShardFile:
        """Listed shard ``s``, opened and checked against its store's manifest on first use."""
        shard = self._open.get(s)
        if shard is None:
            seg = self._segments[self._segment_of[s]]
            shard = self._open[s] = open_shard(seg.path, self._entries[s], seg.expected)
        return shard

    def _all_shards(self) -> Iterator[ShardFile]:
        return (self._shard(s) for s in range(len(self._entries)))

    def token_loader(self, layer: int | None = None, batch_size: int = 4096, *, shuffle: bool = True, seed: int = 0,
                     start: int = 0, epoch: int = 0, dtype: str = "float32", drop_last: bool = False) -> Any:
        """A token-level store's rows (its special tokens' included) as torch batches ``[batch, W]``: a global
        token-level shuffle across every shard, deterministic for ``seed``, resumable from batch ``start``, read by
        memory map (:class:`~layerwise.store.token_loader.TokenLoader`; the token activations of
        ``extract --context-size`` are read the same way:
        :meth:`~layerwise.store.activations.ActivationStore.token_loader`).

        Args:
            layer: for a ``combine="stack"`` store, the model layer to read (one of ``spec.layer_indices``); else
                ``None`` (the stored feature).
            batch_size, shuffle, seed, start, epoch, drop_last: as in :class:`TokenLoader`.
            dtype: ``float32`` or ``stored``.

        Raises:
            StoreError: not a token-level store, a layer the store does not hold, an integer or binary store.
        """
        from .token_loader import RowSource, TokenLoader

        if self.level != "token":
            raise StoreError(f"token_loader reads token-level stores; this one is {self.level!r} level (extract with "
                             f"--level token, or --context-size N for contexts as SAE trainers cut them)")
        if self.spec.output_dtype not in ("float32", "float16"):
            raise StoreError(f"token_loader reads float32 and float16 stores, not {self.spec.output_dtype!r}")
        stored = tuple(self.spec.layer_indices)
        if self.spec.combine == "stack":
            if layer not in stored:
                raise StoreError(f"layer {layer!r} is not in this store: give one of {list(stored)} (a stack)")
            pick = stored.index(layer)
        elif layer is not None and not (len(stored) == 1 and layer == stored[0]):
            raise StoreError(f"this store holds one feature ({self.spec.combine} of layers {list(stored)}): give "
                             f"layer=None")
        sources = []
        for shard in self._all_shards():
            values = shard.array("features")
            if self.spec.combine == "stack":
                values = values.reshape(len(values), len(stored), -1)[:, pick]
            sources.append(RowSource(values, None, shard.array("token_ids")))
        return TokenLoader(sources, self.spec.output_dtype, batch_size, shuffle=shuffle, seed=seed, epoch=epoch,
                           start=start, out_dtype=dtype, drop_last=drop_last)

    def verify(self, raise_on_damage: bool = False) -> VerifyReport:
        """Check every listed shard's sha256 and inner consistency (see :func:`layerwise.store.verify_store`).

        Raises:
            StoreCorruptError: with ``raise_on_damage``, when anything is damaged (naming every problem).
        """
        report = verify_store(self.path)
        if raise_on_damage and not report.ok:
            raise StoreCorruptError(f"store {str(self.path)!r} is damaged: {'; '.join(report.problems)}; {RESTORE}",
                                    problem="; ".join(report.problems))
        return report

    # ---- sizes and facts ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def complete(self) -> bool:
        return self.manifest.get("status") == "complete"

    @property
    def dtype(self) -> np.dtype:
        """The dtype of the features on disk (``binary``: packed sign bits as int8, ``ubinary`` as uint8)."""
        return np.dtype(STORE_DTYPES[self.spec.output_dtype])

    @property
    def model(self) -> dict:
        """The model the features came from: ``name``, ``fingerprint`` (weights sha256), ``family``, ``num_layers``."""
        return dict(self.manifest["model"])

    @property
    def shard_entries(self) -> list[dict[str, Any]]:
        """The manifest entries of every shard read, in order (a store of parts: its parts' shards)."""
        return list(self._entries)

    @property
    def num_shards(self) -> int:
        return len(self._entries)

    @property
    def num_rows(self) -> int:
        """Feature rows on disk: records (sentence level), tokens or words."""
        return sum(e["rows"] for e in self._entries)

    @property
    def nbytes(self) -> int:
        return sum(e["bytes"] for e in self._entries)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"FeatureStore({str(self.path)!r}, records={len(self)}, level={self.level!r}, "
            f"feature_shape={self.feature_shape}, layers={list(s.layer_indices)}, combine={s.combine!r}, "
            f"dtype={s.output_dtype})"
        )

    def _repr_html_(self) -> str:
        """The manifest in brief for notebooks: records, level, shape, spec, model, counts, integrity."""
        from ..display import card

        m, s = self.manifest, self.spec
        counts = m.get("counts") or {}
        parts = m.get("parts")
        fields = [("path", self.path), ("status", m.get("status")), ("records", f"{len(self):,}"),
                  ("level", self.level), ("feature shape", self.feature_shape), ("dtype", s.output_dtype),
                  ("layers", list(s.layer_indices)), ("combine / pool", f"{s.combine} / {s.pool or s.subword}"),
                  ("model", f"{self.model.get('name')} ({self.model.get('precision')})"),
                  ("input", f"{m['input'].get('path')} ({m['input'].get('format')})"),
                  ("skipped records", f"{counts.get('skipped', 0):,}"), ("kept columns", self.columns or "-"),
                  ("shards / bytes", f"{self.num_shards} / {self.nbytes:,}")]
        if parts is not None:
            fields.append(("parts", f"{len(parts)} ({m.get('order', 'parts')} order)"))
        fields.append(("integrity", "every listed shard present with its size (verify() checks every sha256)"))
        return card("FeatureStore", fields)

    # ---- access -----------------------------------------------------------------------------------------
    def _locate(self, i: int) -> tuple[ShardFile, int]:
        n = len(self)
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(
                f"store index must be an int or a slice (store[3], store[0:10]), got {type(i).__name__}; "
                f"iter_chunks() streams the whole store"
            )
        if not -n <= i < n:
            raise IndexError(f"record {i} out of range: the store holds {n} records")
        i = int(i) % n
        if self._order is not None:
            i = int(self._order[i])
        s = bisect.bisect_right(self._starts, i) - 1
        return self._shard(s), i - self._starts[s]

    def _rows(self, shard: ShardFile, lo: int, hi: int) -> np.ndarray:
        """Features of records ``lo:hi`` of one shard: ``[hi - lo, *F]`` or flat rows of those records."""
        feats = shard.array("features")
        if self.level == "sentence":
            return feats[lo:hi].reshape((hi - lo,) + self.feature_shape)
        off = shard.array("offsets")
        return feats[off[lo] : off[hi]].reshape((-1,) + self.feature_shape)

    @overload
    def __getitem__(self, i: int) -> np.ndarray: ...

    @overload
    def __getitem__(self, i: slice) -> np.ndarray | list[np.ndarray]: ...

    def __getitem__(self, i: int | slice) -> np.ndarray | list[np.ndarray]:
        """Record ``i``; a slice gives ``[n, *F]`` (sentence level) or a list of ``[n_i, *F]`` (token/word level)."""
        if isinstance(i, slice):
            return self._slice(i)
        shard, j = self._locate(i)
        return self._rows(shard, j, j + 1)[0] if self.level == "sentence" else self._rows(shard, j, j + 1)

    def _slice(self, sl: slice) -> np.ndarray | list[np.ndarray]:
        """Records of a slice, read shard by shard (only the records it names, of the shards it touches)."""
        wanted = np.arange(*sl.indices(len(self)), dtype=np.int64)
        if self._order is not None:
            wanted = self._order[wanted]
        shard_of = np.searchsorted(np.asarray(self._starts), wanted, side="right") - 1
        if self.level == "sentence":
            out = np.empty((len(wanted),) + self.feature_shape, dtype=self.dtype)
            for s in np.unique(shard_of):  # one fancy-indexed read per shard touched
                at = np.flatnonzero(shard_of == s)
                feats = self._shard(int(s)).array("features")
                out[at] = feats[wanted[at] - self._starts[s]].reshape((len(at),) + self.feature_shape)
            return out
        picked = []
        for r, s in zip(wanted.tolist(), shard_of.tolist()):
            j = r - int(self._starts[s])
            picked.append(self._rows(self._shard(s), j, j + 1))
        return picked

    def __iter__(self) -> Iterator[np.ndarray]:
        for batch in self.iter_chunks():
            yield from batch

    def iter_chunks(self, size: int = 4096) -> Iterator[np.ndarray | list[np.ndarray]]:
        """Records in order, ``size`` at a time: ``[n, *F]`` arrays (sentence) or lists of ``[n_i, *F]``."""
        if self._order is not None:
            for lo, hi in self._ordered_ranges(size):
                yield self._slice(slice(lo, hi))
            return
        for shard, lo, hi in self._chunk_ranges(size):
            if self.level == "sentence":
                yield self._rows(shard, lo, hi)
            else:
                off = shard.array("offsets")
                feats = shard.array("features")
                yield [feats[off[r] : off[r + 1]].reshape((-1,) + self.feature_shape) for r in range(lo, hi)]

    def to_numpy(self, *, mmap: bool | None = None) -> np.ndarray:
        """All sentence vectors as one array ``[records, *F]`` (sentence level only).

        Where the store's layout allows, the array is a read-only memory map of the features on disk (no copy, no
        memory taken until rows are read): a store whose records are all in one shard file, in order (a store of
        up to ``shard_records`` records, or one compacted into one shard). A store of several shard files cannot be
        one map of them: its rows are copied into one in-memory array (the store's size in memory).

        Args:
            mmap: ``None`` (default): a map where the layout allows, else a copy. ``True``: a map, or
                :class:`~layerwise.StoreError` saying why not and what to do instead. ``False``: always a writable
                in-memory copy.

        Raises:
            StoreError: a token/word-level store (ragged; use :meth:`ragged`), or ``mmap=True`` on a store of
                several shards.
        """
        if self.level != "sentence":
            raise StoreError(
                f"to_numpy() gives one row per record, but this store is {self.level}-level (ragged); use "
                f"store[i], iter_chunks(), or ragged() for (flat rows [N, *F], offsets [records + 1])"
            )
        if mmap not in (None, True, False):
            raise StoreError(f"to_numpy(mmap=...) takes None, True or False, got {mmap!r}")
        if not self._entries:
            return np.zeros((0,) + self.feature_shape, dtype=self.dtype)
        mappable = len(self._entries) == 1 and self._order is None
        if mmap is True and not mappable:
            raise StoreError(
                f"to_numpy(mmap=True): store {str(self.path)!r} holds its {len(self):,} records in "
                f"{len(self._entries)} shard files, and one array over several files cannot be a memory map. Export "
                f"it once to one file and map that (layerwise export {str(self.path)} -o feats --format npy; then "
                f"np.load('feats/features.npy', mmap_mode='r')), read it in chunks (iter_chunks()), or take a copy "
                f"(to_numpy())"
            )
        if mappable and mmap is not False:
            shard = self._shard(0)
            return self._rows(shard, 0, int(shard.shape("lines")[0]))  # read-only np.memmap, no copy
        out = np.empty((len(self),) + self.feature_shape, dtype=self.dtype)
        at = 0
        for s in range(len(self._entries)):  # straight into the result: the store's size in memory, once
            shard = self._shard(s)
            n = int(shard.shape("lines")[0])
            out[at : at + n] = self._rows(shard, 0, n)
            at += n
            self._open.pop(s, None)  # its pages leave with it
        return out if self._order is None else out[self._order]

    def to_arrow(self) -> Any:
        """The store as a ``pyarrow.Table``, one row per record: ``line``, kept columns, ``token_ids``/``words``,
        ``features`` as ``arrow.fixed_shape_tensor`` ``[*F]`` (a list of them at token/word level); the manifest is
        the schema metadata ``layerwise_manifest``. See :mod:`layerwise.store.arrow`."""
        from .arrow import to_arrow

        return to_arrow(self)

    def to_dataset(self, path: str | os.PathLike | None = None) -> Any:
        """The store as a Hugging Face ``datasets.Dataset`` (columns as :meth:`to_arrow`, features as nested
        fixed-size lists; ``ds.with_format("numpy")``), streamed in chunks to an Arrow file and memory-mapped from
        it, so memory stays bounded whatever the store's size: at ``path``, or without it a temporary file removed
        when the process exits. Needs ``pip install 'layerwise[hf]'``."""
        from .arrow import to_dataset

        return to_dataset(self, None if path is None else os.fspath(path))

    def ragged(self) -> tuple[np.ndarray, np.ndarray]:
        """Token/word level: ``(rows [N, *F], offsets [records + 1])``.

        Record ``i`` is ``rows[offsets[i]:offsets[i+1]]``.
        """
        if self.level == "sentence":
            raise StoreError("ragged() is for token- and word-level stores; use to_numpy() at sentence level")
        if self._order is not None:
            records = [r for chunk in self.iter_chunks() for r in chunk]
            sizes = np.array([0] + [len(r) for r in records], dtype=np.int64)
            flat_rows = (np.concatenate(records) if records else np.zeros((0,) + self.feature_shape, dtype=self.dtype))
            return flat_rows, np.cumsum(sizes)
        offsets = self.record_offsets()
        base = int(offsets[-1])
        # one array filled shard by shard, each shard's mapped features let go once copied: the copy is what the
        # caller holds, and the mapped pages would stay resident beside it (twice the features in memory)
        flat = np.empty((base,) + self.feature_shape, dtype=self.dtype)
        at = 0
        for s in self._all_shards():
            part = s.array("features").reshape((-1,) + self.feature_shape)
            flat[at : at + len(part)] = part
            at += len(part)
            del part
            s.forget("features")
        return flat, offsets

    def record_offsets(self) -> np.ndarray:
        """Token/word level, records in their shards' order: ``[records + 1]``, record ``i``'s rows being
        ``offsets[i]:offsets[i + 1]`` of :meth:`ragged`'s rows and of :meth:`rows` (no feature is read)."""
        if self.level == "sentence" or self._order is not None:
            raise StoreError("record_offsets() is for token- and word-level stores whose records are in their shards' "
                             "order; use ragged()")
        offsets, base = [np.zeros(1, dtype=np.int64)], 0
        for s in self._all_shards():
            off = s.array("offsets")
            offsets.append(off[1:] + base)
            base += int(off[-1])
        return np.concatenate(offsets)

    def rows(self) -> StoredRows:
        """Every feature row ``[N, *F]`` (records at sentence level, the tokens or words of every record otherwise,
        in order) read on demand: indexed like an array (``rows[a:b]``, ``rows[indices]``), giving torch tensors,
        never held whole (:class:`~layerwise.store.rows.StoredRows`).

        Raises:
            StoreError: the store's records are not in its shards' order (read it with :meth:`ragged` or
                :meth:`to_numpy`).
        """
        if self._order is not None:
            raise StoreError("this store's records are not in its shards' order; read its rows with ragged() (token "
                             "or word level) or to_numpy() (sentence level)")
        return StoredRows(list(self._all_shards()), self.level, tuple(self.feature_shape), self.dtype)

    @property
    def lines(self) -> np.ndarray:
        """``[records]``: the input line each record came from."""
        flat = self._flat_lines()
        return flat if self._order is None else flat[self._order]

    @property
    def columns(self) -> list[str]:
        """Names of the columns kept with ``--keep``."""
        return list(self.manifest["input"].get("keep", []))

    def column(self, name: str) -> list:
        """The values of a kept column, one per record."""
        if name not in self.columns:
            raise KeyError(f"column {name!r} was not kept; this store kept {self.columns} (extract with --keep {name})")
        out: list = []
        for s in self._all_shards():
            values = s.json_meta("columns", {})
            if not isinstance(values, dict) or not isinstance(values.get(name), list):
                raise StoreCorruptError(f"store {str(self.path)!r}: shard {s.path.name} does not hold the kept column "
                                        f"{name!r}; {RESTORE}", file=str(s.path), problem=f"no column {name!r}")
            out.extend(values[name])
        return out if self._order is None else [out[j] for j in self._order.tolist()]

    def token_ids(self, i: int) -> np.ndarray:
        """Token level: the tokenizer ids of record ``i``'s rows (special tokens included)."""
        if self.level != "token":
            raise StoreError("token_ids() exists for token-level stores only")
        shard, j = self._locate(i)
        off = shard.array("offsets")
        return shard.array("token_ids")[off[j] : off[j + 1]]

    def words(self, i: int) -> list[str]:
        """Word level: the words of record ``i`` (one feature row each)."""
        if self.level != "word":
            raise StoreError("words() exists for word-level stores only")
        shard, j = self._locate(i)
        return list(shard.json_meta("words")[j])

    def iter_token_ids(self, size: int = 4096) -> Iterator[list[np.ndarray]]:
        """Token level: records' token ids, ``size`` records at a time, in the chunks of :meth:`iter_chunks`."""
        if self.level != "token":
            raise StoreError("iter_token_ids() exists for token-level stores only")
        if self._order is not None:
            for lo, hi in self._ordered_ranges(size):
                yield [self.token_ids(i) for i in range(lo, hi)]
            return
        for shard, lo, hi in self._chunk_ranges(size):
            off, ids = shard.array("offsets"), shard.array("token_ids")
            yield [ids[off[r] : off[r + 1]] for r in range(lo, hi)]

    def iter_words(self, size: int = 4096) -> Iterator[list[list[str]]]:
        """Word level: records' word lists, ``size`` records at a time, in the chunks of :meth:`iter_chunks`."""
        if self.level != "word":
            raise StoreError("iter_words() exists for word-level stores only")
        if self._order is not None:
            cache: dict[int, list[list[str]]] = {}  # one parse per shard
            for lo, hi in self._ordered_ranges(size):
                chunk = []
                for flat in self._order[lo:hi].tolist():
                    s = bisect.bisect_right(self._starts, flat) - 1
                    if s not in cache:
                        cache[s] = self._shard(s).json_meta("words")
                    chunk.append(list(cache[s][flat - self._starts[s]]))
                yield chunk
            return
        parsed: tuple[ShardFile, list[list[str]]] | None = None
        for shard, lo, hi in self._chunk_ranges(size):
            if parsed is None or parsed[0] is not shard:  # one parse per shard
                parsed = (shard, shard.json_meta("words"))
            yield parsed[1][lo:hi]

    def _ordered_ranges(self, size: int) -> Iterator[tuple[int, int]]:
        """``(lo, hi)``: record ranges of ``size`` in store order (parts interleaved by line)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise StoreError(f"chunk size must be a positive int, got {size!r}")
        for lo in range(0, len(self), size):
            yield lo, min(len(self), lo + size)

    def _chunk_ranges(self, size: int) -> Iterator[tuple[ShardFile, int, int]]:
        """``(shard, lo, hi)``: the record ranges of :meth:`iter_chunks`, shard by shard. Each shard is let go
        once its records are passed, so its mapped pages leave memory with the last chunk that
        holds them (a pass over the store holds about one shard's pages, not the whole store's); the next read of
        it opens it again (its header checked again: a small read)."""
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise StoreError(f"chunk size must be a positive int, got {size!r}")
        for s in range(len(self._entries)):
            shard = self._shard(s)
            n = int(shard.shape("lines")[0])
            for lo in range(0, n, size):
                yield shard, lo, min(n, lo + size)
            self._open.pop(s, None)

    @property
    def errors(self) -> list[dict]:
        """Records skipped during extraction: ``[{"line": ..., "reason": ...}, ...]``."""
        out = []
        for seg in self._segments:
            for entry in _read_errors(seg.path / ERRORS):
                if seg.line_base and isinstance(entry.get("line"), int):
                    entry["line"] += seg.line_base
                out.append(entry)
        if self._order is not None:  # parts interleaved by line: their logs too
            out.sort(key=lambda e: int(e["line"]) if isinstance(e.get("line"), int) else 0)
        return out


def _read_errors(path: Path) -> list[dict]:
    """The entries of one ``errors.jsonl`` (none when it is absent)."""
    if not path.exists():
        return []
    out = []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        try:
            entry = json.loads(line) if line.strip() else None
        except json.JSONDecodeError as exc:
            raise StoreCorruptError(f"{str(path)!r} is damaged: line {number} is not JSON ({exc}); restore it "
                                    f"from a copy or rerun the extract command", file=str(path),
                                    problem=f"line {number} is not JSON") from exc
        if entry is not None:
            out.append(entry)
    return out


def open_store(path: str | os.PathLike, *, verify: bool = False) -> FeatureStore:
    """Open the feature store at ``path`` (see :class:`FeatureStore`): its manifest and every listed shard's size
    are checked; with ``verify=True`` every shard's sha256 too (one read of the whole store).

    Raises:
        StoreError: ``path`` is not a layerwise store.
        StoreCorruptError: the manifest or a listed shard is damaged (naming the file, what is wrong, the fix).
    """
    return FeatureStore(path, verify=verify)
