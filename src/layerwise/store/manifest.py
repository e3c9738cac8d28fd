"""A store's manifest, read and checked: the single source of truth about which shards a store holds.

Every reader, the writer's resume, ``merge``, ``inspect`` and ``verify`` read the manifest through
:func:`read_manifest`, which checks every field they rely on. What can go wrong, and what it raises:

* no ``manifest.json``: :class:`~layerwise.StoreError` (not a store);
* a ``manifest.json`` that is not a layerwise store's (another program's file of the same name):
  :class:`~layerwise.StoreError` naming the file and what it holds; layerwise never replaces it;
* a damaged one (not JSON, ``null``, a key missing, a wrong type, an unknown ``format_version``, shards out of
  order or listed twice, counts that do not add up): :class:`~layerwise.StoreCorruptError` naming the file, the
  field and the fix.

Format 3 lists every shard with its sha256 and the store with an ``id`` (written into each shard's metadata with
the shard's index); format 2 (layerwise before 0.12) lists sizes only and still opens.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from ..encoding.spec import EncodeSpec
from ..errors import LayerwiseError, StoreCorruptError, StoreError
from .layout import FORMAT, MANIFEST, PART_RE, READABLE_VERSIONS, SHARD_RE, read_json
from .lock import lock_state

STATUSES = ("running", "partial", "complete")
PART_ORDERS = ("parts", "lines")  # a store of parts: parts one after another (a Ray run), or interleaved by line
FIX = ("run layerwise recover on the store to rebuild manifest.json from its shards (or restore it from a copy)")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def read_manifest(store: str | os.PathLike) -> dict[str, Any]:
    """The checked manifest of the store directory ``store`` (see the module docstring).

    Raises:
        StoreError: no manifest, or a manifest that is not a layerwise store's.
        StoreCorruptError: a damaged manifest (naming the file, the field and the fix).
    """
    mpath = Path(store) / MANIFEST
    if Path(store).is_file():
        raise StoreError(f"not a store: {os.fspath(store)!r} is a file, and a layerwise store is a directory; make one "
                         f"from it with layerwise extract {os.fspath(store)} -o STORE")
    if not mpath.is_file():
        raise StoreError(f"{os.fspath(store)!r} is not a layerwise store (no {MANIFEST}); {without_manifest(store)}")
    manifest = read_json(mpath)
    check_manifest(manifest, mpath)
    return manifest


def without_manifest(store: str | os.PathLike) -> str:
    """What to do with a directory that has no manifest: wait for the run writing it (its lock names it), finish a
    run on Ray whose parts are there (``part-NNNNN``: the same command resumes it), rebuild it from the shard files it
    holds (``layerwise recover``), or create a store with ``layerwise extract``."""
    try:
        names = [p.name for p in Path(store).iterdir()]
    except OSError:
        names = []
    shards = sum(1 for name in names if SHARD_RE.match(name))
    parts = sorted(name for name in names if PART_RE.match(name))
    lock = lock_state(store)
    if lock is not None and lock.live:
        return f"{lock.describe()}; look again once it is done"
    if parts:
        shown = ", ".join(parts[:3]) + (" ..." if len(parts) > 3 else "")
        return (f"it holds {len(parts)} finished or started part(s) of a run on Ray ({shown}) and the run stopped "
                f"before writing the store's manifest: rerun the same layerwise extract --engine ray command to finish "
                f"it (finished parts are kept)")
    if shards:
        return (f"it holds {shards} shard file(s): layerwise recover {os.fspath(store)} rebuilds the manifest from "
                f"them")
    return "create one with layerwise extract"


def is_store_manifest(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a ``manifest.json`` that layerwise wrote (a JSON object whose ``format`` is a store's),
    damaged or not: the marker that lets ``--overwrite`` replace a directory."""
    try:
        raw = Path(path).read_bytes()
    except OSError:
        return False
    try:
        data = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # cut short or garbled: ours if it opens as layerwise writes it
        return raw.lstrip().startswith(b"{") and f'"format": "{FORMAT}"'.encode() in raw[:200]
    return isinstance(data, dict) and data.get("format") == FORMAT


def _int(value: Any, least: int) -> bool:
    return type(value) is int and value >= least


ACTIVATIONS = "layerwise-activations"  # a token-activation store's manifest (layerwise.store.activations)


