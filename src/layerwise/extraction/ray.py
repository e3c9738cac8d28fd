"""Extraction on a Ray cluster: read, tokenise, encode and write as Ray Data stages, into one store of parts.

``lw.ray.extract(input, output, spec, model=..., num_workers="auto")`` (CLI ``layerwise extract ... --engine ray``):

1. before anything starts, the pool is sized from the cluster's resources (:mod:`layerwise.extraction.pool`): a
   pool that would leave the read, tokenise and write stages no CPU is refused in the first second with the
   numbers and the fix, and ``"auto"`` takes what the cluster offers;
2. the input is planned into splits without reading it (:mod:`layerwise.corpus.splits`: per file, per parquet row
   group, by byte ranges of one large txt/jsonl file), one part each; the plan depends only on the input and
   ``part_records``, so a rerun finds its finished parts again;
3. the driver loads the model on its CPU once to check the spec and build the store header;
4. stage ``prepare`` (CPU tasks, ``tokenize_cpus`` each, in parallel) reads one split and tokenises its records with
   the model's tokenizer (:meth:`Extractor.text_tokenizer <layerwise.Extractor.text_tokenizer>`, no model);
5. stage ``encode`` runs on an actor pool (``num_workers`` actors, ``cpus_per_worker`` CPUs and torch threads and
   ``gpus_per_worker`` GPUs each): each actor loads the model once from the run's
   :class:`~layerwise.ModelOptions` and encodes parts by token budget;
6. the layerwise :class:`StoreSink` (a Ray ``Datasink``) writes each part as a store ``OUTPUT/part-NNNNN`` (written
   under a temporary name and renamed, so a part is absent or complete); once every part is written the driver
   writes the top-level manifest that lists them (:mod:`layerwise.store.parts`). There is no merge:
   :func:`~layerwise.store.open_store` reads the parts as one store, in input order.

One run at a time: the driver holds the output's lock (:mod:`layerwise.store.lock`, ``OUTPUT/writer.lock``) from
before the first part to the top-level manifest, so a second driver on the same output is refused naming the first.
A stall watchdog (:mod:`layerwise.extraction.stall`) ends a run in which no part finished for ``stall_timeout``
seconds, with what each stage has done and the cluster's free resources in the message; the finished parts stay
and the same call resumes. Faults: a dead encode actor is restarted by Ray and its part retried; a part written
twice by a retried write is the same part (the rename keeps one, :mod:`layerwise.store.part_store`). A driver that
dies leaves finished parts on disk: the same call (or command) skips them. A local cluster the run started is its
own (:mod:`layerwise.extraction.cluster`): shut down when the run ends, and ended by a guard process when the
driver dies (``kill -9`` included). The part stores are the source of truth for what is done; Ray's own
checkpointing is not used.

What a run needs in its tasks and actors travels as one frozen :class:`RayJob`.

Needs ``pip install 'layerwise[ray]'``.
"""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import shutil
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..corpus.readers import BadRecord, ReadOptions
from ..corpus.sources import Source, open_source
from ..corpus.splits import Split, plan_splits, read_split, uncut_reason
from ..encoding.spec import EncodeSpec
from ..errors import ExtractError, StoreError
from ..extras import require
from ..model.options import ModelOptions
from ..notices import notice
from ..store import STORE_DTYPES, StoreWriter
from ..store.layout import MANIFEST
from ..store.lock import StoreLock
from ..store.manifest import is_store_manifest, read_manifest
from ..store.part_store import finished_parts, part_path, write_part
from ..store.parts import is_parted, part_name, write_parts_manifest
from ..store.writer import identity
from .cluster import RayCluster
from .options import ExtractOptions
from .pool import IO_CPUS, TOKENIZE_CPUS, check_object_store, cluster_resources, local_resources, size_pool
from .runtime import pinned, recorded_runtime, store_runtime
from .stall import PROGRESS, StallWatchdog, mark

