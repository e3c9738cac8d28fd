"""Writing a store directory: the manifest, one shard at a time, the error log; what a resume must match.

:class:`StoreWriter` knows the format only (see :mod:`layerwise.store.layout`); it does not know how features are
computed. The extraction engine (:mod:`layerwise.extraction.engine`) gives it a header (spec, model, tokenizer,
input, feature
shape) and the tensors of each shard.

Resume rule: a directory holding a manifest is resumed when its header matches the new one on everything that
shapes the features (the spec, the model's weights fingerprint, the tokenizer settings, the input's sha256 and how
it was read). Provenance-only fields (the model's name or path, the input's path) may differ: a copy of the same
file resumes the same store. A mismatch is refused naming each differing field, unless ``overwrite``.

A resume repairs or refuses; it never overwrites. It first checks the listed shards (sizes, headers and every
shard's sha256, unless ``check="headers"``); from the first missing or damaged shard on, shards are dropped from
the manifest and recomputed: a dropped shard that is intact (ours) is removed, a damaged one is left where it is
and named. A
shard finished just before an interruption but not yet listed is taken in when it carries this store's id and the
next index and passes every check. New shards never take the name of a file that exists. "Complete" is said
only after the same checks.

One writer at a time: :meth:`StoreWriter.open` takes the store's lock (:mod:`layerwise.store.lock`) and
:meth:`StoreWriter.close` lets it go; a second writer is refused naming the first (pid, host, since when), and the
stale lock of a writer that died is taken over, said in :attr:`StoreWriter.repairs`.

Only layerwise's own files are replaced or removed: ``overwrite`` replaces a directory only when its
``manifest.json`` is a layerwise store's (the ``format`` marker), and then only the manifest, the error log, the
shard files and layerwise's own temporary files; any other file there stays.
"""

from __future__ import annotations

import copy
import json
import os
import uuid
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..encoding.spec import EncodeSpec
from ..errors import LayerwiseError, StoreCorruptError, StoreError
from ..provenance import differences, now, stamp
from .integrity import Expected, check_resume_mode, first_damaged, hash_problem, shard_problems, unlisted_next
from .layout import (
    ERRORS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    TEMP_RE,
    atomic_write_bytes,
    guard_full,
    list_shards,
    remove_temporaries,
    shard_index,
    shard_name,
    write_json,
    write_shard,
)
from .lock import LOCK, StoreLock, lock_state, pid_alive
from .manifest import is_store_manifest, read_manifest, shard_counts, without_manifest

OpenState = Literal["new", "resume", "complete"]
# recorded, not compared on resume
PROVENANCE_ONLY = {"model": ("name", "hidden_size", "backend"), "input": ("path", "kind")}
# the fields of a header's input section that say what it holds (the rest: how it was read)
INPUT_CONTENT = ("sha256", "bytes", "rows", "files", "stat_sha256")


def identity(header: dict[str, Any]) -> dict[str, Any]:
    """The part of a header that a resume must match (``header`` minus :data:`PROVENANCE_ONLY` fields)."""
    out = {k: copy.deepcopy(header.get(k)) for k in ("spec", "model", "tokenizer", "input", "part", "feature_shape")}
    spec = out.get("spec")
    if isinstance(spec, dict):  # in today's names (a manifest of layerwise 0.x calls output_dtype "dtype")
        try:
            out["spec"] = EncodeSpec.from_dict(spec).to_dict()
        except LayerwiseError:
            pass  # compared as it is: it differs, and the message names the field
    source = out.get("input") or {}
    if source.get("path") == "-":  # a stream is hashed as it is read: the engine checks it against the record
        for key in ("sha256", "bytes"):
            source.pop(key, None)
    for section, keys in PROVENANCE_ONLY.items():
        for key in keys:
            (out.get(section) or {}).pop(key, None)
    return out


# a shard's metadata keys that let `layerwise recover` rebuild its store's manifest
STORE_HEADER, AFTER_LINE = "store_header", "after_line"
DESCRIBED = ("format_version", "layerwise_version", "created", "spec", "model", "model_options", "tokenizer", "input",
             "feature_shape", "part", "runtime")


def killed_before_manifest(store: Path) -> bool:
    """Whether ``store`` (a directory without a manifest) holds only what a run killed before its first manifest
    leaves: layerwise's own temporary files of ended processes (``.manifest.json.tmp-PID``, ...) and at most the lock
    file of a writer that is not running; at least one of them."""
    names = [p.name for p in store.iterdir()]
    temps = [TEMP_RE.match(n) for n in names if n != LOCK]
    if not names or not all(temps) or (not temps and LOCK not in names):
        return False
    if any(pid_alive(int(m.group(2))) for m in temps if m is not None):
        return False
    state = lock_state(store)
    return state is None or not state.live


