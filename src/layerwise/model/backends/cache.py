"""The cache of built graphs, one for every process that shares it: what the compiled runtimes write under
:func:`~layerwise.model.backends.ort.cache_dir` (exported ONNX graphs and their cuts, ONNX Runtime's int8 graphs,
OpenVINO's compiled blobs and quantised graphs, int8 calibration reports, ``races.json``), bounded and visible.

**One way in.** Every builder writes through :meth:`GraphCache.put`, modelled on triton's ``FileCacheManager.put``:

1. the entry's build lock is taken (``.locks/NAME.lock``, across processes and threads), and the entry checked again:
   a graph another process built meanwhile is used, never built twice (the second process waits for the first);
2. the entry's files are written into a temporary directory ``.NAME.tmp-PID-XXXX`` in the cache, named after the
   process that owns it (a child process of :mod:`~layerwise.model.backends.offload` writes into its parent's);
3. under the cache's lock (``.locks/cache.lock``) they are renamed into place, the main file last, and the cache is
   trimmed to its limit; the temporary directory goes, whether the write worked or raised.

**Leases.** A process that opens a graph (an ONNX Runtime session, an OpenVINO compiled model) or reads one to build
another holds a :class:`Lease` on its entries: a file ``.locks/NAME.lease-PID`` that it keeps locked while it holds it,
which the kernel unlocks when the process dies. Trimming never removes an entry with a live lease, so the cache may
pass its limit by the graphs in use; a lease left by a dead process is stale and removed.

**Trimming.** Each time a build adds to the cache, the least recently used entries (by their files' modification time:
opening a graph marks it used) are removed until the cache is within its limit again, and the temporary files of dead
processes (their PID no longer runs; ``.export-model-*`` and ``.export-*`` leftovers of earlier versions) with them.
:meth:`GraphCache.say` says the new size, the limit and what was removed in one ``layerwise:`` line. The limit is
``$LAYERWISE_CACHE_LIMIT`` (a size: ``2GB``, ``500MB``), else :data:`LIMIT_TIMES` the weights of the model being built
(at least :data:`LIMIT_FLOOR`): one depth of the default model is its exported graph (the weights, shared by every
depth) and a compiled OpenVINO blob (the weights again), so 5x holds the graphs of four depths. An entry is a graph with
its companion files (``x.onnx`` + ``x.onnx.data``, ``x.xml`` + ``x.bin`` + ``x.json``), or one compiled blob; only the
files layerwise writes there are counted or removed (:data:`PATTERNS`), and ``races.json`` is never evicted.

``layerwise cache`` lists the entries (size, last use, the PIDs holding them) and the temporary files, and their total
is what the directory holds on disk; ``layerwise cache --clear`` removes every entry not in use and every dead
process's temporary files.

Lock order: an in-process build lock (``ort.BUILD_LOCK``), then an entry's build lock, then the cache's lock. A lease
is taken under the cache's lock and never waited for.

Example::

    >>> cache = GraphCache(cache_dir())                                         # doctest: +SKIP
    >>> cache.put(root / "x.onnx", lambda tmp: (tmp / "x.onnx").write_bytes(b"graph"))   # doctest: +SKIP
    True
    >>> [(e.name, e.bytes, e.holders) for e in cache.entries()][:1]              # doctest: +SKIP
    [('x', 5, [])]
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ...errors import LayerwiseError, ModelLoadError
from ...notices import notice
from ..memory import human, parse_size
from .filelock import FileLock, holder_alive, lock_exclusive, pid_alive

LIMIT_TIMES = 5  # the default limit: this many times the weights of the model being built (two depths and more fit)
LIMIT_FLOOR = 256 * 2**20  # and at least this
PATTERNS = ("*.onnx", "*.onnx.data", "*.xml", "*.bin", "*.json", "*.blob",
            "openvino-blobs/*.blob")  # what layerwise writes there (openvino-blobs/: OpenVINO's own cache, before)
KEEP = ("races.json",)  # never evicted: small, and what saves the next process a race
LOCKS = ".locks"  # the lock and lease files (zero bytes each)
TEMP = re.compile(r"^\.(?P<name>.+?)\.tmp-(?P<pid>\d+)(?:[-.].*)?$")  # a temporary file or directory of process PID
OLD_TEMP = re.compile(r"^\.export-")  # earlier versions' temporary files, named without their process
LEASE = re.compile(r"^(?P<name>.+)\.lease-(?P<pid>\d+)$")
SAY_WAIT_S = 1.0  # a wait for another process's build longer than this is said

_LEASES_GUARD = threading.Lock()
_FRESH: dict[str, "Lease"] = {}  # a graph this process just wrote -> its lease, until hold() takes its own
_LIMITS: dict[str, int] = {}  # cache root -> the limit its last trim in this process used (a released lease's trim)
_LEASED: dict[str, list[int]] = {}  # lease file -> [descriptor, holds] of this process


@dataclass
class Entry:
    """One cache entry: a graph and its companion files (or one compiled blob), their bytes, last use and the PIDs of
    the live processes holding a lease on it."""

    name: str
    files: list[Path] = field(default_factory=list)
    bytes: int = 0
    used: float = 0.0  # seconds since the epoch: the newest modification time of its files
    holders: list[int] = field(default_factory=list)


@dataclass
class Temp:
    """A temporary file or directory in the cache: what a build is writing, or what a dead process left."""

    path: Path
    bytes: int
    pid: int | None  # its owner (None: an earlier version's file, named without it)
    dead: bool  # its owner no longer runs: it is removed by the next trim and by ``layerwise cache --clear``


@dataclass
class Survey:
    """Everything under the cache directory: the entries, the temporary files, the kept files (``races.json``), the
    files that are not layerwise's, and their total bytes (what the directory holds on disk)."""

    entries: list[Entry]
    temps: list[Temp]
    kept: list[Path]
    others: list[Path]
    bytes: int