DEFAULT_PART_RECORDS = 10_000
DEFAULT_STALL_TIMEOUT = 600.0


def require_ray() -> Any:
    """The ``ray`` module (with Ray Data); :class:`~layerwise.MissingExtraError` naming the ``[ray]`` extra."""
    return require("ray", "ray.data", what="--engine ray", extra="ray", packages="Ray Data")


@dataclass
class RaySummary:
    """What a Ray extraction did: the parts (and how many were already complete), the pool, the store, the time."""

    parts: int
    already_complete: int
    records: int
    skipped: int
    seconds: float
    workers: int = 0


@dataclass(frozen=True)
class RayJob:
    """What the stages of one Ray run need, sent once to each task and actor (the input itself, which may be a
    table in memory, goes only to the read stage: :func:`prepare_parts`).

    Attributes:
        reading: how the input is read. spec: what to compute (layers resolved). options: the run's
            :class:`ExtractOptions` (``batch_tokens``, ``strict`` and ``overwrite`` apply). model: the
            :class:`~layerwise.ModelOptions` each encode actor loads. header: the store header every part records.
        parts: each part's header entry (its index, the count, its split), in input order.
        output: the store directory. progress: the stages' progress directory. cancel: the file whose appearance
            ends the encode actors (a run that stopped).
        workers, cpus_per_worker, gpus_per_worker, tokenize_cpus: the pool. stall_timeout: seconds without a
            finished part before the run ends. on_part: called in the encode actor after each part (tests).
    """

    reading: ReadOptions
    spec: EncodeSpec
    options: ExtractOptions
    model: ModelOptions
    header: dict[str, Any]
    parts: tuple[dict[str, Any], ...]
    output: str
    progress: str
    cancel: str
    workers: int
    cpus_per_worker: int
    gpus_per_worker: float
    tokenize_cpus: float
    stall_timeout: float
    on_part: Callable[[int], None] | None = None

    def split(self, part: int) -> Split:
        """The split part ``part`` reads."""
        return Split.from_dict(self.parts[part])


def _pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack(data: Any) -> Any:
    return pickle.loads(bytes(data))


# ---- the stages (each runs in a Ray task or actor; rows are {"part": int, "data": pickled bytes}) ----------------
def prepare_parts(batch: dict[str, Any], job: RayJob, source: Source, tokenizer: Any) -> dict[str, list[Any]]:
    """Stage ``prepare``: read each part's split (no other part's bytes) and tokenise its good records."""
    from .shards import tokenize_records

    out: dict[str, list[Any]] = {"part": [], "data": []}
    for part in batch["part"]:
        part = int(part)
        t0 = time.perf_counter()
        reader = read_split(source, job.split(part), job.reading)
        items = list(reader.items())
        bad = next((i for i in items if isinstance(i, BadRecord)), None)
        if job.options.strict and bad is not None:
            raise ExtractError(f"bad record at line {bad.line} of part {part} of {source.name}: {bad.reason} "
                               f"(--strict; lines are counted from the part's first line)")
        t1 = time.perf_counter()
        records = [i for i in items if not isinstance(i, BadRecord)]
        toks = tokenize_records(tokenizer, job.spec, records)
        facts = {"lines": reader.lines, "sha256": reader.sha256, "records": len(items),
                 "read_seconds": t1 - t0, "tokenize_seconds": time.perf_counter() - t1}
        mark(job.progress, "prepared", part)
        out["part"].append(part)
        out["data"].append(_pack((items, toks, facts)))
    return out


def _exit_when(marker: str, poll: float = 0.5) -> None:
    """In an encode actor: end the process once the driver writes ``marker`` (its run has ended)."""
    while not os.path.exists(marker):
        time.sleep(poll)
    os.kill(os.getpid(), signal.SIGKILL)


