"""A store's manifest rebuilt from its shards (``layerwise recover STORE``), saying what the shards prove.

Every shard layerwise writes carries, in its metadata, what its manifest says about it: the store's id and the
shard's index (``store``, ``shard``), the run's description (``store_header``: spec, model and its options,
tokenizer, input and its sha256, feature shape, format), the input line the shard follows (``after_line``: the
previous shard's last line, 0 for the first) and a ``seal`` (the sha256 of its header and every tensor byte,
:meth:`~layerwise.store.layout.ShardFile.seal_ok`). Its record range is its ``lines`` tensor.

So when ``manifest.json`` is deleted or damaged, :func:`recover_store` rebuilds it:

1. each shard file is read: a file that does not parse, carries no description (written before layerwise recorded
   one), holds another index than its name says, or whose bytes are not the sealed ones is left out, named;
2. the shards of one store id are kept (the id with the most records; the others are named);
3. from line 0, each next shard is the one that follows the last line so far (``after_line``), the latest written
   when a resume wrote a second one; the chain stops where no shard follows (a missing shard: the shards after it
   are not listed, and a resume recomputes from there);
4. each listed shard passes the same header and consistency checks as on every open, and is listed with its
   sha256; the skipped records are those of ``errors.jsonl`` up to the last listed line.

What it cannot prove: that the run had finished (the manifest says ``running``; the extract command's resume
reads the input past the last line and marks the store complete), nor anything about a damaged ``errors.jsonl``.
:class:`RecoverReport` says both what it proved and what it could not.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StoreCorruptError, StoreError
from ..provenance import now
from ..version import __version__
from .integrity import Expected, content_problems, entry_of, header_problems
from .layout import (
    ERRORS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    READABLE_VERSIONS,
    ShardFile,
    list_shards,
    shard_index,
    write_json,
)
from .lock import StoreLock
from .manifest import check_manifest, is_store_manifest, read_manifest, shard_counts
from .writer import AFTER_LINE, STORE_HEADER


@dataclass
class Candidate:
    """A shard file that proved itself: sealed, carrying its store's id, index and description."""

    name: str
    index: int
    store_id: str
    description: dict[str, Any]
    after: int
    shard: ShardFile


@dataclass
class RecoverReport:
    """What :func:`recover_store` rebuilt and proved.

    Attributes:
        store: the directory. store_id: the store's id. listed: the shard files the new manifest lists, in order.
        records, first_line, last_line: what they hold. proven: what the shards proved, one line each.
        not_proven: what they could not prove. left_out: shard files not listed, each with why.
    """

    store: str
    store_id: str = ""
    listed: list[str] = field(default_factory=list)
    records: int = 0
    first_line: int = 0
    last_line: int = 0
    proven: list[str] = field(default_factory=list)
    not_proven: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)

    def summary(self) -> str:
        """One line: what the new manifest lists."""
        return (f"{self.store}/{MANIFEST} rebuilt from {len(self.listed)} shard(s): {self.records:,} records, input "
                f"lines {self.first_line}..{self.last_line}, store id {self.store_id}")


def _check_replaceable(store: Path) -> None:
    """Refuse a store whose manifest is readable (nothing to recover), foreign, or of a format this layerwise does
    not know; a missing or damaged layerwise manifest may be rebuilt."""
    mpath = store / MANIFEST
    if not store.is_dir():
        raise StoreError(f"{str(store)!r} is not a directory; give a store directory")
    if not mpath.exists():
        return
    if not is_store_manifest(mpath):
        raise StoreError(f"{str(mpath)!r} is not a layerwise store manifest; layerwise replaces only its own files: "
                         f"move it away to recover the store, or choose another directory")
    try:
        read_manifest(store)
    except StoreCorruptError:
        try:
            version = json.loads(mpath.read_bytes().decode("utf-8")).get("format_version")
        except (ValueError, AttributeError, RecursionError):
            return  # not JSON (cut short, garbled): rebuilt
        if isinstance(version, int) and version not in READABLE_VERSIONS:
            raise StoreError(f"{str(mpath)!r} is store format {version}, which this layerwise does not read; open "
                             f"it with the layerwise that wrote it") from None
        return
    raise StoreError(f"{str(mpath)!r} is readable: there is nothing to recover. Check the store with layerwise verify "
                     f"{store} (--repair fixes what needs no model run)")


def _candidates(store: Path, report: RecoverReport) -> list[Candidate]:
    out = []
    for path in list_shards(store):
        name = path.name
        try:
            shard = ShardFile(path)
            description = shard.json_meta(STORE_HEADER)
        except StoreCorruptError as exc:
            report.left_out.append(f"{name}: {exc.problem}")
            continue
        store_id, index, after = (shard.metadata.get(k) for k in ("store", "shard", AFTER_LINE))
        if not isinstance(description, dict) or store_id is None or index is None or after is None:
            report.left_out.append(f"{name}: carries no description of its store (written before layerwise recorded "
                                   f"one in its shards); rerun the extract command into a new directory")
            continue
        if index != str(shard_index(name)):
            report.left_out.append(f"{name}: holds shard {index} (a copy or a rename of another shard's file)")
            continue
        if not shard.seal_ok():
            report.left_out.append(f"{name}: its bytes are not the ones its writer sealed (damaged)")
            continue
        out.append(Candidate(name, int(index), store_id, description, int(after), shard))
    return out


