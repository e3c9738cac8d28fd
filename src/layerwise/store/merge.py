"""Join the part stores of a sharded extraction into one store, in input order, after checking they belong together.

It also compacts a store of parts (a Ray run, :mod:`layerwise.store.parts`) into one plain store:
``merge_stores(["feats"], "feats-compact")``. ``layerwise extract ... --num-shards N --shard-index I`` writes part
``I`` of ``N``: the records whose number in the
input is ``I`` modulo ``N``, each part a complete store of its own whose manifest says ``"part": {"index": I, "of":
N}``. :func:`merge_stores` takes every part and writes one ordinary store, as a plain run would have written it:

* the parts must be complete, all ``N`` of them, each index once, made from the same input (sha256), model
  (weights fingerprint), tokenizer and spec; anything else is refused, naming the part and the difference;
* records are interleaved back by their input line (each part is in line order), so ``store[i]`` is the ``i``-th
  good record of the input, with its features, token ids, words and kept columns;
* the error logs are joined in line order.

Per-shard token counts are not kept per record, so the merged shards share each part shard's count among its
records (the store's total is exact). The merge reads and writes stores only; nothing is recomputed.

Example::

    >>> merge_stores(["feats-0", "feats-1", "feats-2"], "feats")
    MergeSummary(parts=3, records=2997, skipped=3, shards=1)
"""

from __future__ import annotations

import heapq
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np

from ..errors import StoreCorruptError, StoreError
from ..provenance import differences
from .layout import ERRORS, MANIFEST, STORE_DTYPES, atomic_write_bytes, shard_rows
from .manifest import FIX, is_store_manifest, read_manifest
from .parts import is_parted, part_order, write_parts_manifest
from .reader import FeatureStore
from .writer import StoreWriter, identity

MANIFEST_ONLY = ("format", "format_version", "id", "layerwise_version", "created", "updated", "status", "counts",
                 "shards", "part", "parts", "split")
RECORDS_PER_SHARD = 4096


@dataclass
class MergeSummary:
    """What a merge wrote."""

    parts: int
    records: int
    skipped: int
    shards: int


def _header(manifest: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in manifest.items() if k not in MANIFEST_ONLY}


def check_parts(paths: Sequence[str | os.PathLike]) -> list[dict[str, Any]]:
    """The manifests of ``paths`` in part order, after checking they are the ``N`` complete parts of one run.

    Raises:
        StoreError: a path that is not a store, an incomplete part, a part index missing or given twice, or parts
            made with different inputs, models or options (naming the part and the difference).
        StoreCorruptError: a part's manifest is damaged (its shards are checked when the merge opens it).
    """
    if not paths:
        raise StoreError("merge needs the part stores of one sharded run (layerwise extract --num-shards N ...)")
    found: dict[int, tuple[str, dict[str, Any]]] = {}
    total = None
    if len(paths) == 1 and is_parted(read_manifest(paths[0])):  # a store of parts (a Ray run): compacted into one
        manifest = read_manifest(paths[0])
        if manifest.get("status") != "complete":
            raise StoreError(f"{os.fspath(paths[0])!r} is {manifest.get('status')}: rerun its extract command")
        return [manifest | {"path": os.fspath(paths[0])}]
    for path in paths:
        manifest = read_manifest(path)
        part = manifest.get("part")
        if not isinstance(part, dict):
            raise StoreError(f"{os.fspath(path)!r} is a whole store, not a part of a sharded run (no 'part' in its "
                             f"manifest); merge takes the stores written with --num-shards/--shard-index")
        if not (type(part.get("index")) is int and type(part.get("of")) is int and 0 <= part["index"] < part["of"]):
            raise StoreCorruptError(f"{os.fspath(path)!r}: its manifest's 'part' is {part!r}, not an index of a "
                                    f"count; {FIX}", file=os.fspath(Path(path) / "manifest.json"),
                                    problem=f"field 'part' is {part!r}")
        if manifest.get("status") != "complete":
            raise StoreError(f"part {part['index']} ({os.fspath(path)!r}) is {manifest.get('status')}: rerun its "
                             f"extract command to finish it, then merge")
        if total is not None and part["of"] != total:
            raise StoreError(f"{os.fspath(path)!r} is part {part['index']} of {part['of']}, the others of {total}")
        total = int(part["of"])
        if part["index"] in found:
            raise StoreError(f"part {part['index']} is given twice: {found[part['index']][0]!r} and "
                             f"{os.fspath(path)!r}")
        first = next(iter(found.values()), None)
        if first is not None:
            diffs = differences(identity(_header(first[1])), identity(_header(manifest)))
            if diffs:
                raise StoreError(f"{os.fspath(path)!r} does not belong with {first[0]!r}: "
                                 f"{'; '.join(d.replace('store:', 'first part:') for d in diffs)}")
        found[int(part["index"])] = (os.fspath(path), manifest)
    missing = sorted(set(range(total or 0)) - set(found))
    if missing:
        raise StoreError(f"parts {missing} of {total} are missing; give every part of the run")
    return [found[i][1] | {"path": found[i][0]} for i in range(total or 0)]