class EncodeWorker:
    """Stage ``encode`` (a Ray actor): loads the model once, then turns tokenised parts into shard tensors."""

    def __init__(self, job: RayJob):
        import torch

        from ..extractor import Extractor

        torch.set_num_threads(max(1, int(job.cpus_per_worker)))
        self.job = job
        # a run that ends (a stall, an interrupt) frees this actor's CPUs and GPUs at once
        threading.Thread(target=_exit_when, args=(job.cancel,), daemon=True).start()
        self.ex = Extractor.from_options(job.model)

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        from .shards import shard_tensors

        job = self.job
        out: dict[str, list[Any]] = {"part": [], "data": []}
        for part, data in zip(batch["part"], batch["data"]):
            items, toks, facts = _unpack(data)
            t0 = time.perf_counter()
            records = [i for i in items if not isinstance(i, BadRecord)]
            budget = job.options.batch_tokens or self.ex.batch_tokens  # default: this worker's device's budget
            with pinned(self.ex, job.header.get("runtime")):  # the store's runtime, in every worker
                shard = (shard_tensors(self.ex, job.spec, records, job.reading.keep, budget, toks=toks)
                         if records else None)
            errors = [(i.line, i.reason) for i in items if isinstance(i, BadRecord)]
            facts["encode_seconds"] = time.perf_counter() - t0
            mark(job.progress, "encoded", int(part))
            if job.on_part is not None:
                job.on_part(int(part))
            out["part"].append(int(part))
            out["data"].append(_pack((shard, errors, facts)))
        return out


def _datasink_base() -> type:
    from ray.data import Datasink

    return Datasink


class StoreSink:
    """A Ray Data ``Datasink`` writing each encoded part as a part store of the output.

    Built by :func:`store_sink` (the class derives from ``ray.data.Datasink`` only when Ray is imported).
    """

    def __init__(self, job: RayJob):
        self.job = job

    def write(self, blocks: Any, ctx: Any) -> int:
        """Write the parts in ``blocks`` (one row each); returns how many."""
        import pyarrow as pa

        job, n = self.job, 0
        for block in blocks:
            table = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block)
            if table.num_rows == 0:
                continue
            for part, data in zip(table.column("part").to_pylist(), table.column("data").to_pylist()):
                shard, errors, facts = _unpack(data)
                header = {**job.header, "part": job.parts[int(part)]}
                write_part(part_path(job.output, int(part)), header, shard, errors, facts)
                mark(job.progress, "written", int(part))
                n += 1
        return n


def store_sink(job: RayJob) -> Any:
    """A :class:`StoreSink` that is a ``ray.data.Datasink``."""
    cls = type("LayerwiseStoreDatasink", (StoreSink, _datasink_base()), {})
    return cls(job)


# ---- the driver ---------------------------------------------------------------------------------------------------
def _part_headers(splits: list[Split]) -> list[dict[str, Any]]:
    """What each part store's header says about its part (compared on resume: another plan is another run)."""
    return [{"index": i, "of": len(splits), **s.to_dict()} for i, s in enumerate(splits)]


def _finished_parts(output: str, header: dict[str, Any], parts: list[dict[str, Any]], overwrite: bool) -> set[int]:
    """The parts already complete on disk; a part made with other options is refused unless ``overwrite``."""
    try:
        return finished_parts(output, header, parts, overwrite)
    except StoreError as exc:
        raise ExtractError(f"{exc} (a part of an earlier Ray run into {output!r}; --overwrite redoes them)") \
            from exc


def _recorded_runtime(out: str, parts: int) -> str | None:
    """The runtime the parts already on disk record (a resume continues on it), or ``None``."""
    for part in range(parts):
        try:
            name = recorded_runtime(read_manifest(part_path(out, part)))
        except (StoreError, OSError):
            continue
        if name is not None:
            return name
    return None