def check_manifest(m: Any, mpath: Path) -> None:
    """Check a parsed manifest (see :func:`read_manifest`); ``mpath`` names it in the errors."""

    def bad(field: str, what: str) -> StoreCorruptError:
        return StoreCorruptError(f"{str(mpath)!r} is damaged: {field} {what}; {FIX}")

    if not isinstance(m, dict):
        raise bad("the manifest", f"holds {json.dumps(m)[:40]} instead of a JSON object")
    if m.get("format") == ACTIVATIONS:
        raise StoreError(f"{str(mpath.parent)!r} is a token-activation store (layerwise extract --context-size), not a "
                         f"feature store: open it with lw.open_activations({str(mpath.parent)!r}) and read it with its "
                         f"token_loader(layer, batch_size)")
    if m.get("format") != FORMAT:
        raise StoreError(f"{str(mpath)!r} is not a layerwise store manifest (its format is {m.get('format')!r}, not "
                         f"{FORMAT!r}); layerwise reads and replaces only its own stores: choose another directory")
    version = m.get("format_version")
    if version not in READABLE_VERSIONS:
        raise StoreCorruptError(f"{str(mpath)!r} is store format {version!r}; this layerwise reads formats "
                                f"{', '.join(map(str, READABLE_VERSIONS))}. Extract it again with this version (the "
                                f"same command, with --overwrite), or open it with the layerwise that wrote it")
    for key, kind in (("spec", dict), ("model", dict), ("input", dict), ("shards", list), ("feature_shape", list)):
        if not isinstance(m.get(key), kind):
            raise bad(f"field {key!r}", "is missing" if key not in m else f"is {m[key]!r}, not a {kind.__name__}")
    try:
        EncodeSpec.from_dict(m["spec"])
    except (LayerwiseError, TypeError) as exc:
        raise bad("field 'spec'", f"does not describe a spec ({exc})") from exc
    if not m["feature_shape"] or not all(_int(d, 1) for d in m["feature_shape"]):
        raise bad("field 'feature_shape'", f"is {m['feature_shape']!r}, not a list of positive ints")
    if m.get("status") not in STATUSES:
        raise bad("field 'status'", f"is {m.get('status')!r}, not one of {', '.join(STATUSES)}")
    if not isinstance(m["model"].get("name"), str):
        raise bad("field 'model.name'", f"is {m['model'].get('name')!r}, not a string")
    if version >= 3 and not isinstance(m.get("id"), str):
        raise bad("field 'id'", f"is {m.get('id')!r}, not the store's id string")
    seen: set[str] = set()
    last = 0
    for i, e in enumerate(m["shards"]):
        where = f"shards[{i}]"
        if not isinstance(e, dict):
            raise bad(f"field '{where}'", f"is {e!r}, not an object")
        if not isinstance(e.get("file"), str) or not SHARD_RE.match(e["file"]) or e["file"] in seen:
            raise bad(f"field '{where}.file'", f"is {e.get('file')!r}: not a shard name, or listed twice")
        seen.add(e["file"])
        for key, least in (("records", 1), ("rows", 0), ("tokens", 0), ("first_line", 0), ("last_line", 0),
                           ("bytes", 8)):
            if not _int(e.get(key), least):
                raise bad(f"field '{where}.{key}'", f"is {e.get(key)!r}, not an int >= {least}")
        if (i and e["first_line"] <= last) or e["last_line"] < e["first_line"]:
            raise bad(f"field '{where}'", f"covers lines {e['first_line']}..{e['last_line']}, out of order "
                                           f"after line {last}")
        last = e["last_line"]
        if version >= 3 and not (isinstance(e.get("sha256"), str) and _SHA256.match(e["sha256"])):
            raise bad(f"field '{where}.sha256'", f"is {e.get('sha256')!r}, not a sha256")
    counts = m.get("counts")
    if counts is not None and not isinstance(counts, dict):
        raise bad("field 'counts'", f"is {counts!r}, not an object")
    listed = sum(e["records"] for e in m["shards"])
    if version >= 4:
        listed = check_parts_entries(m, bad)
    if counts and counts.get("records", listed) != listed:
        raise bad("field 'counts.records'", f"is {counts.get('records')!r}, but the shards list {listed} records")


def shard_counts(shards: list[dict[str, Any]], skipped: int) -> dict[str, int]:
    """The manifest's ``counts`` of the listed ``shards`` and ``skipped`` records."""
    return {"records": sum(s["records"] for s in shards), "rows": sum(s["rows"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards), "skipped": skipped, "shards": len(shards),
            "bytes": sum(s["bytes"] for s in shards)}


def check_parts_entries(m: dict[str, Any], bad: Any) -> int:
    """Check a format-4 manifest's ``parts`` list (``bad(field, what)`` builds the error); returns its records."""
    parts = m.get("parts")
    if not isinstance(parts, list):
        raise bad("field 'parts'", f"is {parts!r}, not a list")
    if m["shards"]:
        raise bad("field 'shards'", "lists shards in a store of parts (its parts hold them)")
    order = m.get("order", "parts")
    if order not in PART_ORDERS:
        raise bad("field 'order'", f"is {order!r}, not one of {', '.join(PART_ORDERS)}")
    base = 0
    for i, e in enumerate(parts):
        where = f"parts[{i}]"
        path = e.get("path") if isinstance(e, dict) else None
        if not isinstance(path, str) or not path or os.path.isabs(path) or (
                order == "parts" and not PART_RE.match(path)):
            raise bad(f"field '{where}'", f"is {e!r}, not a part entry (a path relative to the store)")
        for key in ("records", "rows", "tokens", "skipped", "lines", "line_base"):
            if type(e.get(key)) is not int or e[key] < 0:
                raise bad(f"field '{where}.{key}'", f"is {e.get(key)!r}, not an int >= 0")
        if order == "lines":  # parts of one input interleaved by line: each numbers the whole input's lines
            if e["line_base"]:
                raise bad(f"field '{where}.line_base'", f"is {e['line_base']}, not 0 (parts interleaved by line)")
        elif e["line_base"] != base:
            raise bad(f"field '{where}.line_base'", f"is {e['line_base']}, but the parts before it cover {base} lines")
        base += e["lines"]
        if not isinstance(e.get("manifest_sha256"), str) or len(e["manifest_sha256"]) != 64:
            raise bad(f"field '{where}.manifest_sha256'", f"is {e.get('manifest_sha256')!r}, not a sha256")
    return sum(e["records"] for e in parts)



__all__ = ["FIX", "PART_ORDERS", "STATUSES", "check_manifest", "check_parts_entries", "is_store_manifest",
           "read_manifest", "shard_counts", "without_manifest"]
