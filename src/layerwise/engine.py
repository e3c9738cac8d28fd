"""The extraction engine: stream a corpus through an Extractor into a crash-safe, resumable feature store.

The engine reads the input as a stream, encodes ``shard_records`` records at a time with
:meth:`Extractor.stream <layerwise.Extractor.stream>` and hands each batch to a
:class:`~layerwise.store.StoreWriter` as one shard (written to a temporary name, then renamed), so memory is bounded
by one shard whatever the corpus size and an interruption loses at most the shard in progress. The manifest is
written before the first shard; a rerun of the same command resumes after the last finished shard, a rerun with
other options is refused (naming the option) unless ``overwrite``, and a finished store is left as it is. Bad
records are logged with their line and reason (or stop the run under ``strict``); a full disk stops the run with
one message naming the store and the shard, and the same command resumes once space is freed.

Steps: :func:`extract` = validate the options -> build the store header -> open the store (new / resume /
complete) -> the record loop (skip finished lines, log bad records, flush shards) -> finish the manifest.

Example::

    >>> import layerwise as lw
    >>> spec = lw.EncodeSpec(layers="-4:", combine="concat", pool="mean")
    >>> summary = lw.extract("corpus.txt", "feats", spec)                   # doctest: +SKIP
    >>> lw.open_store("feats").to_numpy().shape                             # doctest: +SKIP
    (20000, 1536)
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import numpy as np
import torch

from .extractor import Extractor, check_budget
from .provenance import HashingStream, StreamMismatch, file_sha256
from .readers import BadRecord, Item, ReadOptions, Record, count_records, detect_format, read_records
from .spec import EncodeSpec
from .store import STORE_DTYPES, StoreError, StoreWriter

SHARD_BYTES = 32 << 20  # target shard size (32 MB of features); bounds memory per shard
TOKENS_PER_RECORD = 48  # a guess for token/word-level shard sizing (rows per record)


class ExtractError(ValueError):
    """A run that cannot start or must stop: bad options, a store mismatch, a full disk, a bad record (strict)."""


@dataclass(frozen=True)
class ExtractOptions:
    """How an extraction runs (what it computes is the :class:`~layerwise.EncodeSpec`).

    Attributes:
        batch_tokens: token budget per forward batch (default: the Extractor's).
        max_records: stop once the store holds this many records (``status`` ``partial``).
        shard_records: records per shard (default: about 32 MB of features per shard).
        strict: stop at the first bad record (``ExtractError`` with its line and reason) instead of skipping it.
        overwrite: replace a store made with other options.
        progress: show a progress bar (default: when stderr is a terminal).
    """

    batch_tokens: int | None = None
    max_records: int | None = None
    shard_records: int | None = None
    strict: bool = False
    overwrite: bool = False
    progress: bool | None = None

    def __post_init__(self) -> None:
        for name in ("max_records", "shard_records", "batch_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ExtractError(f"{name} must be a positive int, got {value!r}")


@dataclass
class ExtractSummary:
    """What one run did. ``records``/``tokens``/``skipped`` count this run; ``total_records`` the whole store."""

    store: str
    records: int = 0
    tokens: int = 0
    skipped: int = 0
    seconds: float = 0.0
    write_seconds: float = 0.0
    bytes_written: int = 0
    shards_written: int = 0
    total_records: int = 0
    resumed_from: int = 0
    status: str = "complete"  # complete | partial (stopped at max_records) | already_complete
    started: float = field(default_factory=time.perf_counter, repr=False)

    @property
    def tokens_per_second(self) -> float:
        """Tokens encoded per second of this run."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """The one-line summary the command prints."""
        if self.status == "already_complete":
            return f"{self.store}: already complete ({_count(self.total_records, 'record')}); nothing to do"
        resumed = f", resumed after {_count(self.resumed_from, 'record')}" if self.resumed_from else ""
        return (
            f"{_count(self.records, 'record')}, {_count(self.tokens, 'token')} in {self.seconds:.1f}s "
            f"({self.tokens_per_second:,.0f} tokens/s), {self.bytes_written / 1e6:,.1f} MB in "
            f"{_count(self.shards_written, 'shard')}, {self.skipped:,} skipped{resumed} -> {self.store} "
            f"({_count(self.total_records, 'record')})"
        )


def _count(n: int, noun: str) -> str:
    """``"1 record"``, ``"2,000 records"``."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


# ---- step 1 and 2: validate, build the header -----------------------------------------------------------------
def _check(spec: EncodeSpec, reading: ReadOptions, input_path: str) -> None:
    if isinstance(spec.combine, torch.nn.Module) or isinstance(spec.pool, torch.nn.Module):
        raise ExtractError("a store needs named modes (modules cannot be written to its manifest); "
                           "use combine/pool names, e.g. combine='concat', pool='mean'")
    if reading.context == "document" and spec.level != "word":
        raise ExtractError("context='document' gives word features: use it with level='word'")
    if input_path != "-" and not Path(input_path).is_file():
        raise ExtractError(f"input file {input_path!r} does not exist (or is not a file)")


def store_header(ex: Extractor, spec: EncodeSpec, input_path: str, fmt: str, reading: ReadOptions) -> dict[str, Any]:
    """What a store records about a run: the resolved spec, the model, the tokenizer, the input, the feature shape."""
    tok = ex.tokenizer
    lm = ex.loaded
    return {
        "spec": spec.to_dict(),
        "model": {"name": lm.name, "fingerprint": ex.fingerprint(), "family": lm.family.name,
                  "num_layers": ex.num_layers, "hidden_size": ex.hidden_size},
        "tokenizer": {"class": type(tok).__name__, "vocab_size": len(tok), "max_length": ex.max_length,
                      "stride": ex.stride, "do_lower_case": getattr(tok, "do_lower_case", None)},
        "input": {**reading.to_dict(), "path": os.path.abspath(input_path) if input_path != "-" else "-",
                  "format": fmt, "sha256": file_sha256(input_path) if input_path != "-" else None},
        "feature_shape": list(spec.feature_shape(ex.site_width(spec.site))),
    }


# ---- one shard's tensors --------------------------------------------------------------------------------------
def shard_tensors(
    ex: Extractor, spec: EncodeSpec, records: list[Record], keep: tuple[str, ...], batch_tokens: int
) -> tuple[dict[str, np.ndarray], dict[str, str], int]:
    """Features of ``records`` as the shard tensors of :mod:`layerwise.store.layout`, its metadata, and its tokens.

    Word level with CoNLL document context: each record is encoded with its neighbours and keeps its own words.
    """
    words = spec.level == "word"
    own = [r.words if r.words is not None else r.text.split() for r in records] if words else []
    items: list[Any] = [r.text for r in records] if not words else [
        (r.context[0] + w + r.context[1]) if r.context else w for r, w in zip(records, own)]
    dtype = STORE_DTYPES[spec.dtype]
    d = int(np.prod(spec.feature_shape(ex.site_width(spec.site))))
    sentence = spec.level == "sentence"
    feats = np.empty((len(records), d), dtype=dtype) if sentence else None  # filled in place
    rows: list[np.ndarray] = []
    ids: list[list[int]] = []
    tokens = 0
    for res in ex.stream(items, spec, batch_tokens=batch_tokens):
        vec, rec = res.features, records[res.index]
        if words and rec.context:
            vec = vec[len(rec.context[0]) : len(rec.context[0]) + len(own[res.index])]
        if sentence:
            feats[res.index] = vec.reshape(d).numpy()  # type: ignore[index]
        else:
            rows.append(vec.reshape(-1, d).numpy())
            ids.append(res.tokens.ids)
        tokens += len(res.tokens.ids)
    tensors: dict[str, np.ndarray] = {"lines": np.array([r.line for r in records], dtype=np.int64)}
    if feats is not None:
        tensors["features"] = feats
    else:
        tensors["features"] = np.concatenate(rows) if rows else np.zeros((0, d), dtype)
        tensors["offsets"] = np.concatenate([[0], np.cumsum([r.shape[0] for r in rows])]).astype(np.int64)
        if spec.level == "token":
            tensors["token_ids"] = np.concatenate([np.asarray(i, dtype=np.int32) for i in ids])
    meta = {"tokens": str(tokens)}
    if keep:
        meta["columns"] = json.dumps({k: [r.fields.get(k) for r in records] for k in keep}, ensure_ascii=False)
    if words:
        meta["words"] = json.dumps(own, ensure_ascii=False)
    return tensors, meta, tokens


def _item_key(item: Item) -> list[Any]:
    """What identifies a record of a stream (its line, text, words and kept fields, or its error)."""
    if isinstance(item, BadRecord):
        return [item.line, "bad", item.reason]
    return [item.line, item.text, item.words, item.fields]


# ---- step 3 and 4: the run -------------------------------------------------------------------------------------
class _Run:
    """One run into an opened store: the record loop, shard flushing and the progress bar."""

    def __init__(self, ex: Extractor, spec: EncodeSpec, writer: StoreWriter, reading: ReadOptions,
                 options: ExtractOptions, summary: ExtractSummary, on_shard: Callable[[int], None] | None,
                 stream: HashingStream | None = None):
        self.ex, self.spec, self.writer, self.reading, self.options = ex, spec, writer, reading, options
        self.summary, self.on_shard, self.stream = summary, on_shard, stream
        # stdin has no file hash: the records read are hashed as they pass, so a resume can check its prefix
        self.consumed = hashlib.sha256() if stream is not None else None
        self.budget = check_budget(ex.batch_tokens if options.batch_tokens is None else options.batch_tokens)
        self.skipped_before = writer.trim_errors()
        d = int(np.prod(writer.header["feature_shape"]))
        rows = 1 if spec.level == "sentence" else TOKENS_PER_RECORD
        itemsize = STORE_DTYPES[spec.dtype]().itemsize
        self.per_shard = options.shard_records or max(16, SHARD_BYTES // (d * itemsize * rows))
        self.buffer: list[Record] = []

    def loop(self, items: Iterator[Item], input_path: str, bar: Any) -> None:
        """Read records after the resume point, log or raise on bad ones, flush full shards."""
        limit, w = self.options.max_records, self.writer
        if limit is not None and w.done_records >= limit:
            return
        prefix = w.manifest.get("input", {}).get("prefix") if self.consumed is not None else None
        for item in items:
            if prefix is not None and item.line > prefix["line"]:
                self._check_prefix(prefix)
                prefix = None
            if self.consumed is not None:
                self.consumed.update(json.dumps(_item_key(item), ensure_ascii=False).encode())
            if item.line <= w.resume_line:
                continue  # finished before the interruption
            if isinstance(item, BadRecord):
                self._bad(item, input_path, bar)
                continue
            self.buffer.append(item)
            if len(self.buffer) >= self.per_shard:
                self.flush(bar)
            if limit is not None and w.done_records + len(self.buffer) >= limit:
                break
        if prefix is not None:  # the input ended before the point the store had reached
            self._check_prefix(prefix)
        if self.buffer:
            self.flush(bar)

    def _check_prefix(self, prefix: dict[str, Any]) -> None:
        got = self.consumed.hexdigest() if self.consumed is not None else ""
        if got != prefix["sha256"]:
            raise StreamMismatch(
                f"the input differs from the one this store was started with: its records up to line "
                f"{prefix['line']} hash to {got[:12]}, the store recorded {prefix['sha256'][:12]}"
            )

    def _bad(self, item: BadRecord, input_path: str, bar: Any) -> None:
        if self.options.strict:
            if self.buffer:
                self.flush(bar)
            raise ExtractError(f"bad record at line {item.line} of {input_path}: {item.reason} (--strict)")
        self.writer.log_error(item.line, item.reason)
        self.summary.skipped += 1

    def flush(self, bar: Any) -> None:
        """Encode the buffered records and write them as the next shard; update the manifest and the bar."""
        tensors, meta, tokens = shard_tensors(self.ex, self.spec, self.buffer, self.reading.keep, self.budget)
        t0 = time.perf_counter()
        size = self.writer.write_shard(tensors, meta, tokens=tokens)
        if self.consumed is not None:  # what a resume must find again at the start of its stdin
            self.writer.record_input(prefix={"line": self.writer.resume_line, "sha256": self.consumed.hexdigest()})
        self.writer.write_manifest("running", self.skipped_before + self.summary.skipped)
        s = self.summary
        s.write_seconds += time.perf_counter() - t0
        s.records += len(self.buffer)
        s.tokens += tokens
        s.bytes_written += size
        s.shards_written += 1
        bar.update(len(self.buffer))
        bar.set_postfix_str(f"{s.tokens / max(time.perf_counter() - s.started, 1e-9):,.0f} tok/s, {s.skipped} skipped")
        self.buffer.clear()
        if self.on_shard is not None:
            self.on_shard(len(self.writer.shards))

    def finish(self) -> None:
        """Write the final manifest: ``complete`` when the input was exhausted, ``partial`` at ``max_records``."""
        limit, w, s = self.options.max_records, self.writer, self.summary
        s.status = "complete" if limit is None or w.done_records < limit else "partial"
        if self.stream is not None and s.status == "complete":
            self.stream.drain()
            w.record_input(sha256=self.stream.hexdigest(), bytes=self.stream.count)
        w.write_manifest(s.status, self.skipped_before + s.skipped)
        s.seconds = time.perf_counter() - s.started
        s.total_records = w.done_records


def extract(
    input: str | os.PathLike,
    output: str | os.PathLike,
    spec: EncodeSpec | None = None,
    *,
    model: str | os.PathLike | Extractor | None = None,
    reading: ReadOptions | None = None,
    options: ExtractOptions | None = None,
    stdin: IO[bytes] | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> ExtractSummary:
    """Extract features for every record of ``input`` into the store directory ``output``.

    Args:
        input: a corpus file (txt, jsonl, csv, tsv, parquet, CoNLL-2003, CoNLL-U) or ``"-"`` for stdin.
        output: the store directory; created, resumed, or (``options.overwrite``) replaced.
        spec: what to compute (default ``EncodeSpec()``: the last layer, mean-pooled sentence vectors). Level
            ``word`` uses a CoNLL file's words, else whitespace-separated words.
        model: model directory / hub id / an :class:`Extractor` (default: embedded all-MiniLM-L6-v2).
        reading: input format, text field, kept columns, CoNLL document context (:class:`~layerwise.ReadOptions`).
        options: batch budget, record limit, shard size, strict, overwrite, progress (:class:`ExtractOptions`).
        stdin: a binary stream to read for ``"-"`` instead of ``sys.stdin`` (tests).
        on_shard: called with the shard count after each shard is written (tests, monitoring).

    Returns:
        An :class:`ExtractSummary`. The store holds ``[records, *D]`` (sentence) or ragged ``[rows, *D]``.

    Raises:
        ExtractError (a ValueError): bad options, a store made with other options, a non-store directory,
            a bad record under ``strict``, a full disk (the message says how to resume).
    """
    if not isinstance(input, (str, os.PathLike)):
        raise TypeError(
            f"input must be a file path or '-' (stdin), got {type(input).__name__}; to encode records held in "
            f"memory use Extractor.stream(records, spec) or Extractor.encode(texts)"
        )
    spec = spec or EncodeSpec()
    reading = reading or ReadOptions()
    options = options or ExtractOptions()
    input_path = os.fspath(input)
    fmt = detect_format(input_path, reading.format)
    _check(spec, reading, input_path)
    ex = model if isinstance(model, Extractor) else Extractor(model)
    spec = spec.resolve(ex)
    header = store_header(ex, spec, input_path, fmt, reading)
    # Start reading before touching the store: header and --keep problems must not leave a store behind.
    stream = HashingStream(stdin if stdin is not None else sys.stdin.buffer) if input_path == "-" else None
    items = read_records(input_path, fmt, text_field=reading.text_field, keep=reading.keep,
                         stdin=io.BufferedReader(stream) if stream is not None else None,
                         document_context=reading.context == "document")
    first = next(items, None)
    items = itertools.chain([first] if first is not None else [], items)
    try:
        return _write(ex, spec, StoreWriter(output, header), items, input_path, fmt, reading, options, on_shard,
                      stream)
    except StoreError as exc:
        raise ExtractError(str(exc)) from None
    except StreamMismatch as exc:
        raise ExtractError(f"stdin: {exc}. Give the same input to resume, or --overwrite to start again") from None


def _write(ex: Extractor, spec: EncodeSpec, writer: StoreWriter, items: Iterator[Item], input_path: str, fmt: str,
           reading: ReadOptions, options: ExtractOptions, on_shard: Callable[[int], None] | None,
           stream: HashingStream | None) -> ExtractSummary:
    state = writer.open(options.overwrite)
    summary = ExtractSummary(store=os.fspath(writer.path), resumed_from=writer.done_records)
    limit = options.max_records
    recorded = writer.manifest.get("input", {})
    if stream is not None and state == "complete" and recorded.get("sha256"):
        stream.drain()  # a finished stdin store: the whole new input must be the one it was made from
        if stream.hexdigest() != recorded["sha256"]:
            raise StreamMismatch(f"the input differs from the one this store was made from: sha256 "
                                 f"{stream.hexdigest()[:12]}, the store recorded {recorded['sha256'][:12]}")
    if state == "complete" or (state == "resume" and limit is not None and writer.done_records >= limit):
        summary.status, summary.total_records = "already_complete", writer.done_records
        return summary
    run = _Run(ex, spec, writer, reading, options, summary, on_shard, stream)
    show = sys.stderr.isatty() if options.progress is None else options.progress
    from tqdm.auto import tqdm

    total = count_records(input_path, fmt) if show else None
    with tqdm(total=total, initial=writer.done_records, disable=not show, unit="rec", desc="extract",
              file=sys.stderr, dynamic_ncols=True) as bar:
        run.loop(items, input_path, bar)
    run.finish()
    return summary


__all__ = ["ExtractError", "ExtractOptions", "ExtractSummary", "extract", "shard_tensors", "store_header"]