def _records(store: FeatureStore, path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line, record)`` of one part, in order: features rows, token ids, words, kept columns, its token share."""
    lines = store.lines
    level = store.spec.level
    names = store.columns
    columns = {name: store.column(name) for name in names}
    shards = store.shard_entries
    shares: list[int] = []
    for s in shards:  # a shard's token count shared among its records (exact in total)
        q, r = divmod(int(s["tokens"]), int(s["records"]))
        shares += [q + (1 if k < r else 0) for k in range(int(s["records"]))]
    for i in range(len(store)):
        yield int(lines[i]), {
            "features": store[i],
            "token_ids": store.token_ids(i) if level == "token" else None,
            "words": store.words(i) if level == "word" else None,
            "columns": {name: columns[name][i] for name in names},
            "tokens": shares[i],
            "part": path,
        }


def _shard(batch: list[tuple[int, dict[str, Any]]], level: str, dtype: Any, names: list[str]
           ) -> tuple[dict[str, np.ndarray], dict[str, str], int]:
    tokens = sum(r["tokens"] for _, r in batch)
    feats = [np.asarray(r["features"]) for _, r in batch]
    width = int(np.prod(feats[0].shape[1:] if level != "sentence" else feats[0].shape)) if feats else 0
    tensors, meta = shard_rows(level, [line for line, _ in batch], feats, width, dtype,
                               token_ids=[r["token_ids"] for _, r in batch] if level == "token" else (),
                               words=[r["words"] for _, r in batch] if level == "word" else (),
                               columns={n: [r["columns"][n] for _, r in batch] for n in names}, tokens=tokens)
    return tensors, meta, tokens


def merge_stores(
    parts: Sequence[str | os.PathLike], output: str | os.PathLike, *, overwrite: bool = False,
    records_per_shard: int = RECORDS_PER_SHARD,
) -> MergeSummary:
    """Write the parts of a sharded extraction as one store at ``output``, in input order (see the module docstring).

    Args:
        parts: the part stores (any order).
        output: the merged store's directory (new, or a store of the same run to replace with ``overwrite``).
        overwrite: replace a store made with other options at ``output``.
        records_per_shard: records per shard of the merged store.

    Raises:
        StoreError: parts that do not belong together (see :func:`check_parts`), or an output that is not a new
            directory or a store.
    """
    manifests = check_parts(parts)
    header = _header(manifests[0])
    header.pop("path", None)
    if Path(output).resolve() in {Path(m["path"]).resolve() for m in manifests}:
        raise StoreError(f"the merged store {os.fspath(output)!r} cannot be one of its parts; give a new directory")
    writer = StoreWriter(output, header)
    state = writer.open(overwrite=overwrite)
    if state == "complete":
        writer.close()
        return MergeSummary(len(manifests), writer.done_records, int(writer.manifest["counts"].get("skipped", 0)),
                            len(writer.shards))
    if writer.shards:  # an interrupted merge restarts from nothing: merging is cheap next to extracting
        writer.close()
        writer = StoreWriter(output, header)
        writer.open(overwrite=True)
    try:
        return _merge_into(writer, manifests, output, records_per_shard)
    finally:
        writer.close()


def _merge_into(writer: StoreWriter, manifests: list[dict[str, Any]], output: str | os.PathLike,
                records_per_shard: int) -> MergeSummary:
    """The parts' records, in input order, into the opened (and locked) ``writer``."""
    stores = [FeatureStore(m["path"], verify=True) for m in manifests]  # damaged bytes are never merged in
    level = stores[0].spec.level
    dtype = STORE_DTYPES[stores[0].spec.output_dtype]
    names = stores[0].columns
    merged = heapq.merge(*(_records(s, m["path"]) for s, m in zip(stores, manifests)), key=lambda item: item[0])
    batch: list[tuple[int, dict[str, Any]]] = []
    for item in merged:
        batch.append(item)
        if len(batch) >= records_per_shard:
            tensors, meta, tokens = _shard(batch, level, dtype, names)
            writer.write_shard(tensors, meta, tokens=tokens)
            batch = []
    if batch:
        tensors, meta, tokens = _shard(batch, level, dtype, names)
        writer.write_shard(tensors, meta, tokens=tokens)
    errors = sorted((e for s in stores for e in s.errors), key=lambda e: int(e.get("line", 0)))
    text = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in errors)
    atomic_write_bytes(Path(output) / ERRORS, text.encode("utf-8"))
    writer.write_manifest("complete", len(errors))
    return MergeSummary(len(manifests), writer.done_records, len(errors), len(writer.shards))