@dataclass
class Cleared:
    """What :meth:`GraphCache.clear` removed, and the entries it kept because a live process holds them."""

    entries: list[Entry]
    temps: list[Temp]
    in_use: list[Entry]


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


def entry_name(path: Path) -> str:
    """The entry a cache file belongs to: its name up to the first dot (``bert-d6-5c20`` for
    ``bert-d6-5c20.onnx.data``), or ``openvino-blobs/NAME.blob`` for OpenVINO's own blobs of earlier versions."""
    path = Path(path)
    if path.parent.name == "openvino-blobs":
        return f"openvino-blobs/{path.name}"
    return path.name.split(".")[0]


def _size(path: Path) -> int:
    try:
        if path.is_dir() and not path.is_symlink():
            return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())
        return path.lstat().st_size
    except OSError:  # removed meanwhile
        return 0


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Lease:
    """This process's hold on cache entries (see the module docstring): while it is held, no process evicts them.
    :meth:`release` gives it back (once; the process's exit does too), and trims the cache ``root`` to the limit its
    last write used: an entry kept over the limit only because it was in use goes once nobody uses it."""

    def __init__(self, files: list[Path], root: Path | None = None):
        self.files = files
        self.root = root
        self._released = False

    def release(self) -> None:
        """Give the lease back: the lease files this process holds no other lease through are removed; where that
        frees an entry, the cache is trimmed again."""
        freed = False
        with _LEASES_GUARD:
            if self._released:
                return
            self._released = True
            for path in self.files:
                held = _LEASED.get(str(path))
                if held is None:
                    continue
                held[1] -= 1
                if held[1] == 0:
                    del _LEASED[str(path)]
                    path.unlink(missing_ok=True)
                    os.close(held[0])
                    freed = True
        if freed and self.root is not None:
            try:
                GraphCache(self.root).trim(_LIMITS.get(str(self.root), cache_limit()))
            except Exception:  # noqa: BLE001 - a release (often at exit) never fails for a trim; the next write trims
                pass


def _release_all(held: dict) -> None:
    for lease in list(held.values()):
        lease.release()
    held.clear()


class Leases:
    """The leases one backend holds, by what it opened (a depth, a stage): each kept while that stays open, all
    released by :meth:`release` or when the backend is garbage (and by the process's exit)."""

    def __init__(self) -> None:
        self.held: dict[Any, Lease] = {}
        weakref.finalize(self, _release_all, self.held)

    def hold(self, key: Any, lease: Lease) -> None:
        """Keep ``lease`` for ``key``, releasing the one it replaces."""
        before = self.held.pop(key, None)
        self.held[key] = lease
        if before is not None:
            before.release()

    def release(self) -> None:
        """Release every lease held."""
        _release_all(self.held)


