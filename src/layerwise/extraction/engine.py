"""The extraction engine: stream a corpus through an Extractor into a crash-safe, resumable feature store.

The engine reads the input as a stream, encodes ``shard_records`` records at a time with
:meth:`Extractor.stream <layerwise.Extractor.stream>` and hands each batch to a
:class:`~layerwise.store.StoreWriter` as one shard (written to a temporary name, then renamed), so memory is bounded
by one shard whatever the corpus size and an interruption loses at most the shard in progress. The manifest is
written before the first shard; a rerun of the same command resumes after the last finished shard, a rerun with
other options is refused (naming the option) unless ``overwrite``, and a finished store is left as it is. Bad
records are logged with their line and reason (or stop the run under ``strict``); a full disk stops the run with
one message naming the store and the shard, and the same command resumes once space is freed.

A file input is hashed before the run (the manifest's ``input.sha256``, which a resume compares) and again as it is
read; :class:`~layerwise.extraction.input_check.InputCheck` stops the run when the file changes (checked before each
shard is written) or when what was read is not what was hashed.

stdin (``"-"``) has no file to hash beforehand: its bytes are hashed as they stream and the sha256 is recorded
(``input.sha256``, ``input.bytes``) once the input is exhausted, and each shard records the hash of the records
read up to it (``input_prefix``). A rerun into a finished stdin store reads and hashes its whole stdin and refuses
a different one; a resume of an unfinished one checks that its stdin starts with the records already stored.

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
from typing import IO, Any, Callable, Iterator

import numpy as np
import torch

from ..corpus.readers import BadRecord, Item, ReadOptions, Record
from ..corpus.sources import Source, open_source
from ..encoding.spec import EncodeSpec
from ..errors import ExtractError, LayerwiseError
from ..extractor import Extractor, check_budget
from ..model.options import ModelOptions
from ..provenance import HashingStream
from ..store import STORE_DTYPES, StoreWriter
from ..store.manifest import read_manifest
from .input_check import InputCheck
from .options import ExtractOptions
from .runtime import pinned, recorded_runtime, store_runtime
from .shards import shard_tensors, store_header

SHARD_BYTES = 32 << 20  # target shard size (32 MB of features); bounds memory per shard
TOKENS_PER_RECORD = 48  # a guess for token/word-level shard sizing (rows per record)
RUNTIME_SAMPLE = 64  # the first records, read before the run: their tokens size the corpus for the runtime's choice


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
    repairs: list[str] = field(default_factory=list)  # what the resume found damaged and recomputed, one line each
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


# ---- step 1: validate -----------------------------------------------------------------------------------------
def _check(spec: EncodeSpec, reading: ReadOptions, source: Source) -> None:
    if isinstance(spec.combine, torch.nn.Module) or isinstance(spec.pool, torch.nn.Module):
        raise ExtractError("a store needs named modes (modules cannot be written to its manifest); "
                           "use combine/pool names, e.g. combine='concat', pool='mean'")
    if reading.context == "document" and spec.level != "word":
        raise ExtractError("context='document' gives word features: use it with level='word'")
    if reading.context == "document" and source.fmt != "conll":
        raise ExtractError(f"context='document' needs a CoNLL-2003 input with -DOCSTART- documents, not "
                           f"{source.name} ({source.fmt})")




# ---- stdin: hashed as it passes ---------------------------------------------------------------------------------
class _StdinRecords:
    """The records of a stdin input, hashed as they pass: what each shard records and a resume must find again.

    A record's key is its line, text, words, kept fields and document context (a bad record: its line and reason),
    so the hash covers everything that shaped the stored features. Bytes are hashed separately by the
    :class:`~layerwise.provenance.HashingStream` under the reader (the whole input's ``input.sha256``).
    """

    def __init__(self, stream: HashingStream):
        self.stream = stream
        self.hash = hashlib.sha256()
        self.records = 0
        self.mark: dict[str, Any] | None = None  # the prefix up to the last record put in a shard

    def add(self, item: Item) -> None:
        """Hash one record (good or bad) as it passes."""
        if isinstance(item, BadRecord):
            key: list[Any] = [item.line, "bad", item.reason]
        else:
            key = [item.line, item.text, item.words, item.fields, item.context]
        self.hash.update((json.dumps(key, ensure_ascii=False, default=str) + "\n").encode())
        self.records += 1

    def prefix(self, line: int) -> dict[str, Any]:
        """The records read so far, ending at ``line``: ``{"line", "records", "sha256"}``."""
        return {"line": line, "records": self.records, "sha256": self.hash.hexdigest()}

    def check_whole(self, writer: StoreWriter) -> None:
        """A finished store: read and hash the whole stdin and compare it with the recorded ``input.sha256``."""
        recorded = writer.manifest.get("input", {})
        if not recorded.get("sha256"):
            raise ExtractError(
                f"store {str(writer.path)!r} was made from stdin without a recorded input.sha256 (by an older "
                f"layerwise), so this run cannot tell whether its stdin is the same input; pass --overwrite "
                f"(overwrite=True) to extract it again, or choose another output directory"
            )
        self.stream.drain()
        got = self.stream.hexdigest()
        if got != recorded["sha256"]:
            raise ExtractError(
                f"stdin differs from the input store {str(writer.path)!r} was made from: it has input.sha256 "
                f"{got[:16]}... ({self.stream.count:,} bytes), the store's manifest records input.sha256 "
                f"{recorded['sha256'][:16]}... ({_count(int(recorded.get('bytes') or 0), 'byte')}). Pipe the same "
                f"input to reuse the store, choose another output directory, or pass --overwrite (overwrite=True) "
                f"to replace it"
            )

    def check_prefix(self, writer: StoreWriter, items: Iterator[Item]) -> Iterator[Item]:
        """An unfinished store: read (and hash) the records up to its last finished shard and compare them with
        the ``input_prefix`` that shard recorded; returns the records after it."""
        expected = writer.input_prefix
        if expected is None:
            if writer.shards:
                raise ExtractError(
                    f"store {str(writer.path)!r} holds {_count(writer.done_records, 'record')} read from stdin "
                    f"without a recorded input_prefix (by an older layerwise), so this run cannot tell whether its "
                    f"stdin starts with them; pass --overwrite (overwrite=True) to start again, or choose another "
                    f"output directory"
                )
            return items
        pending: list[Item] = []
        last = 0
        for item in items:
            if item.line > expected["line"]:
                pending.append(item)
                break
            self.add(item)
            last = item.line
        got = self.hash.hexdigest()
        if got != expected["sha256"]:
            if pending or last >= expected["line"]:
                seen = (f"its records up to line {expected['line']} ({_count(self.records, 'record')}) hash to "
                        f"{got[:16]}...")
            else:
                seen = (f"it ended at line {last}" if last else "it was empty") + (
                    f", before line {expected['line']} where the stored records end")
            raise ExtractError(
                f"stdin differs from the input store {str(writer.path)!r} was started with: {seen}; the store's "
                f"last finished shard recorded input_prefix.sha256 {expected['sha256'][:16]}... for its "
                f"{_count(int(expected['records']), 'record')} up to line {expected['line']}. Pipe the same input to "
                f"resume, choose another output directory, or pass --overwrite (overwrite=True) to start again"
            )
        return itertools.chain(pending, items)


# ---- step 3 and 4: the run -------------------------------------------------------------------------------------
class _Run:
    """One run into an opened store: the record loop, shard flushing and the progress bar."""

    def __init__(self, ex: Extractor, spec: EncodeSpec, writer: StoreWriter, reading: ReadOptions,
                 options: ExtractOptions, summary: ExtractSummary, on_shard: Callable[[int], None] | None,
                 stdin: _StdinRecords | None = None, check: InputCheck | None = None):
        self.ex, self.spec, self.writer, self.reading, self.options = ex, spec, writer, reading, options
        self.summary, self.on_shard, self.stdin, self.check = summary, on_shard, stdin, check
        if check is not None:
            check.started(writer)
        self.budget = check_budget(ex.batch_tokens if options.batch_tokens is None else options.batch_tokens)
        self.skipped_before = writer.trim_errors()
        d = int(np.prod(writer.header["feature_shape"]))
        rows = 1 if spec.level == "sentence" else TOKENS_PER_RECORD
        itemsize = STORE_DTYPES[spec.output_dtype]().itemsize
        self.per_shard = options.shard_records or max(16, SHARD_BYTES // (d * itemsize * rows))
        self.buffer: list[Record] = []

    def loop(self, items: Iterator[Item], input_name: str, bar: Any) -> None:
        """Read records after the resume point, log or raise on bad ones, flush full shards."""
        limit, w = self.options.max_records, self.writer
        if limit is not None and w.done_records >= limit:
            return
        parts, part = self.options.num_shards, self.options.shard_index
        for number, item in enumerate(items):
            if self.stdin is not None:
                self.stdin.add(item)
            if number % parts != part:
                continue  # another part's record (--num-shards/--shard-index)
            if item.line <= w.resume_line:
                continue  # finished before the interruption
            if isinstance(item, BadRecord):
                self._bad(item, input_name, bar)
                continue
            self.buffer.append(item)
            if self.stdin is not None:  # what a resume must find again at the start of its stdin
                self.stdin.mark = self.stdin.prefix(item.line)
            if len(self.buffer) >= self.per_shard:
                self.flush(bar)
            if limit is not None and w.done_records + len(self.buffer) >= limit:
                break
        if self.buffer:
            self.flush(bar)

    def _bad(self, item: BadRecord, input_name: str, bar: Any) -> None:
        if self.options.strict:
            if self.buffer:
                self.flush(bar)
            raise ExtractError(f"bad record at line {item.line} of {input_name}: {item.reason} (--strict)")
        self.writer.log_error(item.line, item.reason)
        self.summary.skipped += 1

    def flush(self, bar: Any) -> None:
        """Encode the buffered records and write them as the next shard; update the manifest and the bar."""
        tensors, meta, tokens = shard_tensors(self.ex, self.spec, self.buffer, self.reading.keep, self.budget)
        if self.stdin is not None and self.stdin.mark is not None:
            meta["input_prefix"] = json.dumps(self.stdin.mark)
        if self.check is not None:  # every record of this shard was read before this check: unchanged input
            self.check.before_shard(self.writer)
        t0 = time.perf_counter()
        size = self.writer.write_shard(tensors, meta, tokens=tokens)
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
        if self.stdin is not None and s.status == "complete":  # the whole stream is read: now it has a hash
            self.stdin.stream.drain()
            w.record_input(sha256=self.stdin.stream.hexdigest(), bytes=self.stdin.stream.count)
        if self.check is not None:  # the bytes read are the bytes hashed, the files unchanged
            self.check.at_end(w, self.skipped_before + s.skipped)
        w.write_manifest(s.status, self.skipped_before + s.skipped)
        s.seconds = time.perf_counter() - s.started
        s.total_records = w.done_records


def extract(
    input: str | os.PathLike | Any,
    output: str | os.PathLike,
    spec: EncodeSpec | None = None,
    *,
    model: ModelOptions | Extractor | str | os.PathLike | None = None,
    reading: ReadOptions | None = None,
    options: ExtractOptions | None = None,
    stdin: IO[bytes] | None = None,
    on_shard: Callable[[int], None] | None = None,
) -> ExtractSummary:
    """Extract features for every record of ``input`` into the store directory ``output``.

    Args:
        input: a corpus file (txt, jsonl, csv, tsv, parquet, CoNLL-2003, CoNLL-U), a directory of parquet files,
            ``"-"`` for stdin, or a table in memory: a Hugging Face ``datasets.Dataset`` or a ``pyarrow.Table``
            (rows numbered from 1 in ``store.lines``; see :mod:`layerwise.corpus.sources`).
        output: the store directory; created, resumed, or (``options.overwrite``) replaced.
        spec: what to compute (default ``EncodeSpec()``: the last layer, mean-pooled sentence vectors). Level
            ``word`` uses a CoNLL file's words, else whitespace-separated words.
        model: the model's :class:`~layerwise.ModelOptions` (or just its directory / hub id), or an already loaded
            :class:`Extractor` (default: the embedded all-MiniLM-L6-v2).
        reading: input format, text field, kept columns, CoNLL document context (:class:`~layerwise.ReadOptions`).
        options: batch budget, record limit, shard size, strict, overwrite, progress (:class:`ExtractOptions`).
        stdin: a binary stream to read for ``"-"`` instead of ``sys.stdin`` (tests).
        on_shard: called with the shard count after each shard is written (tests, monitoring).

    Returns:
        An :class:`ExtractSummary`. The store holds ``[records, *D]`` (sentence) or ragged ``[rows, *D]``.

    Raises:
        TypeError: ``input`` is none of the above (records in a list go to :meth:`Extractor.stream`), or
            ``output`` is not a path.
        ExtractError: bad options, a bad record under ``strict``, stdin that differs from the input the store was
            made (or started) with.
        StoreError: the output is a file, a directory that is not a layerwise store, or a store made with other
            options; :class:`~layerwise.StoreFullError`: the disk filled up (the message says how to resume);
            :class:`~layerwise.StoreCorruptError`: a damaged manifest.
    """
    if not isinstance(output, (str, os.PathLike)):
        raise TypeError(f"output must be the store's directory path, got {type(output).__name__}")
    spec = spec or EncodeSpec()
    reading = reading or ReadOptions()
    options = options or ExtractOptions()
    try:
        source = open_source(input, reading)
    except ValueError as exc:
        raise ExtractError(str(exc)) from exc
    _check(spec, reading, source)
    ex = Extractor.of(model)
    try:  # 0 is a bad budget, not "unset": only None means the Extractor's own
        check_budget(ex.batch_tokens if options.batch_tokens is None else options.batch_tokens)
    except ValueError as exc:
        raise ExtractError(f"{exc}; give a positive --batch-tokens (batch_tokens=), or leave it out for the "
                           f"default") from exc
    spec = spec.resolve(ex)
    check = InputCheck.watch(source)  # before the input is hashed: its sha256 must be that of what is read
    header = store_header(ex, spec, source, reading)
    if check is not None:
        check.hashed(header["input"].get("sha256"))
    if options.num_shards > 1:  # a part store: merged with its siblings by `layerwise merge`
        header["part"] = {"index": options.shard_index, "of": options.num_shards}
    # Start reading before touching the store: header and --keep problems must not leave a store behind.
    # stdin has no file to hash beforehand: its bytes are hashed as they stream, its records as they pass
    stream = HashingStream(stdin if stdin is not None else sys.stdin.buffer) if source.is_stdin else None
    items = source.records(reading, stdin=io.BufferedReader(stream) if stream is not None else None,
                           digest=check.digest if check is not None else None)
    first = list(itertools.islice(items, RUNTIME_SAMPLE))  # read before the store is touched; sized the runtime
    items = itertools.chain(first, items)
    header["runtime"] = _runtime(ex, spec, output, options, source, first)
    writer = StoreWriter(output, header, check=options.resume_check)
    return _write(ex, spec, writer, items, source, reading, options, on_shard,
                  _StdinRecords(stream) if stream is not None else None, check)


def _runtime(ex: Extractor, spec: EncodeSpec, output: str | os.PathLike, options: ExtractOptions, source: Source,
             first: list[Item]) -> dict[str, str]:
    """The runtime that computes this store (:func:`~layerwise.extraction.runtime.store_runtime`): the one a store
    being resumed records, else decided from the corpus' size (its record count, the first records' tokens)."""
    old: dict[str, Any] | None = None
    if not options.overwrite and os.path.isdir(output):
        try:
            old = read_manifest(output)
        except LayerwiseError:
            old = None  # a new store (or one the writer refuses, with its own message)
    if old is not None and old.get("status") == "complete" and isinstance(old.get("runtime"), dict):
        return dict(old["runtime"])  # nothing is computed
    texts = [r.text for r in first if isinstance(r, Record) and r.text]
    tokens = float(np.mean([len(t) for t in ex.tokenizer(texts)["input_ids"]])) if texts else 32.0
    def count() -> int | None:  # the records this run encodes (a scan of the input: only if the choice needs it)
        found = None if source.is_stdin else source.count()
        return None if found is None else min(found, options.max_records or found) // max(1, options.num_shards)

    return store_runtime(ex, spec, recorded=recorded_runtime(old), records=count, tokens_per_record=tokens)


def _write(ex: Extractor, spec: EncodeSpec, writer: StoreWriter, items: Iterator[Item], source: Source,
           reading: ReadOptions, options: ExtractOptions, on_shard: Callable[[int], None] | None,
           stdin: _StdinRecords | None, check: InputCheck | None) -> ExtractSummary:
    state = writer.open(options.overwrite)
    try:
        return _fill(ex, spec, writer, state, items, source, reading, options, on_shard, stdin, check)
    finally:
        writer.close()


def _fill(ex: Extractor, spec: EncodeSpec, writer: StoreWriter, state: str, items: Iterator[Item], source: Source,
          reading: ReadOptions, options: ExtractOptions, on_shard: Callable[[int], None] | None,
          stdin: _StdinRecords | None, check: InputCheck | None) -> ExtractSummary:
    """The run into an opened (and locked) store."""
    summary = ExtractSummary(store=os.fspath(writer.path), resumed_from=writer.done_records,
                             repairs=list(writer.repairs))
    limit = options.max_records
    if stdin is not None and state == "complete":  # the whole new stdin must be the one the store was made from
        stdin.check_whole(writer)
    elif stdin is not None and state == "resume":  # it must start with the records already stored
        items = stdin.check_prefix(writer, items)
    if state == "complete" or (state == "resume" and limit is not None and writer.done_records >= limit):
        summary.status, summary.total_records = "already_complete", writer.done_records
        return summary
    run = _Run(ex, spec, writer, reading, options, summary, on_shard, stdin, check)
    from ..progress import progress_bar

    total = source.count() if options.progress is not False else None
    with progress_bar(options.progress, total=total, initial=writer.done_records, unit="rec", desc="extract",
                      file=sys.stderr, dynamic_ncols=True) as bar:
        with pinned(ex, writer.manifest.get("runtime")):  # one runtime from the first record to the last
            run.loop(items, source.name, bar)
    run.finish()
    return summary


__all__ = ["ExtractError", "ExtractOptions", "ExtractSummary", "extract"]
