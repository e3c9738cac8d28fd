"""Checking a store's shards against its manifest: cheap checks on every open, every hash in ``verify``.

Three depths, one set of rules:

* **sizes** (:func:`size_problems`, on every open): each listed shard exists and has the listed byte size;
* **header** (:func:`open_shard`, on a shard's first use): its safetensors header parses, its tensors have the
  shapes and dtypes the manifest implies (records, rows, the level's tensors, the feature width and dtype), it
  carries the store's id and its own index (format 3), and its first and last input lines are the listed ones: a
  truncated, swapped or foreign file is refused before any of its data is returned;
* **full** (:func:`verify_store`, ``layerwise verify``): the sha256 of every byte, and every shard's inner
  consistency (offsets start at 0 and never decrease and end at the row count, lines strictly increase, word lists
  and kept columns have one entry per record, the token count).

A resume relies on every listed shard: :func:`first_damaged` checks sizes, headers and every shard's sha256 (several
shards at a time, streamed), and the writer recomputes from the first damaged one.

Problems are strings that name the shard file and what is wrong; :class:`VerifyReport` collects them.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..encoding.spec import EncodeSpec
from ..errors import StoreCorruptError, StoreError
from .layout import RESTORE, STORE_DTYPES, ShardFile, file_sha256, list_shards, shard_index, shard_name
from .lock import lock_state
from .manifest import read_manifest
from .parts import is_parted, read_parts


@dataclass(frozen=True)
class Expected:
    """What every shard of one store must look like, from its manifest."""

    level: str
    width: int
    dtype: np.dtype
    store_id: str | None
    keep: tuple[str, ...]

    @classmethod
    def of(cls, manifest: dict[str, Any]) -> "Expected":
        """The expectations of a checked manifest (see :func:`~layerwise.store.manifest.read_manifest`)."""
        spec = EncodeSpec.from_dict(manifest["spec"])
        return cls(spec.level, int(np.prod(manifest["feature_shape"])), np.dtype(STORE_DTYPES[spec.output_dtype]),
                   manifest.get("id"), tuple(manifest["input"].get("keep") or ()))


def size_problems(store: Path, entries: list[dict[str, Any]]) -> list[str]:
    """One problem per listed shard that is missing or not of its listed size (a ``stat`` each)."""
    out = []
    for e in entries:
        try:
            size = os.stat(store / e["file"]).st_size
        except FileNotFoundError:
            out.append(f"{e['file']}: missing (listed with {e['records']} records, lines {e['first_line']}.."
                       f"{e['last_line']})")
            continue
        if size != e["bytes"]:
            out.append(f"{e['file']}: {size:,} bytes, listed with {e['bytes']:,}"
                       + (" (cut short)" if size < e["bytes"] else ""))
    return out


def header_problems(shard: ShardFile, entry: dict[str, Any], expected: Expected) -> list[str]:
    """What in a shard's header (and its first and last line) disagrees with its manifest entry."""
    out: list[str] = []
    name = entry["file"]
    records, rows, w = entry["records"], entry["rows"], expected.width

    def need(tensor: str, dtype: Any, shape: tuple[int, ...]) -> bool:
        if tensor not in shard:
            out.append(f"{name}: no {tensor!r} tensor")
            return False
        if shard.dtype(tensor) != np.dtype(dtype) or shard.shape(tensor) != shape:
            out.append(f"{name}: {tensor!r} is {shard.dtype(tensor)} {list(shard.shape(tensor))}, the manifest says "
                       f"{np.dtype(dtype)} {list(shape)}")
            return False
        return True

    if shard.size != entry["bytes"]:
        out.append(f"{name}: {shard.size:,} bytes, listed with {entry['bytes']:,}")
    if expected.level == "sentence" and rows != records:
        out.append(f"{name}: listed with {rows} rows for {records} records at sentence level")
    need("features", expected.dtype, (rows, w))
    lines_ok = need("lines", np.int64, (records,))
    if expected.level != "sentence":
        need("offsets", np.int64, (records + 1,))
    if expected.level == "token":
        need("token_ids", np.int32, (rows,))
    if expected.level == "word" and "words" not in shard.metadata:
        out.append(f"{name}: no 'words' metadata in a word-level store")
    meta = shard.metadata
    if expected.store_id is not None and meta.get("store") not in (None, expected.store_id):
        out.append(f"{name}: belongs to another store (id {meta.get('store')!r}, this store is {expected.store_id!r})")
    if "shard" in meta and meta["shard"] != str(shard_index(name)):
        out.append(f"{name}: holds shard {meta['shard']} (a copy or a swap of another shard's file)")
    if expected.store_id is not None and ("store" not in meta or "shard" not in meta):
        out.append(f"{name}: does not carry this store's id and its index: not a shard written for this store")
    if lines_ok and records:
        lines = shard.array("lines")
        first, last = int(lines[0]), int(lines[-1])
        if (first, last) != (entry["first_line"], entry["last_line"]):
            out.append(f"{name}: holds lines {first}..{last}, listed with {entry['first_line']}..{entry['last_line']}")
    return out