def _chain(found: list[Candidate], report: RecoverReport) -> list[Candidate]:
    """From line 0, each next shard the one that follows the last line so far (the latest written on a tie)."""
    chain: list[Candidate] = []
    at, index = 0, -1
    while True:
        nxt = [c for c in found if c.after == at and c.index > index]
        if not nxt:
            break
        pick = max(nxt, key=lambda c: c.index)
        lines = pick.shard.array("lines")
        if not len(lines):
            break
        chain.append(pick)
        at, index = int(lines[-1]), pick.index
    chosen = {c.name for c in chain}
    for c in found:
        if c.name not in chosen:
            lines = c.shard.array("lines")
            report.left_out.append(f"{c.name}: does not follow the listed shards (it follows input line {c.after}, "
                                   f"holds lines {int(lines[0]) if len(lines) else '-'}..."
                                   f"{int(lines[-1]) if len(lines) else '-'}): an older or orphaned copy")
    return chain


def _skipped(store: Path, last_line: int, report: RecoverReport) -> int:
    path = store / ERRORS
    if not path.exists():
        report.not_proven.append(f"no {ERRORS}: the count of skipped records is 0")
        return 0
    n = 0
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        try:
            entry = json.loads(line)
            n += int(entry["line"]) <= last_line
        except (ValueError, KeyError, TypeError):
            report.not_proven.append(f"{ERRORS} line {number} is not a skipped record; the count of skipped records "
                                     f"leaves it out")
    return n


def recover_store(path: str | os.PathLike) -> RecoverReport:
    """Rebuild the manifest of the store at ``path`` from its shards (see the module docstring), holding the store's
    lock; returns what it proved.

    Raises:
        StoreError: not a directory, a readable or foreign manifest (nothing is changed), a run writing it now, or no
            shard that proves itself (naming each file and why).
    """
    store = Path(path)
    _check_replaceable(store)
    report = RecoverReport(os.fspath(path))
    with StoreLock(store):
        found = _candidates(store, report)
        if not found:
            raise StoreError(f"no shard of {str(store)!r} can rebuild its manifest: "
                             f"{'; '.join(report.left_out) or 'it holds no shard files'}")
        records: dict[str, int] = {}
        for c in found:
            records[c.store_id] = records.get(c.store_id, 0) + int(c.shard.shape("lines")[0])
        store_id = max(records, key=lambda k: records[k])
        for c in found:
            if c.store_id != store_id:
                report.left_out.append(f"{c.name}: belongs to another store (id {c.store_id}, kept: {store_id})")
        chain = _chain([c for c in found if c.store_id == store_id], report)
        if not chain:
            raise StoreError(f"no shard of store {store_id} in {str(store)!r} starts at the first input line; "
                             f"{'; '.join(report.left_out)}")
        description = chain[0].description
        expected = Expected.of({**description, "id": store_id})
        entries = []
        for c in chain:
            entry = entry_of(store, c.name)
            problems = ([] if c.description == description else [f"{c.name}: describes another run"]) + \
                header_problems(c.shard, entry, expected) + content_problems(c.shard, entry, expected)
            if problems:
                report.left_out += problems + [f"{c.name} and the shards after it are not listed"]
                break
            entries.append(entry)
        _write_manifest(store, store_id, description, entries, report)
    return report


def _write_manifest(store: Path, store_id: str, description: dict[str, Any], entries: list[dict[str, Any]],
           report: RecoverReport) -> None:
    report.store_id, report.listed = store_id, [e["file"] for e in entries]
    report.records = sum(e["records"] for e in entries)
    report.first_line = entries[0]["first_line"] if entries else 0
    report.last_line = entries[-1]["last_line"] if entries else 0
    skipped = _skipped(store, report.last_line, report)
    manifest = {"format": FORMAT, "format_version": description.get("format_version", FORMAT_VERSION),
                "id": store_id, "layerwise_version": description.get("layerwise_version", __version__),
                "created": description.get("created", now()), "status": "running",
                **{k: v for k, v in description.items() if k not in ("format_version", "layerwise_version", "created")},
                "counts": shard_counts(entries, skipped), "shards": entries,
                "recovered": {"at": now(), "by": __version__, "shards": len(entries)}}
    check_manifest(manifest, store / MANIFEST)
    write_json(store / MANIFEST, manifest)
    report.proven += [
        f"{len(entries)} shard(s) hold exactly the bytes their writer sealed, each with store id {store_id} and its "
        f"own index",
        f"their line ranges follow one another from the first input line to line {report.last_line} (each shard "
        f"names the line it follows)",
        "each passes the checks of every open (shapes, dtypes, lines, offsets, word lists, kept columns, tokens)",
        "the spec, model, tokenizer and input (with its sha256) are those every listed shard recorded",
    ]
    report.not_proven.append(f"whether the run had finished: the manifest says running; rerun the extract command to "
                             f"finish the store (its resume checks every shard and goes on after input line "
                             f"{report.last_line})")


__all__ = ["RecoverReport", "recover_store"]
