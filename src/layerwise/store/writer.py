"""Corpus-scale extraction into a crash-safe, resumable feature store (the engine of ``layerwise extract``).

The run reads the input as a stream, encodes ``shard_records`` records at a time and writes each batch as one
shard (atomic rename), so memory is bounded by one shard whatever the corpus size, and an interruption loses
at most the shard in progress. The manifest is written before the first shard with the run's options and
provenance; a rerun of the same command resumes after the last finished shard, a rerun with other options is
refused (naming the option) unless ``overwrite=True``, and a finished store is left as it is.

Example::

    >>> import layerwise as lw
    >>> summary = lw.extract("corpus.txt", "feats", layers="-4:", combine="concat", pool="mean")  # doctest: +SKIP
    >>> store = lw.open_store("feats"); store.to_numpy().shape                                   # doctest: +SKIP
    (20000, 1536)
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Callable, Sequence

import numpy as np
import torch

from ..extractor import Extractor
from ..readers import BadRecord, Record, detect_format, read_records
from .plan import (  # noqa: F401 - re-exported: the writer's public names
    FORMAT_VERSION, LEVELS, STORE_DTYPES, ExtractError, ExtractSummary, Level, _count_records, _differences, _Plan,
    _plan, file_sha256, weights_sha256,
)
from .shards import ERRORS, MANIFEST, list_shards, read_json, remove_temporaries, shard_name, write_json, write_shard

_SHARD_BYTES = 32 << 20  # target shard size; bounds memory per shard


class _Run:
    """State of one extraction run into ``store``."""

    def __init__(self, ex: Extractor, store: Path, plan: _Plan, batch_tokens: int):
        self.ex, self.store, self.plan, self.budget = ex, store, plan, batch_tokens
        self.dtype = STORE_DTYPES[plan.options["dtype"]]
        self.level = plan.options["level"]
        self.manifest: dict = {}
        self.shards: list[dict] = []

    # ---- store state -----------------------------------------------------------------------------------
    def open(self, overwrite: bool) -> str:
        """Prepare the directory; returns ``new``, ``resume`` or ``complete``."""
        store = self.store
        mpath = store / MANIFEST
        if store.exists() and not store.is_dir():
            raise ExtractError(f"store path {str(store)!r} is a file; give a directory (new or a layerwise store)")
        if store.is_dir() and any(store.iterdir()) and not mpath.exists():
            raise ExtractError(
                f"{str(store)!r} exists, is not empty and is not a layerwise store (no {MANIFEST}); choose a new or "
                f"empty directory (layerwise never deletes files it did not write)"
            )
        if mpath.exists():
            old = read_json(mpath)
            diffs = _differences(
                {"options": old.get("options", {}), "input": old.get("input", {})},
                {"options": self.plan.options, "input": self.plan.input},
            )
            if diffs and not overwrite:
                raise ExtractError(
                    f"{str(store)!r} holds a store made with other options: {'; '.join(diffs)}. Rerun with the "
                    f"store's options to resume, pick another output directory, or pass --overwrite to replace it"
                )
            if diffs or overwrite:
                self._wipe()
            else:
                self.manifest = old
                remove_temporaries(store)
                self._load_shards()
                return "complete" if old.get("status") == "complete" else "resume"
        store.mkdir(parents=True, exist_ok=True)
        self.manifest = {
            "format": "layerwise-store",
            "format_version": FORMAT_VERSION,
            "layerwise_version": _version(),
            "created": _now(),
            "status": "running",
            "options": self.plan.options,
            "input": self.plan.input,
            "feature_shape": self.plan.feature_shape,
            "counts": {},
            "shards": [],
        }
        write_json(store / MANIFEST, self.manifest)
        (store / ERRORS).write_bytes(b"")
        return "new"

    def _wipe(self) -> None:
        for p in list_shards(self.store):
            p.unlink()
        remove_temporaries(self.store)
        for name in (MANIFEST, ERRORS):
            (self.store / name).unlink(missing_ok=True)

    def _load_shards(self) -> None:
        from .shards import ShardFile

        self.shards = []
        for p in list_shards(self.store):
            sf = ShardFile(p)
            lines = sf.array("lines")
            self.shards.append(
                {"file": p.name, "records": int(lines.shape[0]), "rows": int(sf.shape("features")[0]),
                 "tokens": int(sf.metadata.get("tokens", 0)), "first_line": int(lines[0]),
                 "last_line": int(lines[-1]), "bytes": p.stat().st_size}
            )

    @property
    def done_records(self) -> int:
        return sum(s["records"] for s in self.shards)

    @property
    def resume_line(self) -> int:
        return self.shards[-1]["last_line"] if self.shards else 0

    def trim_errors(self) -> int:
        """Keep the logged errors up to the resume point (later ones are met again); returns how many are kept."""
        path = self.store / ERRORS
        kept = []
        if path.exists():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by the interruption
                if entry.get("line", 0) <= self.resume_line:
                    kept.append(line)
        from .shards import atomic_write_bytes

        atomic_write_bytes(path, "".join(k + "\n" for k in kept).encode("utf-8"))
        return len(kept)

    def write_manifest(self, status: str, skipped_total: int) -> None:
        m = self.manifest
        m["status"] = status
        m["updated"] = _now()
        m["shards"] = self.shards
        m["counts"] = {
            "records": self.done_records,
            "rows": sum(s["rows"] for s in self.shards),
            "tokens": sum(s["tokens"] for s in self.shards),
            "skipped": skipped_total,
            "shards": len(self.shards),
            "bytes": sum(s["bytes"] for s in self.shards),
        }
        write_json(self.store / MANIFEST, m)

    # ---- encoding -----------------------------------------------------------------------------------------
    def encode(self, records: list[Record]) -> tuple[dict[str, np.ndarray], dict[str, str], int]:
        """Features of ``records`` as shard tensors + metadata, and the number of tokens run."""
        o, ex = self.plan.options, self.ex
        words = self.level == "word"
        items = [r.words if r.words is not None else r.text.split() for r in records] if words else [r.text for r in records]
        contexts = [r.context for r in records] if words else []
        if any(c is not None for c in contexts):  # encode with the neighbours; keep the record's own words
            items = [c[0] + w + c[1] if c else w for w, c in zip(items, contexts)]
        if words:
            reduce = ex._word_reducer(o["subword"])
        else:
            reduce = ex._sentence_reducer(o["pool"] if self.level == "sentence" else None, bool(o["skip_special_tokens"]))
        d = int(np.prod(self.plan.feature_shape))
        sentence = self.level == "sentence"
        feats = np.empty((len(records), d), dtype=self.dtype) if sentence else None  # filled in place
        out: list = [None] * len(records)
        ids: list = [None] * len(records)
        tokens = 0
        for index, vec, tok in ex._stream(
            items, words=words, layers=self.plan.layers, site=o["site"], combine=o["combine"], weights=o["weights"],
            reduce=reduce, truncate=o["truncate"], batch_tokens=self.budget,
        ):
            if sentence:
                feats[index] = vec.reshape(d).to("cpu", torch.float32).numpy()
            else:
                if words and contexts and contexts[index]:
                    left = len(contexts[index][0])
                    vec = vec[left : left + len(records[index].words)]
                out[index] = vec.reshape(-1, d).to("cpu", torch.float32).numpy().astype(self.dtype, copy=False)
                ids[index] = tok.ids
            tokens += len(tok.ids)
        tensors: dict[str, np.ndarray] = {"lines": np.array([r.line for r in records], dtype=np.int64)}
        if sentence:
            tensors["features"] = feats
        else:
            lengths = [v.shape[0] for v in out]
            tensors["features"] = np.concatenate(out) if out else np.zeros((0, d), self.dtype)
            del out
            tensors["offsets"] = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            if self.level == "token":
                tensors["token_ids"] = np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])
        meta = {"tokens": str(tokens)}
        keep = self.plan.input["keep"]
        if keep:
            meta["columns"] = json.dumps({k: [r.fields.get(k) for r in records] for k in keep}, ensure_ascii=False)
        if words:
            meta["words"] = json.dumps([r.words if r.words is not None else r.text.split() for r in records],
                                       ensure_ascii=False)
        return tensors, meta, tokens

    def flush(self, records: list[Record]) -> tuple[int, int, float]:
        """Encode and write one shard; returns (tokens, bytes, seconds spent writing)."""
        tensors, meta, tokens = self.encode(records)
        t0 = time.perf_counter()
        name = shard_name(len(self.shards))
        size = write_shard(self.store / name, tensors, meta)
        self.shards.append(
            {"file": name, "records": len(records), "rows": int(tensors["features"].shape[0]), "tokens": tokens,
             "first_line": records[0].line, "last_line": records[-1].line, "bytes": size}
        )
        return tokens, size, time.perf_counter() - t0


def _version() -> str:
    from .. import __version__

    return __version__


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def extract(
    input: str | os.PathLike,
    store: str | os.PathLike,
    *,
    model: str | os.PathLike | Extractor | None = None,
    layers=-1,
    site: str = "block",
    combine: str = "concat",
    weights: Sequence[float] | None = None,
    pool: str | None = "mean",
    level: Level = "sentence",
    subword: str = "first",
    skip_special_tokens: bool = False,
    truncate: bool = False,
    dtype: str = "float32",
    format: str | None = None,
    text_field: str | None = None,
    keep: Sequence[str] = (),
    batch_tokens: int | None = None,
    max_records: int | None = None,
    shard_records: int | None = None,
    strict: bool = False,
    overwrite: bool = False,
    device: str | None = None,
    progress: bool | None = None,
    stdin: IO[bytes] | None = None,
    on_shard: Callable[[int], None] | None = None,
    context: str | None = None,
) -> ExtractSummary:
    """Extract features for every record of ``input`` into the store directory ``store``.

    Args:
        input: a corpus file (txt, jsonl, csv, tsv, parquet, CoNLL-2003, CoNLL-U) or ``"-"`` for stdin.
        store: output directory; created, resumed, or (``overwrite``) replaced.
        model: model directory / hub id / an :class:`Extractor` (default: embedded all-MiniLM-L6-v2).
        layers, site, combine, weights: as in :meth:`Extractor.encode` (combine must be a named mode).
        pool: sentence pool (``level="sentence"``).
        level: ``sentence`` (``[records, D]``), ``token`` (one row per token, special tokens included) or
            ``word`` (one row per word: CoNLL words, else whitespace-split words; pooled with ``subword``).
        dtype: ``float32`` or ``float16`` on disk (compute stays in the model's dtype).
        format, text_field, keep: see :func:`layerwise.readers.read_records`.
        max_records: stop after this many records in the store.
        shard_records: records per shard (default: about 64 MB of features per shard).
        strict: stop at the first bad record (``ExtractError`` with its line and reason) instead of skipping it.
        progress: show a progress bar (default: when stderr is a terminal).
        on_shard: called with the shard count after each shard is written (tests, monitoring).
        context: ``"document"`` (CoNLL-2003, word level): encode each sentence with its neighbours from the same
            document and keep its own words' features (the BERT paper's NER setting).

    Returns:
        An :class:`ExtractSummary`.

    Raises:
        ExtractError (a ValueError): bad options, a store made with other options, a non-store directory,
            a bad record under ``strict``.
    """
    input_path = os.fspath(input)
    fmt = detect_format(input_path, format)
    if max_records is not None and (isinstance(max_records, bool) or not isinstance(max_records, int) or max_records < 1):
        raise ExtractError(f"max_records must be a positive int, got {max_records!r}")
    if shard_records is not None and (not isinstance(shard_records, int) or shard_records < 1):
        raise ExtractError(f"shard_records must be a positive int, got {shard_records!r}")
    if input_path != "-" and not Path(input_path).is_file():
        raise ExtractError(f"input file {input_path!r} does not exist (or is not a file)")
    ex = model if isinstance(model, Extractor) else Extractor(model, device=device)
    budget = ex._check_budget(batch_tokens or ex.batch_tokens)
    plan = _plan(
        ex, input_path, fmt, layers=layers, site=site, combine=combine, weights=weights, pool=pool, level=level,
        subword=subword, skip_special_tokens=skip_special_tokens, truncate=truncate, dtype=dtype,
        text_field=text_field, keep=keep, context=context,
    )
    # Start reading before touching the store: header and --keep problems must not leave a store behind.
    if context not in (None, "document"):
        raise ExtractError(f"unknown context {context!r}. Valid values are: document (or None)")
    if context == "document" and level != "word":
        raise ExtractError("context='document' gives word features: use it with level='word'")
    items = read_records(input_path, fmt, text_field=text_field, keep=keep, stdin=stdin,
                         document_context=context == "document")
    first = next(items, None)
    items = itertools.chain([first] if first is not None else [], items)
    run = _Run(ex, Path(store), plan, budget)
    state = run.open(overwrite)
    summary = ExtractSummary(store=os.fspath(store), resumed_from=run.done_records)
    if state == "complete" or (state == "resume" and max_records is not None and run.done_records >= max_records):
        summary.status, summary.total_records = "already_complete", run.done_records
        return summary
    skipped_before = run.trim_errors()
    t_start = time.perf_counter()
    per_shard = shard_records or max(16, _SHARD_BYTES // (int(np.prod(plan.feature_shape)) * np.dtype(run.dtype).itemsize * (1 if level == "sentence" else 48)))
    show = sys.stderr.isatty() if progress is None else progress
    total = _count_records(input_path, fmt) if show else None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=run.done_records, disable=not show, unit="rec", desc="extract", file=sys.stderr,
               dynamic_ncols=True)
    buffer: list[Record] = []
    limit = max_records
    errors_fh = open(run.store / ERRORS, "a", encoding="utf-8")

    def flush() -> None:
        tokens, size, wsec = run.flush(buffer)
        summary.records += len(buffer)
        summary.tokens += tokens
        summary.bytes_written += size
        summary.write_seconds += wsec
        summary.shards_written += 1
        run.write_manifest("running", skipped_before + summary.skipped)
        bar.update(len(buffer))
        elapsed = time.perf_counter() - t_start
        bar.set_postfix_str(f"{summary.tokens / max(elapsed, 1e-9):,.0f} tok/s, {summary.skipped} skipped")
        buffer.clear()
        if on_shard is not None:
            on_shard(len(run.shards))

    try:
        if limit is None or run.done_records < limit:
            for item in items:
                if item.line <= run.resume_line:
                    continue  # finished before the interruption
                if isinstance(item, BadRecord):
                    if strict:
                        if buffer:
                            flush()
                        raise ExtractError(f"bad record at line {item.line} of {input_path}: {item.reason} (--strict)")
                    errors_fh.write(json.dumps({"line": item.line, "reason": item.reason}, ensure_ascii=False) + "\n")
                    errors_fh.flush()
                    summary.skipped += 1
                    continue
                buffer.append(item)
                if len(buffer) >= per_shard:
                    flush()
                if limit is not None and run.done_records + len(buffer) >= limit:
                    break
            if buffer:
                flush()
    finally:
        bar.close()
        errors_fh.close()
    exhausted = limit is None or run.done_records < limit
    summary.status = "complete" if exhausted else "partial"
    run.write_manifest(summary.status, skipped_before + summary.skipped)
    summary.seconds = time.perf_counter() - t_start
    summary.total_records = run.done_records
    return summary