def _open_output(out: str, header: dict[str, Any], overwrite: bool, lock: StoreLock) -> dict[str, Any] | None:
    """The output's top-level manifest when it is this run's, finished (then there is nothing to do); refuses a
    directory holding another store unless ``overwrite`` (then only layerwise's own manifest goes). ``lock`` is
    the output's lock, held by this driver."""
    mfile = Path(out) / MANIFEST
    if not mfile.exists():
        return None
    if not is_store_manifest(mfile):
        raise ExtractError(f"{str(mfile)!r} is not a layerwise store's manifest: choose another output directory "
                           f"(layerwise never replaces files it did not write)")
    try:
        m = read_manifest(out)
    except StoreError:
        m = None
    if m is not None and is_parted(m) and identity(m) == identity(header):
        return m
    if not overwrite:
        what = "another run's parts" if m is not None and is_parted(m) else "a store made another way"
        raise ExtractError(f"{out!r} holds {what} (its manifest differs from this run's); choose another output "
                           f"directory, or pass --overwrite (overwrite=True) to redo it")
    if m is not None and not is_parted(m) and m["shards"]:
        lock.release()  # the writer takes the same lock to remove a plain store's own files; ours again after
        with StoreWriter(out, header) as writer:
            writer.open(overwrite=True)
        lock.acquire()
    mfile.unlink(missing_ok=True)
    return None


