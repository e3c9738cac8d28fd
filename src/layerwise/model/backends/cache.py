"""The cache of built graphs, bounded and visible: what the compiled runtimes write under
:func:`~layerwise.model.backends.ort.cache_dir` (exported ONNX graphs, OpenVINO's converted graphs and compiled blobs,
int8 calibration reports, ``races.json``).

Every graph a runtime opens is marked as used (its files' modification time), and each time a build adds to the
cache, the least recently used entries are removed until the cache is within its limit again; the new size, the
limit and what was removed are said in one ``layerwise:`` line. The limit is ``$LAYERWISE_CACHE_LIMIT`` (a size:
``2GB``, ``500MB``), else :data:`LIMIT_TIMES` the weights of the model being built (at least :data:`LIMIT_FLOOR`).
An entry is a graph with its companion files (``x.xml`` + ``x.bin`` + ``x.json``), or one compiled blob; only the
files layerwise writes there are counted or removed (:data:`PATTERNS`), and ``races.json`` is never removed.

``layerwise cache`` lists the entries, their sizes and last use; ``layerwise cache --clear`` removes them.

Example::

    >>> cache = GraphCache(cache_dir())                    # doctest: +SKIP
    >>> [(e.name, e.bytes) for e in cache.entries()][:1]   # doctest: +SKIP
    [('bert-d6-5c208565407f4cd05ccc', 90871234)]
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from ...notices import notice
from ..memory import human, parse_size

LIMIT_TIMES = 3  # the default limit: this many times the weights of the model being built
LIMIT_FLOOR = 256 * 2**20  # and at least this
PATTERNS = ("*.onnx", "*.onnx.data", "*.xml", "*.bin", "*.json", "openvino-blobs/*.blob")  # what layerwise writes
KEEP = ("races.json",)  # never evicted: small, and what saves the next process a race


@dataclass
class Entry:
    """One cache entry: a graph and its companion files (or one compiled blob), their bytes and last use."""

    name: str
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    used: float = 0.0  # seconds since the epoch: the newest modification time of its files


def cache_limit(weights_bytes: int = 0) -> int:
    """The cache's limit in bytes: ``$LAYERWISE_CACHE_LIMIT``, else :data:`LIMIT_TIMES` x ``weights_bytes`` (at
    least :data:`LIMIT_FLOOR`).

    Raises:
        ModelLoadError: ``$LAYERWISE_CACHE_LIMIT`` is not a size (the accepted forms said).
    """
    text = os.environ.get("LAYERWISE_CACHE_LIMIT", "").strip()
    if text:
        return parse_size(text, "LAYERWISE_CACHE_LIMIT")
    return max(LIMIT_FLOOR, LIMIT_TIMES * weights_bytes)


class GraphCache:
    """The graphs under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)

    def entries(self) -> list[Entry]:
        """Every entry, least recently used first (``races.json`` is not one)."""
        found: dict[str, Entry] = {}
        for pattern in PATTERNS:
            for path in self.root.glob(pattern):
                if not path.is_file() or path.name in KEEP or path.name.startswith("."):
                    continue
                name = path.name.split(".")[0] if path.parent == self.root else f"{path.parent.name}/{path.name}"
                entry = found.setdefault(name, Entry(name))
                try:
                    stat = path.stat()
                except OSError:  # removed meanwhile (another process trimming)
                    continue
                entry.files.append(path)
                entry.bytes += stat.st_size
                entry.used = max(entry.used, stat.st_mtime)
        return sorted(found.values(), key=lambda e: e.used)

    def total(self) -> int:
        """Bytes of every entry."""
        return sum(e.bytes for e in self.entries())

    @staticmethod
    def touch(*paths: Path) -> None:
        """Mark ``paths`` as just used (a graph opened from the cache)."""
        now = time.time()
        for path in paths:
            try:
                os.utime(path, (now, now))
            except OSError:  # a read-only cache is still a cache
                pass

    def trim(self, limit: int, keep: tuple[Path, ...] = ()) -> list[Entry]:
        """Remove the least recently used entries until the cache is within ``limit`` bytes, never those holding a
        file of ``keep`` (what was just built); returns the removed entries."""
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        kept = {Path(p).resolve() for p in keep}
        removed = []
        for entry in entries:
            if total <= limit:
                break
            if any(f.resolve() in kept for f in entry.files):
                continue
            for f in entry.files:
                try:
                    f.unlink()
                except OSError:
                    pass
            total -= entry.bytes
            removed.append(entry)
        return removed

    def grew(self, built: Path, weights_bytes: int, keep: tuple[Path, ...] = ()) -> None:
        """After a build wrote ``built`` (and its companions): mark it and ``keep`` (what it reads) used, trim the
        cache to its limit, and say the cache's path, size and limit (and what was removed) in one line."""
        companions = tuple(p for p in built.parent.glob(built.name.split(".")[0] + ".*")) + tuple(keep)
        self.touch(*companions)
        limit = cache_limit(weights_bytes)
        removed = self.trim(limit, keep=companions)
        gone = f"; removed the {len(removed)} least recently used ({human(sum(e.bytes for e in removed))})" \
            if removed else ""
        notice(f"graph cache {self.root}: {human(self.total())} of its {human(limit)} limit "
               f"(LAYERWISE_CACHE_LIMIT){gone}; list or clear it with `layerwise cache`")

    def clear(self) -> list[Entry]:
        """Remove every entry (``races.json`` too); returns what was removed."""
        removed = self.trim(-1)
        for name in KEEP:
            (self.root / name).unlink(missing_ok=True)
        return removed


__all__ = ["Entry", "GraphCache", "KEEP", "LIMIT_FLOOR", "LIMIT_TIMES", "PATTERNS", "cache_limit"]
