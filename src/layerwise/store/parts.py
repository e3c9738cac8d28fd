"""A store made of part stores: one directory, one top-level manifest that lists its parts, no merge.

A parallel run (``layerwise extract --engine ray``) writes each part of its input as a complete store of its own,
``STORE/part-NNNNN/``, then the top-level ``STORE/manifest.json`` (``format_version`` 4) that lists them in input
order::

    STORE/
      manifest.json     spec, model, input, feature shape, status, counts, and "parts": [
                          {"path": "part-00000", "records": 9998, "rows": 9998, "tokens": ..., "skipped": 2,
                           "lines": 10000, "line_base": 0, "manifest_sha256": "..."}, ...]
      part-00000/       a store (manifest, shards, errors.jsonl) of the records of the first split
      part-00001/       ...

A part's records are numbered by their line within its split (:mod:`layerwise.corpus.splits`); ``line_base`` is the
count of lines of every part before it, so a record's line in the whole input is ``line_base + line``, the number a
sequential read gives. ``manifest_sha256`` ties each part's manifest (which ties its shards by sha256) to the
top-level one: a part deleted, replaced or changed is named when the store opens (:func:`read_parts`).
:func:`~layerwise.store.open_store` reads such a store as one, in input order, with the same API as any other.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..errors import StoreCorruptError, StoreError
from ..provenance import now, stamp
from .layout import FORMAT, MANIFEST, file_sha256, write_json
from .manifest import read_manifest

PARTS_VERSION = 4  # the format_version of a store of part stores


def part_name(index: int) -> str:
    """The directory of part ``index``: ``part-NNNNN``."""
    return f"part-{index:05d}"


def part_order(manifest: dict[str, Any]) -> str:
    """How a store of parts orders its records: ``parts`` (one part after another) or ``lines`` (interleaved)."""
    return str(manifest.get("order", "parts"))


def is_parted(manifest: dict[str, Any]) -> bool:
    """Whether a (checked) manifest is a store of part stores."""
    return "parts" in manifest


@dataclass(frozen=True)
class Part:
    """One part of a store of parts, opened: its directory, its checked manifest and its first line's base."""

    path: Path
    manifest: dict[str, Any]
    line_base: int


def _damaged(store: Path, entry: dict[str, Any], what: str) -> StoreCorruptError:
    return StoreCorruptError(
        f"store {str(store)!r} is damaged: part {entry['path']} {what}; rerun the extract command to redo the "
        f"missing part (finished parts are kept), or restore it from a copy",
        file=str(store / entry["path"] / MANIFEST), problem=f"{entry['path']}: {what}")


def read_parts(store: Path, manifest: dict[str, Any]) -> list[Part]:
    """The parts a top-level manifest lists, each checked: present, its manifest the listed one (sha256), complete,
    holding the listed records.

    Raises:
        StoreCorruptError: a part missing, changed or replaced, or not complete (naming it and the fix).
    """
    out = []
    for entry in manifest["parts"]:
        path = store / entry["path"]
        mfile = path / MANIFEST
        try:
            got = file_sha256(mfile)
        except FileNotFoundError:
            raise _damaged(store, entry, f"is missing (listed with {entry['records']:,} records)") from None
        if got != entry["manifest_sha256"]:
            raise _damaged(store, entry, f"has manifest sha256 {got[:12]}..., listed with "
                                         f"{entry['manifest_sha256'][:12]}... (the part was replaced or changed)")
        part = read_manifest(path)
        if part.get("status") != "complete" or part["counts"]["records"] != entry["records"]:
            raise _damaged(store, entry, f"holds {part['counts']['records']:,} records ({part.get('status')}), "
                                         f"listed with {entry['records']:,} (complete)")
        out.append(Part(path, part, int(entry["line_base"])))
    return out


def write_parts_manifest(store: str | os.PathLike, header: dict[str, Any], parts: Sequence[str | os.PathLike], *,
                         order: str = "parts") -> dict[str, Any]:
    """Write the top-level manifest of ``store`` listing the complete part stores ``parts``. Returns it.

    ``order="parts"`` (a Ray run): the parts are directories inside ``store``, in input order, each numbering the
    lines of its own split (its manifest's ``split.lines`` says how many). ``order="lines"`` (the parts of
    ``--num-shards N``, linked by ``layerwise merge --link``): any directories, listed by their path relative to
    ``store``, each numbering the whole input's lines; their records are read interleaved by line.

    Raises:
        StoreError: a part that is not complete.
    """
    root = Path(store)
    parts = [os.path.relpath(os.path.abspath(p), os.path.abspath(root)) if order == "lines" else os.fspath(p)
             for p in parts]
    entries, base = [], 0
    counts = {"records": 0, "rows": 0, "tokens": 0, "skipped": 0, "shards": 0, "bytes": 0, "parts": len(parts)}
    for name in parts:
        m = read_manifest(root / name)
        if m.get("status") != "complete":
            raise StoreError(f"part {name} of {str(root)!r} is {m.get('status')}: rerun the extract command")
        c = m["counts"]
        lines = int(m.get("split", {}).get("lines", 0)) if order == "parts" else 0
        entries.append({"path": name, "records": c["records"], "rows": c["rows"], "tokens": c["tokens"],
                        "skipped": c.get("skipped", 0), "lines": lines, "line_base": base,
                        "manifest_sha256": file_sha256(root / name / MANIFEST)})
        base += lines
        for key in ("records", "rows", "tokens", "skipped", "shards", "bytes"):
            counts[key] += int(c.get(key, 0))
    top = {"format": FORMAT, "format_version": PARTS_VERSION, "id": uuid.uuid4().hex, **stamp(),
           "created": now(), "updated": now(), **{k: v for k, v in header.items() if k != "split"},
           "status": "complete", "order": order, "shards": [], "parts": entries, "counts": counts}
    write_json(root / MANIFEST, top)
    return top


__all__ = ["PARTS_VERSION", "Part", "is_parted", "part_name", "part_order",
           "read_parts", "write_parts_manifest"]