def extract(
    input: str | os.PathLike | Any,
    output: str | os.PathLike,
    spec: EncodeSpec | None = None,
    *,
    model: ModelOptions | str | os.PathLike | None = None,
    reading: ReadOptions | None = None,
    options: ExtractOptions | None = None,
    num_workers: int | str = "auto",
    cpus_per_worker: int = 1,
    gpus_per_worker: float = 0,
    tokenize_cpus: float = TOKENIZE_CPUS,
    part_records: int = DEFAULT_PART_RECORDS,
    address: str | None = None,
    stall_timeout: float = DEFAULT_STALL_TIMEOUT,
    on_part: Callable[[int], None] | None = None,
) -> RaySummary:
    """Extract ``input`` into the store ``output`` on Ray (see the module docstring).

    Args:
        input: a corpus file, a directory or glob pattern of corpus files, or a parquet directory every node can
            read (a shared file system on a cluster), or a ``datasets.Dataset`` / ``pyarrow.Table`` (shipped to the
            tasks).
        output: the store's directory: its parts go to ``OUTPUT/part-NNNNN`` and its manifest lists them.
        spec: as for :func:`layerwise.extract`, and so are ``reading`` and ``options`` (``batch_tokens``,
            ``strict`` and ``overwrite`` apply; each part is one shard; ``max_records`` and ``num_shards`` are for
            local runs).
        model: the :class:`~layerwise.ModelOptions` each worker loads its model with (or just the directory / hub id;
            ``None``: the embedded default model). Every option reaches the workers; ``device`` is each worker's
            (default: CUDA when it has a GPU, else CPU); the driver checks the spec on its CPU.
        num_workers: encode actors, or ``"auto"`` (from the cluster: GPUs // gpus_per_worker, else the CPUs the
            stages leave; see :mod:`layerwise.extraction.pool`). cpus_per_worker: CPUs (and torch threads) per
            actor. gpus_per_worker: GPUs per actor. tokenize_cpus: CPUs per read-and-tokenise task.
        part_records: about this many records per part, the unit of work and of resume (keep it across reruns);
            csv/tsv files are cut where the csv reader ends a row, so a part holds that many rows exactly.
        address: a running Ray cluster (``ray.init(address=...)``); default: the one already initialised, else a
            local one, started for this run and shut down when it ends (and when this process dies).
        stall_timeout: seconds without a finished part after which the run ends with the stages' states.
        on_part: called in the encode actor after each part it encodes (tests).

    Returns:
        A :class:`RaySummary`; ``lw.open_store(output)`` reads the parts as one store in input order.

    Raises:
        ExtractError: a pool the cluster cannot run (the message gives the numbers and the fix), bad counts or
            options, an Extractor instead of a model path (workers load their own), stdin (Ray reads files), parts
            made with other options, a stall; StoreError: another run writing ``output`` (naming it);
            MissingExtraError: Ray missing.
    """
    source = _check(input, model, spec, options, reading, cpus_per_worker, part_records, stall_timeout)
    options_of_model = ModelOptions.of(model)
    spec, reading, options = spec or EncodeSpec(), reading or ReadOptions(), options or ExtractOptions()
    pool = dict(cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker, tokenize_cpus=tokenize_cpus)
    running = sys.modules.get("ray")
    if address is None and not (running is not None and running.is_initialized()):
        # a local cluster: refused before the seconds Ray (and the model) take to start
        size_pool(num_workers, local_resources(), **pool)  # type: ignore[arg-type]
    ray = require_ray()
    from ..extractor import Extractor
    from .shards import store_header

    started = time.perf_counter()
    out = os.fspath(output)
    created = not os.path.lexists(out)
    Path(out).mkdir(parents=True, exist_ok=True)
    try:
        with StoreLock(out) as lock:  # one driver per output (a second is refused naming this one)
            if lock.took_over:  # a killed driver's lock, said in one line
                notice(lock.took_over)
            parts = _part_headers(plan_splits(source, source.files(), part_records))
            why = uncut_reason(source, source.files(), part_records)
            if why is not None:
                notice(f"--part-records: {why}")
            ex = Extractor.from_options(options_of_model.replace(device="cpu"))
            spec = spec.resolve(ex)
            header = store_header(ex, spec, source, reading, quick_input=True)
            header["model_options"] = options_of_model.replace(backend=ex.options.backend).to_dict()  # the workers'
            recorded = _recorded_runtime(out, len(parts)) if not options.overwrite else None
            header["runtime"] = store_runtime(ex, spec, recorded=recorded, records=source.count)  # every worker's
            top = _open_output(out, header, options.overwrite, lock)
            if top is not None:
                return _summary(top, len(top["parts"]), started, workers=0)
            done = _finished_parts(out, header, parts, options.overwrite)
            progress = os.path.join(out, PROGRESS)
            with RayCluster(ray, address):
                workers = _size_cluster(ray, address, num_workers, pool, spec, header, part_records)
                todo = [p for p in range(len(parts)) if p not in done]
                os.makedirs(progress, exist_ok=True)
                if todo:
                    job = RayJob(reading=reading, spec=spec, options=options,
                                 model=options_of_model, header=header, parts=tuple(parts),
                                 output=out, progress=progress,
                                 cancel=os.path.join(progress, f"cancel-{uuid.uuid4().hex[:12]}"), workers=workers,
                                 stall_timeout=stall_timeout, on_part=on_part, **pool)  # type: ignore[arg-type]
                    _run(ray, job, todo, source, ex.text_tokenizer())
            shutil.rmtree(progress, ignore_errors=True)  # our own marks
            top = write_parts_manifest(out, header, [part_name(p) for p in range(len(parts))])
            return _summary(top, len(done), started, workers)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(out)  # the directory this call made, when nothing was written into it
        raise


def _check(input: Any, model: Any, spec: EncodeSpec | None, options: ExtractOptions | None,
           reading: ReadOptions | None, cpus_per_worker: int, part_records: int, stall_timeout: float) -> Source:
    """Refuse what a Ray run cannot take (before anything starts); the input's :class:`Source`."""
    from ..checks import positive_ints

    positive_ints(cpus_per_worker=cpus_per_worker, part_records=part_records)
    if not (isinstance(stall_timeout, (int, float)) and stall_timeout > 0):
        raise ExtractError(f"stall_timeout must be a positive number of seconds, got {stall_timeout!r}")
    if model is not None and not isinstance(model, (ModelOptions, str, os.PathLike)):
        raise ExtractError("with Ray each worker loads the model itself: pass its ModelOptions (or its "
                           "directory or hub id), not an Extractor")
    if options is not None and (options.max_records is not None or options.num_shards > 1):
        raise ExtractError("max_records and num_shards/shard_index are for local runs; --engine ray splits the input "
                           "into parts itself (part_records=)")
    source = open_source(input, reading or ReadOptions())
    if source.is_stdin:
        raise ExtractError("--engine ray reads a file, a parquet directory or a dataset, not stdin: write it to a "
                           "file every node can read")
    return source