def link_parts(parts: Sequence[str | os.PathLike], output: str | os.PathLike, *, overwrite: bool = False
               ) -> MergeSummary:
    """Make ``output`` a store that lists the parts of a sharded run instead of copying them (no merge): its
    manifest (:mod:`layerwise.store.parts`, ``order="lines"``) names each part by its path relative to ``output``,
    and :func:`~layerwise.store.open_store` reads their records interleaved by input line, as :func:`merge_stores`
    would have written them. Keep the parts where they are (move the whole set together).

    Raises:
        StoreError: parts that do not belong together (see :func:`check_parts`), a store of parts given as a part,
            or an ``output`` that holds a store (``overwrite`` replaces a linked one) or other files.
    """
    manifests = check_parts(parts)
    if any(is_parted(m) for m in manifests):
        raise StoreError(f"{manifests[0]['path']!r} is already a store of parts; open it as it is")
    out = Path(output)
    mfile = out / MANIFEST
    if mfile.exists():
        if not is_store_manifest(mfile):
            raise StoreError(f"{str(mfile)!r} is not a layerwise manifest: choose another output directory "
                             f"(layerwise never replaces files it did not write)")
        old = read_manifest(out)
        if not (overwrite and is_parted(old) and part_order(old) == "lines"):
            raise StoreError(f"{os.fspath(output)!r} holds a store already; choose another directory"
                             + ("" if overwrite else ", or pass --overwrite to replace a linked one"))
    elif out.exists() and any(out.iterdir()):
        raise StoreError(f"{os.fspath(output)!r} is a directory with files in it; give a new directory")
    header = _header(manifests[0])
    header.pop("path", None)
    out.mkdir(parents=True, exist_ok=True)
    top = write_parts_manifest(out, header, [m["path"] for m in manifests], order="lines")
    c = top["counts"]
    return MergeSummary(len(manifests), c["records"], c["skipped"], c["shards"])


__all__ = ["MergeSummary", "check_parts", "link_parts", "merge_stores"]