def open_shard(store: Path, entry: dict[str, Any], expected: Expected) -> ShardFile:
    """Open a listed shard for reading after the header checks (see the module docstring).

    Raises:
        StoreCorruptError: the file is missing, unreadable as safetensors, or disagrees with the manifest
            (naming the file, what is wrong, and the fix).
    """
    path = store / entry["file"]
    if not path.is_file():
        raise StoreCorruptError(f"store {str(store)!r}: shard {entry['file']} is missing (listed with "
                                f"{entry['records']} records); {RESTORE}", file=str(path), problem="missing")
    shard = ShardFile(path)
    problems = header_problems(shard, entry, expected)
    if problems:
        raise StoreCorruptError(f"store {str(store)!r}: shard {'; '.join(problems)}; {RESTORE}", file=str(path),
                                problem="; ".join(p.split(": ", 1)[1] for p in problems))
    return shard


def content_problems(shard: ShardFile, entry: dict[str, Any], expected: Expected) -> list[str]:
    """What in a shard's data is inconsistent (offsets, lines, word lists, kept columns, token count)."""
    out: list[str] = []
    name = entry["file"]
    lines = np.asarray(shard.array("lines"))
    if lines.size > 1 and not bool(np.all(np.diff(lines) > 0)):
        out.append(f"{name}: input lines do not strictly increase")
    n = entry["records"]
    lengths = None
    if expected.level != "sentence":
        off = np.asarray(shard.array("offsets"))
        if off[0] != 0 or off[-1] != entry["rows"] or not bool(np.all(np.diff(off) >= 0)):
            out.append(f"{name}: offsets do not run from 0 up to its {entry['rows']} rows")
        else:
            lengths = np.diff(off)
    try:
        if expected.level == "word":
            words = shard.json_meta("words")
            if not isinstance(words, list) or len(words) != n or (
                    lengths is not None and [len(w) for w in words] != lengths.tolist()):
                out.append(f"{name}: its word lists do not match its {n} records and their rows")
        columns = shard.json_meta("columns", {})
        if expected.keep and (not isinstance(columns, dict) or sorted(columns) != sorted(expected.keep)
                              or any(not isinstance(v, list) or len(v) != n for v in columns.values())):
            out.append(f"{name}: its kept columns are not {list(expected.keep)} with {n} values each")
    except StoreCorruptError as exc:
        out.append(f"{name}: {exc.problem}")
    if str(entry["tokens"]) != shard.metadata.get("tokens", str(entry["tokens"])):
        out.append(f"{name}: holds {shard.metadata.get('tokens')} tokens, listed with {entry['tokens']}")
    return out


def hash_problem(store: Path, entry: dict[str, Any]) -> str | None:
    """The problem with a shard's sha256 (``None`` when it matches or none is listed: format 2)."""
    want = entry.get("sha256")
    if want is None:
        return None
    got = file_sha256(store / entry["file"])
    if got == want:
        return None
    return f"{entry['file']}: sha256 {got[:12]}..., listed with {want[:12]}... (its bytes changed)"


def unlisted_files(store: Path, entries: list[dict[str, Any]]) -> list[str]:
    """Shard-named files in ``store`` that its manifest does not list (ignored by every reader)."""
    listed = {e["file"] for e in entries}
    return [p.name for p in list_shards(store) if p.name not in listed]


def shard_problems(store: Path, entry: dict[str, Any], expected: Expected, *, full: bool) -> list[str]:
    """Every problem of one listed shard: size, header, and with ``full`` its sha256 and inner consistency."""
    sizes = size_problems(store, [entry])
    if sizes:
        return sizes
    try:
        shard = ShardFile(store / entry["file"])
    except StoreCorruptError as exc:
        return [f"{entry['file']}: {exc.problem}"]
    problems = header_problems(shard, entry, expected)
    if full:
        wrong_hash = hash_problem(store, entry)
        if wrong_hash:
            problems.append(wrong_hash)
        if not problems:
            problems += content_problems(shard, entry, expected)
    return problems