def store_description(manifest: dict[str, Any]) -> dict[str, Any]:
    """What each shard carries about its store (``store_header``): the manifest's fields that describe the run
    (:data:`DESCRIBED`), not its state (status, counts, shards)."""
    return {k: manifest[k] for k in DESCRIBED if k in manifest}


def mismatch_message(store: Path, old: dict[str, Any], new: dict[str, Any], diffs: list[str]) -> str:
    """Why a run (header ``new``) cannot resume the store at ``store`` (manifest ``old``), from the ``diffs`` of
    their identities: a changed input is said as such, other options by name."""
    content = {f"input.{key}" for key in INPUT_CONTENT}
    changed = [d for d in diffs if d.split(" ", 1)[0] in content]
    others = [d for d in diffs if d not in changed]
    if not changed:
        return (f"{str(store)!r} holds a store made with other options: {'; '.join(others)}. Rerun with the store's "
                f"options to resume, pick another output directory, or pass --overwrite to replace it")
    was, now = old.get("input") or {}, new.get("input") or {}
    if was.get("sha256") and now.get("sha256"):
        how = f"its sha256 is {now['sha256'][:16]}... now, {was['sha256'][:16]}... when the store was made"
    else:
        how = f"it differs from the one the store was made from ({'; '.join(changed)})"
    counts = old.get("counts") or {}
    held = (f"{int(counts.get('records') or 0):,} records, {old.get('status')}")
    what = f"the input {now.get('path') or was.get('path') or ''} changed".replace("  ", " ")
    if others:
        return (f"{str(store)!r} holds a store made with other options: {'; '.join(others)}; and {what}: {how}. "
                f"Rerun with the store's options and input to resume, pick another output directory, or pass "
                f"--overwrite to replace it")
    return (f"{what} since the store {str(store)!r} was made from it ({held}): {how}. Give the input the store was "
            f"made from to resume or reuse it, write this input to another output directory, or pass --overwrite "
            f"to replace the store")


def _prefix_entry(metadata: dict[str, str]) -> dict[str, Any]:
    """``{"input_prefix": {...}}`` from a shard's metadata where it has one (stdin inputs), else ``{}``."""
    value = metadata.get("input_prefix")
    return {"input_prefix": json.loads(value)} if value else {}


