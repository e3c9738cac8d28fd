"""Repairs without a model run (``layerwise verify --repair``): what the shards still prove, written back into
the manifest; and, for damage only a model run repairs, what the extract command will recompute.

What it fixes, holding the store's lock (:mod:`layerwise.store.lock`) while it writes:

* the stale lock of a writer that died, and the half-written temporary files of runs that ended;
* a listed shard whose listing disagrees with it (rows, tokens, first or last line, size) while its bytes still
  hash to the listed sha256: the file is as it was written, so the listing is what changed, and it is rewritten
  from the shard;
* shards finished after the manifest's last update (an interruption between the two): listed when they carry this
  store's id and the next index and pass every check.

What it cannot fix: a shard that is missing, or whose bytes changed (its sha256 is not the listed one). Those need
the model: the extract command's resume recomputes from the first of them (:class:`RepairReport.needs_model` says
from which shard and input line). A manifest that cannot be read is rebuilt from the shards by ``layerwise
recover`` (:mod:`layerwise.store.recover`); ``verify --repair`` does the same when the shards can.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StoreCorruptError, StoreError
from ..provenance import now
from .integrity import Expected, content_problems, entry_of, header_problems, shard_problems, unlisted_next
from .layout import MANIFEST, TEMP_RE, ShardFile, file_sha256, list_shards, write_json
from .lock import StoreLock, lock_state, pid_alive
from .manifest import is_store_manifest, read_manifest, shard_counts
from .parts import is_parted

# the listing fields a shard's own header and lines give
LISTED = ("records", "rows", "tokens", "first_line", "last_line", "bytes")


@dataclass
class RepairReport:
    """What :func:`repair_store` fixed (or, with ``dry_run``, would fix) and what needs a model run.

    Attributes:
        store: the directory. fixed: one line per repair made without a model. needs_model: the problems only a
            model run repairs, and the line saying which command recomputes what (empty: nothing needs the model).
    """

    store: str
    fixed: list[str] = field(default_factory=list)
    needs_model: list[str] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        """Nothing is left that needs a model run."""
        return not self.needs_model


def _records(n: int) -> str:
    return f"{n:,} record{'' if n == 1 else 's'}"


def _dead_temporaries(store: Path) -> list[Path]:
    return [p for p in store.iterdir() if (m := TEMP_RE.match(p.name)) and p.is_file() and not pid_alive(
        int(m.group(2)))]


def _relisted(store: Path, entry: dict[str, Any], expected: Expected) -> dict[str, Any] | None:
    """The listing a shard gives itself when its bytes are the listed ones (sha256) and it is whole, else None."""
    path = store / entry["file"]
    if not entry.get("sha256") or not path.is_file() or file_sha256(path) != entry["sha256"]:
        return None
    try:
        own = entry_of(store, entry["file"])
        shard = ShardFile(path)
    except StoreCorruptError:
        return None
    if header_problems(shard, own, expected) or content_problems(shard, own, expected):
        return None
    return {**entry, **{k: own[k] for k in LISTED}}


def needs_model_line(entries: list[dict[str, Any]], i: int) -> str:
    """What the extract command recomputes when listed shard ``i`` is the first damaged one."""
    start = entries[i - 1]["last_line"] + 1 if i else 1
    n = sum(e["records"] for e in entries[i:])
    return (f"a model run is needed from {entries[i]['file']} on: rerun the extract command; its resume recomputes "
            f"from input line {start} ({_records(n)} in {len(entries) - i} shard(s) listed now)")


def repair_store(path: str | os.PathLike, *, dry_run: bool = False) -> RepairReport:
    """Repair what the store at ``path`` can show without a model run (see the module docstring).

    Args:
        path: a store directory. dry_run: change nothing; say what would be fixed (``verify`` uses it for its
            advice).

    Returns:
        A :class:`RepairReport`.

    Raises:
        StoreError: not a store (no manifest and no shard to rebuild it from, see :func:`~layerwise.store.recover.
            recover_store`); a store of parts (repair each part); a run is writing it now (naming it).
    """
    store = Path(path)
    report = RepairReport(os.fspath(path))
    try:
        manifest = read_manifest(store)
    except StoreError:  # missing or damaged: the shards rebuild it when they can (else the error stands)
        if not list_shards(store) or ((store / MANIFEST).exists() and not is_store_manifest(store / MANIFEST)):
            raise
        if dry_run:
            report.fixed.append(f"{MANIFEST} would be rebuilt from the shards (layerwise recover)")
            return report
        from .recover import recover_store

        rebuilt = recover_store(store)
        report.fixed.append(f"{rebuilt.summary()}; not listed: {'; '.join(rebuilt.left_out) or 'none'}")
        manifest = read_manifest(store)
    if is_parted(manifest):
        raise StoreError(f"{os.fspath(path)!r} is a store of parts; repair each part on its own, e.g. layerwise "
                         f"verify --repair {os.path.join(os.fspath(path), manifest['parts'][0]['path'])}")
    lock = StoreLock(store)
    if dry_run:
        state = lock_state(store)
        if state is not None and not state.live and state.holder is not None:
            report.fixed.append(f"the stale lock of {state.holder.describe()} would be removed")
    else:
        lock.acquire()  # a live writer: refused, naming it
        if lock.took_over:
            report.fixed.append(lock.took_over.replace("took over", "removed"))
    try:
        manifest = read_manifest(store)  # as it is now that no writer holds it
        _repair(store, manifest, report, dry_run)
    finally:
        lock.release()
    return report


def _repair(store: Path, manifest: dict[str, Any], report: RepairReport, dry_run: bool) -> None:
    temporaries = _dead_temporaries(store)
    if temporaries:
        report.fixed.append(f"{'would remove' if dry_run else 'removed'} {len(temporaries)} half-written temporary "
                            f"file(s) of runs that ended: {', '.join(p.name for p in temporaries[:3])}")
        if not dry_run:
            for p in temporaries:
                p.unlink(missing_ok=True)
    expected = Expected.of(manifest)
    entries = [dict(e) for e in manifest["shards"]]
    changed = False
    for i, entry in enumerate(entries):
        problems = shard_problems(store, entry, expected, full=True)
        if not problems:
            continue
        fixed = _relisted(store, entry, expected)
        if fixed is not None:
            said = ", ".join(f"{k} {entry[k]} -> {fixed[k]}" for k in LISTED if entry[k] != fixed[k])
            report.fixed.append(f"{entry['file']}: its listing was wrong ({said}); its bytes are the listed ones "
                                f"(sha256), so the listing {'would be' if dry_run else 'is'} rewritten from it")
            entries[i] = fixed
            changed = True
            continue
        report.needs_model += problems + [needs_model_line(entries, i)]
        break
    else:
        extra = unlisted_next(store, entries, expected)
        if extra:
            report.fixed.append(f"{'would list' if dry_run else 'listed'} {', '.join(e['file'] for e in extra)} "
                                f"({_records(sum(e['records'] for e in extra))}): finished before an interruption, "
                                f"not yet listed")
            entries += extra
            changed = True
    if changed and not dry_run:
        skipped = int((manifest.get("counts") or {}).get("skipped", 0))
        manifest.update(shards=entries, counts=shard_counts(entries, skipped), updated=now())
        write_json(store / MANIFEST, manifest)


__all__ = ["RepairReport", "needs_model_line", "repair_store"]