RESUME_CHECKS = ("sha256", "headers")  # what a resume checks of every listed shard


def check_resume_mode(check: str) -> str:
    """``check`` when it is one of :data:`RESUME_CHECKS`, else a :class:`~layerwise.StoreError` naming the valid
    ones."""
    if check not in RESUME_CHECKS:
        raise StoreError(f"unknown resume check {check!r}. Valid checks are: {', '.join(RESUME_CHECKS)} (sha256: "
                         f"every byte of every listed shard, the default; headers: sizes and headers, and the last "
                         f"shard's sha256)")
    return check


def _resume_problems(store: Path, entry: dict[str, Any], expected: Expected, hashed: bool) -> list[str]:
    """Size and header, then the sha256 when ``hashed`` (its inner consistency when none is listed: format 2)."""
    problems = shard_problems(store, entry, expected, full=False)
    if problems or not hashed:
        return problems
    if entry.get("sha256") is None:
        return content_problems(ShardFile(store / entry["file"]), entry, expected)
    wrong = hash_problem(store, entry)
    return [wrong] if wrong else []


def first_damaged(store: Path, entries: list[dict[str, Any]], expected: Expected, check: str = "sha256",
                  workers: int | None = None) -> tuple[int, list[str]] | None:
    """What a resume relies on, checked: the first listed shard that is missing or damaged, with its problems
    (``None``: every one is intact).

    ``check="sha256"`` (the default) hashes every byte of every listed shard, streamed (4 MB reads), ``workers``
    shards at a time in threads (sha256 and reads release the GIL; default: the CPUs, at most 8); ``"headers"``
    checks sizes and headers, and hashes the last shard only.
    """
    check = check_resume_mode(check)
    if not entries:
        return None
    last = len(entries) - 1
    full = [check == "sha256" or i == last for i in range(len(entries))]
    n = workers or min(8, os.cpu_count() or 1)
    if n <= 1 or len(entries) == 1:
        for i, e in enumerate(entries):
            problems = _resume_problems(store, e, expected, full[i])
            if problems:
                return i, problems
        return None
    with ThreadPoolExecutor(n, thread_name_prefix="layerwise-resume-check") as pool:
        futures = [pool.submit(_resume_problems, store, e, expected, full[i]) for i, e in enumerate(entries)]
        try:
            for i, future in enumerate(futures):  # in order: the first damaged shard is the one that counts
                problems = future.result()
                if problems:
                    return i, problems
        finally:
            for future in futures:
                future.cancel()
    return None


def entry_of(store: Path, name: str) -> dict[str, Any]:
    """The manifest entry a shard file's own header and ``lines`` give (records, rows, tokens, first and last line,
    bytes, sha256, a stream's ``input_prefix``, the ``runtime`` that computed it).

    Raises:
        StoreCorruptError: the file cannot be read as a shard (no ``lines``/``features``, no records).
    """
    path = store / name
    shard = ShardFile(path)
    try:
        lines = shard.array("lines")
        entry: dict[str, Any] = {"file": name, "records": int(lines.shape[0]),
                                 "rows": int(shard.shape("features")[0]),
                                 "tokens": int(shard.metadata.get("tokens", "0")), "first_line": int(lines[0]),
                                 "last_line": int(lines[-1]), "bytes": shard.size}
    except (KeyError, IndexError, ValueError) as exc:
        raise StoreCorruptError(f"shard {str(path)!r} is damaged: its tensors do not describe records ({exc}); "
                                f"{RESTORE}", file=str(path), problem="its tensors do not describe records") from exc
    prefix = shard.json_meta("input_prefix")
    if prefix is not None:
        entry["input_prefix"] = prefix
    if shard.metadata.get("runtime"):
        entry["runtime"] = shard.metadata["runtime"]  # what computed it
    entry["sha256"] = file_sha256(path)
    return entry


def unlisted_next(store: Path, listed: list[dict[str, Any]], expected: Expected) -> list[dict[str, Any]]:
    """The shards finished after the manifest's last update (an interruption between the two): the files that
    follow the listed ones, each carrying this store's id and the next index, with later lines, passing every
    check. Their entries, in order (a store without an id, format 2, has none)."""
    found: list[dict[str, Any]] = []
    while expected.store_id is not None:
        chain = listed + found
        index = shard_index(chain[-1]["file"]) + 1 if chain else 0
        name = shard_name(index)
        if not (store / name).is_file():
            break
        try:
            entry = entry_of(store, name)
            shard = ShardFile(store / name)
        except StoreCorruptError:
            break
        mine = shard.metadata.get("store") == expected.store_id and shard.metadata.get("shard") == str(index)
        after = chain[-1]["last_line"] if chain else -1
        if not mine or entry["first_line"] <= after or header_problems(shard, entry, expected) or \
                content_problems(shard, entry, expected):
            break
        found.append(entry)
    return found