class StoreWriter:
    """One store directory being written.

    Args:
        path: the store directory (created if absent).
        header: ``spec``, ``model``, ``tokenizer``, ``input`` and ``feature_shape`` of the run (JSON-ready).
        check: what a resume checks of every listed shard: ``sha256`` (every byte, the default) or ``headers``
            (sizes and headers, and the last shard's sha256).
    """

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], *, check: str = "sha256"):
        self.path = Path(path)
        self.header = header
        self.check = check_resume_mode(check)
        self.manifest: dict[str, Any] = {}
        self.shards: list[dict[str, Any]] = []
        self.repairs: list[str] = []  # what the last open() found damaged and repaired, one line each
        self._next = 0  # the index of the next shard's file
        self._lock = StoreLock(self.path)

    # ---- opening -----------------------------------------------------------------------------------------
    def open(self, overwrite: bool = False) -> OpenState:
        """Take the store's lock (:mod:`layerwise.store.lock`) and prepare the directory: ``new`` (empty store),
        ``resume`` (same header, unfinished or repaired) or ``complete`` (same header, finished, every listed shard
        checked). What a resume repaired (and a stale lock taken over) is in :attr:`repairs`. The lock is held until
        :meth:`close`.

        Raises:
            StoreError: the path is a file, a non-empty directory that is not a layerwise store (even with
                ``overwrite``), a store another run is writing (naming it: pid, host, since when), or a store made
                with other options (naming the differences; a changed input is said as such) without ``overwrite``.
            StoreCorruptError: a damaged manifest, without ``overwrite``.
        """
        store, mpath = self.path, self.path / MANIFEST
        self.repairs = []
        if store.exists() and not store.is_dir():
            raise StoreError(f"store path {str(store)!r} is a file; give a directory (new or a layerwise store)")
        if store.is_dir() and not mpath.exists() and killed_before_manifest(store):
            removed = remove_temporaries(store)
            self.repairs.append(f"took over {str(store)!r}: a run was killed before its first manifest was written "
                                f"(removed {removed} half-written file{'s' if removed != 1 else ''} of its own)")
        if store.is_dir() and any(p.name != LOCK for p in store.iterdir()) and not mpath.exists():
            raise StoreError(
                f"{str(store)!r} exists, is not empty and is not a layerwise store (no {MANIFEST}); "
                + (without_manifest(store) if list_shards(store) else
                   "choose a new or empty directory (layerwise never deletes files it did not write)")
            )
        if mpath.exists() and not is_store_manifest(mpath):
            names = sorted(p.name for p in store.iterdir())
            raise StoreError(
                f"{str(store)!r} holds a {MANIFEST} that is not a layerwise store's (files there: "
                f"{', '.join(names[:8])}{' ...' if len(names) > 8 else ''}); layerwise replaces only its own "
                f"stores, even with --overwrite: choose another directory"
            )
        store.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            state = self._open_locked(overwrite)
        except BaseException:
            self.close()
            raise
        if self._lock.took_over:
            self.repairs.insert(0, self._lock.took_over)
        return state

    def _open_locked(self, overwrite: bool) -> OpenState:
        """:meth:`open` once the lock is held: resume, refuse, or start a new store."""
        store, mpath = self.path, self.path / MANIFEST
        if mpath.exists():
            try:
                old: dict[str, Any] | None = read_manifest(store)
            except StoreCorruptError:
                if not overwrite:
                    raise
                old = None  # a layerwise store's manifest (the marker), damaged: --overwrite replaces it
            if old is not None:
                diffs = differences(identity(old), identity(self.header))
                if diffs and not overwrite:
                    raise StoreError(mismatch_message(store, old, self.header, diffs))
                if not diffs and not overwrite:
                    self.manifest = old
                    remove_temporaries(store)
                    return self._resume()
            self._wipe()
        self.manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, "id": uuid.uuid4().hex, **stamp(),
                         "status": "running", **copy.deepcopy(self.header), "counts": {}, "shards": []}
        self._next = self._free_index()
        self._guard(lambda: write_json(mpath, self.manifest), MANIFEST)
        self._guard(lambda: (store / ERRORS).write_bytes(b""), ERRORS)
        return "new"

    def close(self) -> None:
        """Let the store's lock go (the lock file is removed); nothing when not open. Call it once done writing."""
        self._lock.release()

    def __enter__(self) -> "StoreWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _wipe(self) -> None:
        """Remove a layerwise store's own files (its manifest carries the marker); anything else stays."""
        for p in list_shards(self.path):
            p.unlink()
        remove_temporaries(self.path)
        for name in (MANIFEST, ERRORS):
            (self.path / name).unlink(missing_ok=True)

    def _free_index(self) -> int:
        """The index after every shard file on disk and every listed shard: new shards never take a used name."""
        used = [shard_index(p.name) for p in list_shards(self.path)] + [shard_index(e["file"]) for e in self.shards]
        return max(used, default=-1) + 1

    def _resume(self) -> OpenState:
        """Check the listed shards (:func:`~layerwise.store.integrity.first_damaged`: every sha256 by default),
        drop (and recompute) from the first damaged one, take in a finished unlisted shard; returns ``complete``
        only when nothing had to change."""
        entries = [dict(e) for e in self.manifest["shards"]]
        expected = Expected.of(self.manifest)
        damaged = first_damaged(self.path, entries, expected, self.check)
        self.shards = entries if damaged is None else entries[:damaged[0]]
        if damaged is not None:
            self.repairs += damaged[1]
            self._drop(entries[damaged[0]:], expected)
        else:
            self.shards += unlisted_next(self.path, self.shards, expected)
        self._next = self._free_index()
        if self.repairs:
            self.repairs.append(f"recomputing from input line {self.resume_line + 1}" if self.shards else
                                "recomputing from the start")
            self.write_manifest("running", int((self.manifest.get("counts") or {}).get("skipped", 0)))
            return "resume"
        return "complete" if self.manifest.get("status") == "complete" else "resume"

    def _drop(self, dropped: list[dict[str, Any]], expected: Expected) -> None:
        """Unlist ``dropped`` (to be recomputed): an intact one is ours and removed, a damaged one stays, named."""
        for entry in dropped:
            path = self.path / entry["file"]
            if not path.exists():
                continue
            if shard_problems(self.path, entry, expected, full=False) or hash_problem(self.path, entry):
                self.repairs.append(f"{entry['file']} is left as it is (damaged, no longer listed); delete it once "
                                    f"you no longer need it")
            else:
                path.unlink()

    # ---- state -------------------------------------------------------------------------------------------
    @property
    def done_records(self) -> int:
        """Records in finished shards."""
        return sum(s["records"] for s in self.shards)

    @property
    def input_prefix(self) -> dict[str, Any] | None:
        """What the last finished shard recorded about the input read up to it (a stream's ``input_prefix``)."""
        return self.shards[-1].get("input_prefix") if self.shards else None

    @property
    def resume_line(self) -> int:
        """The input line of the last finished record (0 for none): a resume skips lines up to it."""
        return int(self.shards[-1]["last_line"]) if self.shards else 0

    # ---- writing -----------------------------------------------------------------------------------------
    def trim_errors(self) -> int:
        """Keep the logged errors up to the resume point (later ones are met again); returns how many are kept."""
        path = self.path / ERRORS
        kept = []
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the interruption
                if entry.get("line", 0) <= self.resume_line:
                    kept.append(line)
        self._guard(lambda: atomic_write_bytes(path, "".join(k + "\n" for k in kept).encode("utf-8")), ERRORS)
        return len(kept)

    def log_error(self, line: int, reason: str) -> None:
        """Append a skipped record to ``errors.jsonl``."""
        entry = json.dumps({"line": line, "reason": reason}, ensure_ascii=False) + "\n"

        def append() -> None:
            with open(self.path / ERRORS, "a", encoding="utf-8") as fh:
                fh.write(entry)

        self._guard(append, ERRORS)

    def write_shard(
        self, tensors: dict[str, np.ndarray], metadata: dict[str, str], *, tokens: int
    ) -> int:
        """Write the next shard (``tensors`` as in the layout table; ``lines`` gives its record range).

        A ``metadata["input_prefix"]`` (JSON; stdin inputs) is also listed with the shard in the manifest.
        Returns the shard's size in bytes. A full disk raises :class:`StoreFullError` (the temporary file is gone).
        """
        while (self.path / shard_name(self._next)).exists():  # never over a file that exists
            self._next += 1
        index, name = self._next, shard_name(self._next)
        if self.manifest.get("id"):  # format 3: each shard says which store it belongs to, and where
            metadata = {**metadata, "store": self.manifest["id"], "shard": str(index)}
        # what `layerwise recover` rebuilds the manifest from: the run's description and the line this shard follows
        metadata = {**metadata, STORE_HEADER: json.dumps(store_description(self.manifest), ensure_ascii=False),
                    AFTER_LINE: str(self.resume_line)}
        lines = tensors["lines"]
        written = self._guard(lambda: write_shard(self.path / name, tensors, metadata), name)
        self._next += 1
        self.shards.append(
            {"file": name, "records": int(lines.shape[0]), "rows": int(tensors["features"].shape[0]), "tokens": tokens,
             "first_line": int(lines[0]), "last_line": int(lines[-1]), "bytes": written.bytes,
             "sha256": written.sha256, **_prefix_entry(metadata),
             **({"runtime": metadata["runtime"]} if "runtime" in metadata else {})}
        )
        return written.bytes

    def unlist(self, keep: int, skipped: int) -> int:
        """Keep the first ``keep`` listed shards; unlist the others (a resume recomputes their records) and remove
        their files (this writer's own, intact ones; a damaged one stays). Rewrites the manifest as ``running`` with
        ``skipped`` skipped records. Returns how many records were unlisted."""
        dropped = self.shards[keep:]
        self.shards = self.shards[:keep]
        self._drop(dropped, Expected.of(self.manifest))
        self.write_manifest("running", skipped)
        return sum(e["records"] for e in dropped)

    def record_input(self, **fields: Any) -> None:
        """Add facts about the input to the manifest's ``input`` section (written with the next manifest)."""
        self.manifest.setdefault("input", {}).update(fields)

    def write_manifest(self, status: str, skipped: int) -> None:
        """Rewrite the manifest with ``status`` (``running | partial | complete``) and the counts."""
        m = self.manifest
        m["status"] = status
        m["updated"] = now()
        m["shards"] = self.shards
        m["counts"] = shard_counts(self.shards, skipped)
        self._guard(lambda: write_json(self.path / MANIFEST, m), MANIFEST)

    def _guard(self, write: Any, what: str) -> Any:
        """Run ``write``; a full disk becomes one :class:`StoreFullError` (:func:`layout.guard_full`)."""
        safe = f"{self.done_records} records in {len(self.shards)} finished shards"
        return guard_full(write, what, self.path, safe)