class GraphCache:
    """The graphs under ``root`` (see the module docstring)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.lock = FileLock(self.root / LOCKS / "cache.lock")
        self.removed: list[Entry] = []  # what this object's trims removed since it last said so (:meth:`say`)

    # ---- what is there -------------------------------------------------------------------------------------------
    def _lock_file(self, name: str, kind: str) -> Path:
        return self.root / LOCKS / f"{name.replace('/', '+')}.{kind}"

    def holders(self, name: str) -> list[int]:
        """The PIDs of the live processes holding a lease on entry ``name`` (this one included)."""
        pids = []
        for path in (self.root / LOCKS).glob(f"{name.replace('/', '+')}.lease-*"):
            match = LEASE.match(path.name)
            if match and holder_alive(path, int(match["pid"])):
                pids.append(int(match["pid"]))
        return sorted(pids)

    def entries(self) -> list[Entry]:
        """Every entry, least recently used first (``races.json`` is not one), with the PIDs holding it."""
        found: dict[str, Entry] = {}
        for pattern in PATTERNS:
            for path in self.root.glob(pattern):
                if not path.is_file() or path.name in KEEP or path.name.startswith("."):
                    continue
                try:
                    stat = path.stat()
                except OSError:  # removed meanwhile (another process trimming)
                    continue
                entry = found.setdefault(entry_name(path), Entry(entry_name(path)))
                if path in entry.files:
                    continue
                entry.files.append(path)
                entry.bytes += stat.st_size
                entry.used = max(entry.used, stat.st_mtime)
        for entry in found.values():
            entry.holders = self.holders(entry.name)
        return sorted(found.values(), key=lambda e: e.used)

    def total(self) -> int:
        """Bytes of every entry."""
        return sum(e.bytes for e in self.entries())

    def temps(self) -> list[Temp]:
        """The temporary files and directories in the cache, each with its owner's PID and whether it is dead."""
        found = []
        try:
            paths = sorted(self.root.iterdir())
        except OSError:
            return []
        for path in paths:
            match = TEMP.match(path.name)
            if match:
                pid = int(match["pid"])
                found.append(Temp(path, _size(path), pid, not pid_alive(pid)))
            elif OLD_TEMP.match(path.name):
                found.append(Temp(path, _size(path), None, True))
        return found

    def survey(self) -> Survey:
        """Everything under the directory, sorted into entries, temporary files, kept and foreign files, with the
        total bytes on disk (the lock and lease files are zero bytes)."""
        entries, temps = self.entries(), self.temps()
        known = {f for e in entries for f in e.files}
        inside = [t.path for t in temps]
        kept, others, total = [], [], 0
        for path in sorted(self.root.rglob("*")) if self.root.is_dir() else []:
            if not path.is_file() or path.is_symlink():
                continue
            size = _size(path)
            total += size
            if path in known or any(t == path or t in path.parents for t in inside):
                continue
            if path.parent == self.root and path.name in KEEP:
                kept.append(path)
            elif self.root / LOCKS not in path.parents or size:
                others.append(path)
        return Survey(entries, temps, kept, others, total)

    @staticmethod
    def touch(*paths: Path) -> None:
        """Mark ``paths`` as just used (a graph opened from the cache)."""
        now = time.time()
        for path in paths:
            try:
                os.utime(path, (now, now))
            except OSError:  # a read-only cache is still a cache
                pass

    # ---- leases ----------------------------------------------------------------------------------------------------
    def lease(self, *paths: Path) -> Lease | None:
        """Hold the entries of ``paths`` (the files a graph that is opened reads) for as long as the returned lease is
        held, and mark them used; ``None`` when one of the files is not there (evicted: build it again). In a cache
        that cannot be written, a lease that holds nothing."""
        with self.lock:
            if not all(Path(p).exists() for p in paths):
                return None
            files = []
            with _LEASES_GUARD:
                for name in dict.fromkeys(entry_name(Path(p)) for p in paths):
                    path = self._lock_file(name, f"lease-{os.getpid()}")
                    held = _LEASED.get(str(path))
                    if held is None:
                        try:
                            path.parent.mkdir(parents=True, exist_ok=True)
                            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
                        except OSError:  # a read-only cache: nobody trims it
                            continue
                        lock_exclusive(fd)
                        held = _LEASED[str(path)] = [fd, 0]
                    held[1] += 1
                    files.append(path)
            self.touch(*paths)
            return Lease(files, self.root)

    def hold(self, build: Callable[[], Sequence[Path]], attempts: int = 3) -> tuple[list[Path], Lease]:
        """``build()`` (which finds or builds a graph and returns the files that opening it reads, the graph first)
        and a lease on those files, built again when another process evicted one of them in between.

        Raises:
            ModelLoadError: evicted ``attempts`` times over (other processes fill the cache past its limit).
        """
        for _ in range(attempts):
            files = [Path(f) for f in build()]
            lease = self.lease(*files)
            if lease is not None:
                with _LEASES_GUARD:
                    fresh = [_FRESH.pop(str(f)) for f in files if str(f) in _FRESH]
                for held in fresh:  # the put's own lease, held from its write to this lease: no eviction between
                    held.release()
                return files, lease
        raise ModelLoadError(f"other processes evicted {files[0].name} from the graph cache {self.root} {attempts} "
                             f"times before it could be opened: they fill it past its limit; raise "
                             f"LAYERWISE_CACHE_LIMIT (now {human(cache_limit())} or more)")

    # ---- writing -----------------------------------------------------------------------------------------------
    def put(self, path: Path, write: Callable[[Path], object], weights_bytes: int = 0, keep: Sequence[Path] = (),
            ready: Callable[[], bool] | None = None) -> bool:
        """Build the entry whose main file is ``path`` (in this cache) once, across processes: under the entry's build
        lock, unless ``ready()`` (default: ``path`` exists) says it is there already (built meanwhile by another process
        or thread, which this call then waited for), ``write(tmp)`` writes ``tmp / path.name`` and any companions named
        ``<entry>.*`` into the temporary directory ``tmp`` (other files there are scratch, removed with it); they are
        renamed into the cache, the main file last, and the cache trimmed to the limit for ``weights_bytes``, never
        removing this entry nor the entries of ``keep`` (what it was built from). ``True`` when this call wrote it.

        Raises:
            LayerwiseError: ``write`` returned without writing ``tmp / path.name``; and whatever ``write`` raised
                (nothing of the write is left behind).
        """
        path = Path(path)
        name = entry_name(path)
        ready = ready or path.exists
        building = FileLock(self._lock_file(name, "lock"))
        said_at = time.monotonic() + SAY_WAIT_S
        while not building.acquire(blocking=False):  # another process or thread builds it: wait, then use theirs
            if time.monotonic() >= said_at:
                notice(f"waiting for another process or thread building {name} in {self.root}")
                building.acquire()
                break
            time.sleep(0.05)
        try:
            if ready():
                return False
            tmp = self.root / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            tmp.mkdir(parents=True)
            try:
                write(tmp)
                made = [f for f in tmp.iterdir() if f.is_file() and not f.name.startswith(".")
                        and entry_name(f) == name]
                if not (tmp / path.name).is_file():
                    raise LayerwiseError(f"building {path.name} wrote no {path.name} (it wrote "
                                         f"{', '.join(sorted(f.name for f in tmp.iterdir())) or 'nothing'})")
                made.sort(key=lambda f: f.name == path.name)  # the main file last: whoever sees it sees it whole
                with self.lock:
                    for f in made:
                        os.replace(f, self.root / f.name)
                    self.touch(*(self.root / f.name for f in made), *keep)
                    fresh = self.lease(self.root / path.name)  # held until hold() leases it (no eviction between)
                    if fresh is not None:
                        with _LEASES_GUARD:
                            before = _FRESH.pop(str(self.root / path.name), None)
                            _FRESH[str(self.root / path.name)] = fresh
                        if before is not None:
                            before.release()
                    _LIMITS[str(self.root)] = limit = cache_limit(weights_bytes)
                    self.trim(limit, keep=(path, *keep), writing=True)
            finally:
                _remove(tmp)
            return True
        finally:
            building.release()

    # ---- removing -----------------------------------------------------------------------------------------------
    def _sweep(self) -> list[Temp]:
        """Remove the dead processes' temporary files, stale lease files and unheld lock files of absent entries
        (under the cache's lock); returns the temporary files removed."""
        dead = [t for t in self.temps() if t.dead]
        for temp in dead:
            _remove(temp.path)
        names = {e.name.replace("/", "+") for e in self.entries()}
        for path in (self.root / LOCKS).glob("*") if (self.root / LOCKS).is_dir() else []:
            lease = LEASE.match(path.name)
            if lease and not holder_alive(path, int(lease["pid"])):
                path.unlink(missing_ok=True)
            elif path.suffix == ".lock" and path.name != self.lock.path.name and path.stem not in names:
                FileLock(path).remove()
        return dead

    def _only_fresh(self, entry: Entry) -> bool:
        """Whether the one hold on ``entry`` is this process's lease from its own write (a put not yet followed by a
        hold): then this process may evict it (the lease guards against the others); the lease is released."""
        if entry.holders != [os.getpid()]:
            return False
        path = str(self._lock_file(entry.name, f"lease-{os.getpid()}"))
        with _LEASES_GUARD:
            fresh = [k for k, lease in _FRESH.items() if path in map(str, lease.files)]
            held = _LEASED.get(path)
            if not fresh or held is None or held[1] != len(fresh):
                return False
            leases = [_FRESH.pop(k) for k in fresh]
        for lease in leases:
            lease.root = None  # (no trim of its own: this trim is running)
            lease.release()
        return True

    def trim(self, limit: int, keep: Iterable[Path] = (), writing: bool = False) -> list[Entry]:
        """Remove the dead processes' temporary files, then the least recently used entries until the cache is within
        ``limit`` bytes, never those of ``keep`` (what was just built) nor those a live process holds a lease on
        (``writing``, a put's own trim: but for this process's leases on graphs it wrote that no hold took up);
        returns the removed entries (also added to :attr:`removed`)."""
        if not self.root.is_dir():
            return []
        with self.lock:
            self._sweep()
            entries = self.entries()
            total = sum(e.bytes for e in entries)
            kept = {entry_name(Path(p)) for p in keep}
            removed = []
            for entry in entries:
                if total <= limit:
                    break
                if entry.name in kept or (entry.holders and not (writing and self._only_fresh(entry))):
                    continue
                for f in entry.files:
                    try:
                        f.unlink()
                    except OSError:
                        pass
                FileLock(self._lock_file(entry.name, "lock")).remove()
                total -= entry.bytes
                removed.append(entry)
        self.removed.extend(removed)
        return removed

    def say(self, weights_bytes: int) -> None:
        """Say the cache's path, size and limit in one line, with what this object's trims removed since it last
        said so (and the entries in use that keep it over its limit)."""
        limit = cache_limit(weights_bytes)
        entries = self.entries()
        total = sum(e.bytes for e in entries)
        removed, self.removed = self.removed, []
        gone = f"; removed the {len(removed)} least recently used ({human(sum(e.bytes for e in removed))})" \
            if removed else ""
        held = sorted({pid for e in entries for pid in e.holders if pid != os.getpid()})
        over = f"; over it by the graphs in use (by processes {', '.join(map(str, held))})" \
            if total > limit and held else ""
        notice(f"graph cache {self.root}: {human(total)} of its {human(limit)} limit (LAYERWISE_CACHE_LIMIT){gone}"
               f"{over}; list or clear it with `layerwise cache`")

    def clear(self) -> Cleared:
        """Remove every entry that no live process holds (``races.json`` too), the dead processes' temporary files and
        the unheld lock files; returns what was removed and the entries kept in use."""
        if not self.root.is_dir():
            return Cleared([], [], [])
        with self.lock:
            temps = self._sweep()
            entries = self.trim(-1)
            for name in KEEP:
                (self.root / name).unlink(missing_ok=True)
            in_use = self.entries()
            self._sweep()
            self.lock.remove(held=self.lock.held())
            try:
                (self.root / LOCKS).rmdir()
            except OSError:  # still holds another process's locks or leases
                pass
        self.removed = []
        return Cleared(entries, temps, in_use)


__all__ = ["Cleared", "Entry", "GraphCache", "KEEP", "LIMIT_FLOOR", "LIMIT_TIMES", "Lease", "PATTERNS", "Survey",
           "Leases", "Temp", "cache_limit", "entry_name"]
