"""Writing a store directory: the manifest, one shard at a time, the error log; what a resume must match.

:class:`StoreWriter` knows the format only (see :mod:`layerwise.store.layout`); it does not know how features are
computed. The extraction engine (:mod:`layerwise.extraction.engine`) gives it a header (spec, model, tokenizer,
input, feature
shape) and the tensors of each shard.

Resume rule: a directory holding a manifest is resumed when its header matches the new one on everything that
shapes the features (the spec, the model's weights fingerprint, the tokenizer settings, the input's sha256 and how
it was read). Provenance-only fields (the model's name or path, the input's path) may differ: a copy of the same
file resumes the same store. A mismatch is refused naming each differing field, unless ``overwrite``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ..encoding.spec import EncodeSpec
from ..errors import LayerwiseError, StoreError, StoreFullError
from ..provenance import differences, now, stamp
from .layout import (
    ERRORS,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ShardFile,
    atomic_write_bytes,
    is_disk_full,
    list_shards,
    read_json,
    remove_temporaries,
    shard_name,
    write_json,
    write_shard,
)

OpenState = Literal["new", "resume", "complete"]
# recorded, not compared on resume
PROVENANCE_ONLY = {"model": ("name", "hidden_size", "backend"), "input": ("path", "kind")}


def identity(header: dict[str, Any]) -> dict[str, Any]:
    """The part of a header that a resume must match (``header`` minus :data:`PROVENANCE_ONLY` fields)."""
    out = {k: copy.deepcopy(header.get(k)) for k in ("spec", "model", "tokenizer", "input", "part")}
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


def _prefix_entry(metadata: dict[str, str]) -> dict[str, Any]:
    """``{"input_prefix": {...}}`` from a shard's metadata where it has one (stdin inputs), else ``{}``."""
    value = metadata.get("input_prefix")
    return {"input_prefix": json.loads(value)} if value else {}


class StoreWriter:
    """One store directory being written.

    Args:
        path: the store directory (created if absent).
        header: ``spec``, ``model``, ``tokenizer``, ``input`` and ``feature_shape`` of the run (JSON-ready).
    """

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any]):
        self.path = Path(path)
        self.header = header
        self.manifest: dict[str, Any] = {}
        self.shards: list[dict[str, Any]] = []

    # ---- opening -----------------------------------------------------------------------------------------
    def open(self, overwrite: bool = False) -> OpenState:
        """Prepare the directory: ``new`` (empty store), ``resume`` (same header, unfinished) or ``complete``.

        Raises:
            StoreError: the path is a file, a non-empty directory that is not a store, or a store made with
                another header (naming the differences) without ``overwrite``.
        """
        store, mpath = self.path, self.path / MANIFEST
        if store.exists() and not store.is_dir():
            raise StoreError(f"store path {str(store)!r} is a file; give a directory (new or a layerwise store)")
        if store.is_dir() and any(store.iterdir()) and not mpath.exists():
            raise StoreError(
                f"{str(store)!r} exists, is not empty and is not a layerwise store (no {MANIFEST}); choose a new or "
                f"empty directory (layerwise never deletes files it did not write)"
            )
        if mpath.exists():
            old = read_json(mpath)
            diffs = differences(identity(old), identity(self.header))
            if diffs and not overwrite:
                raise StoreError(
                    f"{str(store)!r} holds a store made with other options: {'; '.join(diffs)}. Rerun with the "
                    f"store's options to resume, pick another output directory, or pass --overwrite to replace it"
                )
            if not diffs and not overwrite:
                self.manifest = old
                remove_temporaries(store)
                self._load_shards()
                return "complete" if old.get("status") == "complete" else "resume"
            self._wipe()
        store.mkdir(parents=True, exist_ok=True)
        self.manifest = {"format": FORMAT, "format_version": FORMAT_VERSION, **stamp(), "status": "running",
                         **copy.deepcopy(self.header), "counts": {}, "shards": []}
        self._guard(lambda: write_json(mpath, self.manifest), MANIFEST)
        self._guard(lambda: (store / ERRORS).write_bytes(b""), ERRORS)
        return "new"

    def _wipe(self) -> None:
        for p in list_shards(self.path):
            p.unlink()
        remove_temporaries(self.path)
        for name in (MANIFEST, ERRORS):
            (self.path / name).unlink(missing_ok=True)

    def _load_shards(self) -> None:
        self.shards = []
        for p in list_shards(self.path):
            sf = ShardFile(p)
            lines = sf.array("lines")
            self.shards.append(
                {"file": p.name, "records": int(lines.shape[0]), "rows": int(sf.shape("features")[0]),
                 "tokens": int(sf.metadata.get("tokens", 0)), "first_line": int(lines[0]),
                 "last_line": int(lines[-1]), "bytes": p.stat().st_size, **_prefix_entry(sf.metadata)}
            )

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
        name = shard_name(len(self.shards))
        lines = tensors["lines"]
        size = self._guard(lambda: write_shard(self.path / name, tensors, metadata), name)
        self.shards.append(
            {"file": name, "records": int(lines.shape[0]), "rows": int(tensors["features"].shape[0]), "tokens": tokens,
             "first_line": int(lines[0]), "last_line": int(lines[-1]), "bytes": size, **_prefix_entry(metadata)}
        )
        return size

    def record_input(self, **fields: Any) -> None:
        """Add facts about the input to the manifest's ``input`` section (written with the next manifest)."""
        self.manifest.setdefault("input", {}).update(fields)

    def write_manifest(self, status: str, skipped: int) -> None:
        """Rewrite the manifest with ``status`` (``running | partial | complete``) and the counts."""
        m = self.manifest
        m["status"] = status
        m["updated"] = now()
        m["shards"] = self.shards
        m["counts"] = {
            "records": self.done_records,
            "rows": sum(s["rows"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "skipped": skipped,
            "shards": len(self.shards),
            "bytes": sum(s["bytes"] for s in self.shards),
        }
        self._guard(lambda: write_json(self.path / MANIFEST, m), MANIFEST)

    def _guard(self, write: Any, what: str) -> Any:
        """Run ``write``; a full disk becomes one :class:`StoreFullError` naming the store, the file and the fix."""
        try:
            return write()
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            raise StoreFullError(
                f"no space left on the device while writing {what} of store {str(self.path)!r}: "
                f"{self.done_records} records in {len(self.shards)} finished shards are safe. Free some space and "
                f"rerun the same command: it resumes after the last finished shard"
            ) from exc