def _size_cluster(ray: Any, address: str | None, num_workers: int | str, pool: dict[str, Any], spec: EncodeSpec,
                  header: dict[str, Any], part_records: int) -> int:
    """Size the pool on the cluster's real resources; a part too big for its object store is refused. Returns the
    number of encode workers."""
    from .engine import TOKENS_PER_RECORD

    resources = cluster_resources(ray, address)
    workers = size_pool(num_workers, resources, **pool)
    rows = 1 if spec.level == "sentence" else TOKENS_PER_RECORD  # features of one part travel between the stages
    width = math.prod(header["feature_shape"]) * STORE_DTYPES[spec.output_dtype]().itemsize
    check_object_store(resources, part_records * rows * width)
    return workers


def _summary(top: dict[str, Any], already_complete: int, started: float, workers: int) -> RaySummary:
    """The :class:`RaySummary` of a finished store of parts (its top-level manifest)."""
    c = top["counts"]
    return RaySummary(parts=len(top["parts"]), already_complete=already_complete, records=c["records"],
                      skipped=c.get("skipped", 0), seconds=time.perf_counter() - started, workers=workers)


def _run(ray: Any, job: RayJob, todo: list[int], source: Source, tokenizer: Any) -> None:
    """The Ray Data pipeline over the parts in ``todo``, watched for stalls."""
    sink = store_sink(job)
    context = ray.data.DataContext.get_current()  # (a dataset copies the context when it is made)
    block_size = context.target_max_block_size
    context.target_max_block_size = 1  # one part per block: each part is a task of its own for the actor pool
    ds = ray.data.from_items([{"part": p} for p in todo], override_num_blocks=len(todo)).map_batches(
        prepare_parts, fn_kwargs={"job": job, "source": source, "tokenizer": tokenizer}, batch_size=1,
        num_cpus=job.tokenize_cpus,
    ).map_batches(
        EncodeWorker, fn_constructor_kwargs={"job": job}, batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=job.workers), num_cpus=job.cpus_per_worker,
        num_gpus=job.gpus_per_worker,
    )  # Ray Data restarts a dead pool actor and retries its task by default (tested by killing one)
    watchdog = StallWatchdog(ray, job.output, job.progress, len(job.parts), job.workers, job.stall_timeout)
    watchdog.start()
    finished = False
    try:
        ds.write_datasink(sink, ray_remote_args={"num_cpus": IO_CPUS})
        finished = True
    except KeyboardInterrupt:
        if watchdog.message is not None:
            raise ExtractError(watchdog.message) from None
        raise
    except Exception as exc:  # a task's ExtractError / StoreError arrives wrapped by Ray: say it plainly
        if watchdog.message is not None:
            raise ExtractError(watchdog.message) from None
        cause = getattr(exc, "cause", None) or exc.__cause__
        if isinstance(cause, (ExtractError, StoreError)):
            raise ExtractError(str(cause)) from exc
        raise
    finally:
        watchdog.done.set()
        context.target_max_block_size = block_size
        if not finished:  # the pool's actors end themselves (a stalled one may never return to Ray)
            Path(job.cancel).touch()


__all__ = ["DEFAULT_PART_RECORDS", "DEFAULT_STALL_TIMEOUT", "EncodeWorker", "RayJob", "RaySummary", "StoreSink",
           "extract", "part_path", "prepare_parts", "require_ray", "store_sink", "write_part"]