@dataclass
class VerifyReport:
    """What :func:`verify_store` found.

    Attributes:
        store: the directory. shards, records: how many the manifest lists. runtimes: the runtime the store records
            (``torch``, ``onnx``, ``openvino``, ...), and any other one a shard names (each is a problem).
        problems: one line per problem, naming the file (empty: intact).
        notes: facts that are not damage: hashes absent (format 2), unlisted shard files, a run not finished.
    """

    store: str
    shards: int = 0
    records: int = 0
    runtimes: list[str] = field(default_factory=list)  # the runtime(s) that computed the shards, as recorded
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """No problem found."""
        return not self.problems


def verify_store(path: str | os.PathLike) -> VerifyReport:
    """Check every listed shard of the store at ``path``: size, header, sha256 and inner consistency.

    Returns:
        A :class:`VerifyReport` (``report.ok`` when intact). A damaged manifest is one problem.

    Raises:
        StoreError: ``path`` is not a layerwise store.
    """
    store = Path(path)
    report = VerifyReport(os.fspath(path))
    try:
        manifest = read_manifest(store)
    except StoreCorruptError as exc:
        report.problems.append(f"manifest.json: {exc}")
        return report
    if is_parted(manifest):  # a store of parts: every part whole, each verified as a store
        try:
            parts = read_parts(store, manifest)
        except StoreCorruptError as exc:
            report.problems.append(exc.problem or str(exc))
            return report
        for part in parts:
            sub = verify_store(part.path)
            report.shards += sub.shards
            report.records += sub.records
            report.runtimes += [r for r in sub.runtimes if r not in report.runtimes]
            report.problems += [f"{part.path.name}/{p}" for p in sub.problems]
            report.notes += [f"{part.path.name}: {n}" for n in sub.notes]
        return report
    entries = manifest["shards"]
    report.shards, report.records = len(entries), sum(e["records"] for e in entries)
    expected = Expected.of(manifest)
    for e in entries:
        report.problems += shard_problems(store, e, expected, full=True)
    recorded = (manifest.get("runtime") or {}).get("name") if isinstance(manifest.get("runtime"), dict) else None
    report.runtimes = [recorded] if recorded else []
    for e in entries:  # a store is computed by one runtime from its first record to its last
        if e.get("runtime") and recorded and e["runtime"] != recorded:
            report.problems.append(f"{e['file']}: computed by {e['runtime']!r}, the store by {recorded!r} (a store "
                                   f"mixes no runtimes: rerun the extract command with --overwrite)")
            report.runtimes += [e["runtime"]] if e["runtime"] not in report.runtimes else []
    if manifest["format_version"] < 3:
        report.notes.append("format 2: no sha256 recorded for the shards (sizes and headers checked, not every byte); "
                            "extract again with this version to record them")
    stray = unlisted_files(store, entries)
    if stray:
        report.notes.append(f"{len(stray)} shard file(s) not listed in the manifest, ignored: {', '.join(stray[:5])}"
                            + (" ..." if len(stray) > 5 else ""))
    if manifest["status"] != "complete" or lock_state(store) is not None:
        report.notes.append(run_state(store, manifest["status"]))
    return report


def run_state(store: Path, status: str) -> str:
    """What ``verify`` says about a store whose run is not finished (or is being written): a live writer (from the
    store's lock, :mod:`layerwise.store.lock`), a writer that died, or a run stopped on purpose."""
    lock = lock_state(store)
    if lock is not None and lock.live:
        return f"the run is not finished: {lock.describe()}; verify again once it is done"
    if status == "partial":
        return ("the run is partial (it stopped at its --max-records): rerun the extract command without it, or with "
                "a larger one, to extend the store")
    if lock is not None:
        return (f"the run stopped: {lock.describe()}; rerun the extract command to finish the store (it resumes "
                f"after the last finished shard)")
    return ("the run stopped before it finished (no writer holds the store now): rerun the extract command to finish "
            "it (it resumes after the last finished shard)")


__all__ = ["RESUME_CHECKS", "Expected", "VerifyReport", "check_resume_mode", "entry_of", "first_damaged",
           "header_problems", "open_shard", "run_state", "shard_problems", "size_problems", "unlisted_files",
           "unlisted_next", "verify_store"]
