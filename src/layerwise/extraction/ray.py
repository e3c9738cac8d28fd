"""Extraction on a Ray cluster: read, tokenise, encode and write as Ray Data stages, into the local store format.

``lw.ray.extract(input, output, spec, model=..., num_workers=2)`` (CLI ``layerwise extract ... --engine ray``):

1. the driver loads the model on its CPU once to check the spec and build the store header (the same header a local
   run writes), counts the input's records and splits them into parts of ``part_records`` consecutive records (part
   ``p`` holds records ``p * part_records ...``; the split depends only on the input and ``part_records``, so a rerun
   finds its finished parts again);
2. stage ``read`` (one CPU task) streams the input once and emits one row per unfinished part (its records, bad ones
   included);
3. stage ``tokenize`` (CPU tasks, ``tokenize_cpus`` each) tokenises a part with the model's tokenizer
   (:meth:`Extractor.text_tokenizer <layerwise.Extractor.text_tokenizer>`, shipped without the model);
4. stage ``encode`` runs on an actor pool (``ActorPoolStrategy(size=num_workers)``, ``cpus_per_worker`` CPUs and
   torch threads and ``gpus_per_worker`` GPUs per actor): each actor loads the model once and encodes parts by token
   budget (:meth:`Extractor.encode_tokenized <layerwise.Extractor.encode_tokenized>`);
5. the layerwise :class:`StoreSink` (a Ray ``Datasink``) writes each part as a part store ``OUTPUT.parts/part-NNNNN``
   (shards, error log and manifest of the local format; written under a temporary name and renamed, so a part is
   either absent or complete) and, once every part is written, merges them into ``output`` in input order
   (:func:`layerwise.store.merge_stores`).

Rows carry whole parts (pickled), so Ray may re-block them freely; Ray Data's streaming executor applies
backpressure between the stages. Faults: a dead encode actor is restarted by Ray and its part retried; a part written
twice by a retried write is the same part (the rename keeps one). A driver that dies leaves finished parts on disk:
the same call (or command) skips them and does the rest. The part stores are the source of truth for what is done;
Ray's own checkpointing is not used. Leave at least one CPU outside the actor pool (``num_workers *
cpus_per_worker <= CPUs - 1``) for the read task (:data:`IO_CPUS`), the tokenise tasks (``tokenize_cpus``), the write
tasks (:data:`IO_CPUS`) and the driver: a pool that holds every CPU starves them and the run stalls.

Needs ``pip install 'layerwise[ray]'``.
"""

from __future__ import annotations

import math
import os
import pickle
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from ..corpus.readers import BadRecord, ReadOptions
from ..corpus.sources import Source, open_source
from ..encoding.spec import EncodeSpec
from ..errors import ExtractError, StoreError
from ..extras import require
from ..model.options import ModelOptions
from ..store import MergeSummary, StoreWriter, merge_stores
from .options import ExtractOptions
from .shards import shard_tensors, store_header, tokenize_records

DEFAULT_PART_RECORDS = 10_000
IO_CPUS = 0.25  # CPUs the read task and each write task reserve: they mostly wait on files


def require_ray() -> Any:
    """The ``ray`` module (with Ray Data); :class:`~layerwise.MissingExtraError` naming the ``[ray]`` extra."""
    return require("ray", "ray.data", what="--engine ray", extra="ray", packages="Ray Data")


@dataclass
class RaySummary:
    """What a Ray extraction did: the parts (and how many were already complete), the merged store, the time."""

    parts: int
    already_complete: int
    records: int
    skipped: int
    seconds: float
    merge: MergeSummary


def part_path(output: str | os.PathLike, part: int) -> Path:
    """Where part ``part`` of a Ray extraction into ``output`` is written: ``OUTPUT.parts/part-NNNNN``."""
    out = Path(output)
    return out.with_name(out.name + ".parts") / f"part-{part:05d}"


def _pack(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _unpack(data: Any) -> Any:
    return pickle.loads(bytes(data))


# ---- the stages (each runs in a Ray task or actor; rows are {"part": int, "data": pickled bytes}) ----------------
def read_parts(row: dict[str, Any], source: Source, reading: ReadOptions, part_records: int, todo: set[int],
               strict: bool) -> Iterator[dict[str, Any]]:
    """Stage ``read``: stream the input once; one row per part in ``todo`` with its items (records and bad ones)."""
    part, items = 0, []
    for n, item in enumerate(source.records(reading), start=1):
        if strict and isinstance(item, BadRecord):
            raise ExtractError(f"bad record at line {item.line} of {source.name}: {item.reason} (--strict)")
        if part in todo:
            items.append(item)
        if n % part_records == 0:
            if part in todo:
                yield {"part": part, "data": _pack(items)}
            part, items = part + 1, []
    if items and part in todo:
        yield {"part": part, "data": _pack(items)}


def tokenize_parts(batch: dict[str, Any], tokenizer: Any, spec: EncodeSpec) -> dict[str, list[Any]]:
    """Stage ``tokenize``: a part's good records tokenised with the model's tokenizer (no model needed)."""
    out: dict[str, list[Any]] = {"part": [], "data": []}
    for part, data in zip(batch["part"], batch["data"]):
        items = _unpack(data)
        records = [i for i in items if not isinstance(i, BadRecord)]
        out["part"].append(int(part))
        out["data"].append(_pack((items, tokenize_records(tokenizer, spec, records))))
    return out


class EncodeWorker:
    """Stage ``encode`` (a Ray actor): loads the model once, then turns tokenised parts into shard tensors."""

    def __init__(self, job: dict[str, Any]):
        import torch

        from ..extractor import Extractor

        torch.set_num_threads(max(1, int(job["cpus_per_worker"])))
        self.job = job
        self.ex = Extractor.from_options(ModelOptions.from_dict(job["model"]))

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        job = self.job
        out: dict[str, list[Any]] = {"part": [], "data": []}
        for part, data in zip(batch["part"], batch["data"]):
            items, toks = _unpack(data)
            records = [i for i in items if not isinstance(i, BadRecord)]
            budget = job["batch_tokens"] or self.ex.batch_tokens  # default: this worker's device's budget
            shard = shard_tensors(self.ex, job["spec"], records, job["keep"], budget, toks=toks) if records else None
            errors = [(i.line, i.reason) for i in items if isinstance(i, BadRecord)]
            if job.get("on_part") is not None:
                job["on_part"](int(part))
            out["part"].append(int(part))
            out["data"].append(_pack((shard, errors)))
        return out


def write_part(path: Path, header: dict[str, Any], shard: Any, errors: list[tuple[int, str]]) -> None:
    """One part store at ``path``, written beside it and renamed into place (a part is absent or complete)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    writer = StoreWriter(tmp, header)
    writer.open()
    if shard is not None:
        tensors, meta, tokens = shard
        writer.write_shard(tensors, meta, tokens=tokens)
    for line, reason in errors:
        writer.log_error(line, reason)
    writer.write_manifest("complete", len(errors))
    try:
        os.replace(tmp, path)  # an empty directory left by an interrupted run is replaced
    except OSError:
        if (path / "manifest.json").exists():  # a retried write found the same part already there
            shutil.rmtree(tmp, ignore_errors=True)  # our own temporary directory
        else:
            shutil.rmtree(tmp, ignore_errors=True)
            raise StoreError(f"{str(path)!r} holds files that are not a layerwise part store: move them away and "
                             f"rerun (layerwise never deletes files it did not write)") from None


def _datasink_base() -> type:
    from ray.data import Datasink

    return Datasink


class StoreSink:
    """A Ray Data ``Datasink`` writing each encoded part as a part store, then merging them into the output store.

    Built by :func:`store_sink` (the class derives from ``ray.data.Datasink`` only when Ray is imported).
    """

    def __init__(self, output: str, header: dict[str, Any], parts: int, overwrite: bool):
        self.output, self.header, self.parts, self.overwrite = output, header, parts, overwrite
        self.merged: MergeSummary | None = None

    def write(self, blocks: Any, ctx: Any) -> int:
        """Write the parts in ``blocks`` (one row each); returns how many."""
        import pyarrow as pa

        n = 0
        for block in blocks:
            table = block if isinstance(block, pa.Table) else pa.Table.from_pandas(block)
            if table.num_rows == 0:
                continue
            for part, data in zip(table.column("part").to_pylist(), table.column("data").to_pylist()):
                shard, errors = _unpack(data)
                header = {**self.header, "part": {"index": int(part), "of": self.parts}}
                write_part(part_path(self.output, int(part)), header, shard, errors)
                n += 1
        return n

    def on_write_complete(self, write_result: Any) -> None:
        """Every part is written: merge them into the output store."""
        self.merged = merge_stores([part_path(self.output, p) for p in range(self.parts)], self.output,
                                   overwrite=self.overwrite)


def store_sink(output: str, header: dict[str, Any], parts: int, overwrite: bool) -> Any:
    """A :class:`StoreSink` that is a ``ray.data.Datasink``."""
    cls = type("LayerwiseStoreDatasink", (StoreSink, _datasink_base()), {})
    return cls(output, header, parts, overwrite)


# ---- the driver ---------------------------------------------------------------------------------------------------
def _count_items(source: Source, reading: ReadOptions) -> int:
    """How many items (records and bad records) the input yields: the parts are cut from this count."""
    if source.fmt in ("parquet", "table"):
        counted = source.count()
        if counted is not None:
            return counted
    return sum(1 for _ in source.records(reading))


def _finished_parts(output: str, header: dict[str, Any], parts: int, overwrite: bool) -> set[int]:
    """The parts already complete on disk; a part made with other options is refused unless ``overwrite``."""
    done = set()
    for p in range(parts):
        path = part_path(output, p)
        if not (path / "manifest.json").exists():
            continue
        try:
            state = StoreWriter(path, {**header, "part": {"index": p, "of": parts}}).open(overwrite=overwrite)
        except StoreError as exc:
            raise ExtractError(f"{exc} (a part of an earlier Ray run into {output!r}; --overwrite redoes them)") \
                from exc
        if state == "complete":
            done.add(p)
    return done


def extract(
    input: str | os.PathLike | Any,
    output: str | os.PathLike,
    spec: EncodeSpec | None = None,
    *,
    model: ModelOptions | str | os.PathLike | None = None,
    reading: ReadOptions | None = None,
    options: ExtractOptions | None = None,
    num_workers: int = 2,
    cpus_per_worker: int = 1,
    gpus_per_worker: float = 0,
    tokenize_cpus: float = 0.5,
    part_records: int = DEFAULT_PART_RECORDS,
    address: str | None = None,
    on_part: Callable[[int], None] | None = None,
) -> RaySummary:
    """Extract ``input`` into the store ``output`` on Ray (see the module docstring).

    Args:
        input: a corpus file or parquet directory every node can read (a shared file system on a cluster), or a
            ``datasets.Dataset`` / ``pyarrow.Table`` (shipped to the read task).
        output: the merged store's directory; parts go to ``OUTPUT.parts/``.
        spec, reading, options: as for :func:`layerwise.extract` (``batch_tokens``, ``strict`` and ``overwrite``
            apply; each part is one shard; ``max_records`` and ``num_shards`` are for local runs).
        model: the :class:`~layerwise.ModelOptions` each worker loads its model with (or just the directory / hub id;
            ``None``: the embedded default model). Every option reaches the workers; ``device`` is each worker's
            (default: CUDA when it has a GPU, else CPU); the driver checks the spec on its CPU.
        num_workers: encode actors. cpus_per_worker: CPUs (and torch threads) per actor. gpus_per_worker: GPUs per
            actor. tokenize_cpus: CPUs per tokenise task (fractional, so tokenise tasks fit beside the pool; equal to
            ``cpus_per_worker`` on a CPU-only pool, Ray fuses tokenising into the encode actors).
        part_records: records per part, the unit of work and of resume (keep it across reruns).
        address: a running Ray cluster (``ray.init(address=...)``); default: the one already initialised, else a
            local one.
        on_part: called in the encode actor after each part it encodes (tests).

    Returns:
        A :class:`RaySummary`; the store at ``output`` reads like a local one (``lw.open_store``).

    Raises:
        ValueError / ExtractError: bad counts or options, an Extractor instead of a model path (workers load their
            own), stdin (Ray reads files), parts made with other options, Ray missing.
    """
    from ..checks import positive_ints
    from ..extractor import Extractor

    positive_ints(num_workers=num_workers, cpus_per_worker=cpus_per_worker, part_records=part_records)
    if model is not None and not isinstance(model, (ModelOptions, str, os.PathLike)):
        raise ExtractError("with Ray each worker loads the model itself: pass its ModelOptions (or its "
                           "directory or hub id), not an Extractor")
    options_of_model = ModelOptions.of(model)
    spec, reading, options = spec or EncodeSpec(), reading or ReadOptions(), options or ExtractOptions()
    if options.max_records is not None or options.num_shards > 1:
        raise ExtractError("max_records and num_shards/shard_index are for local runs; --engine ray splits the input "
                           "into parts itself (part_records=)")
    source = open_source(input, reading)
    if source.is_stdin:
        raise ExtractError("--engine ray reads a file, a parquet directory or a dataset, not stdin: write it to a "
                           "file every node can read")
    ray = require_ray()
    started = time.perf_counter()
    ex = Extractor.from_options(options_of_model.replace(device="cpu"))
    spec = spec.resolve(ex)
    header = store_header(ex, spec, source, reading)
    header["model_options"] = options_of_model.replace(backend=ex.options.backend).to_dict()  # the workers'
    parts = max(1, math.ceil(_count_items(source, reading) / part_records))
    out = os.fspath(output)
    done = _finished_parts(out, header, parts, options.overwrite)
    part_path(out, 0).parent.mkdir(parents=True, exist_ok=True)
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    job = {"model": options_of_model.to_dict(),
           "cpus_per_worker": cpus_per_worker, "spec": spec, "keep": reading.keep,
           "batch_tokens": options.batch_tokens,
           "on_part": on_part}
    sink = store_sink(out, header, parts, options.overwrite)
    todo = set(range(parts)) - done
    context = ray.data.DataContext.get_current()  # (a dataset copies the context when it is made)
    block_size = context.target_max_block_size
    context.target_max_block_size = 1  # one part per block: each part is a task of its own for the actor pool
    # from_items: the one read task's descriptor lives in the driver, so no read waits for a CPU the pool holds
    ds = ray.data.from_items([{"read": 0}]).flat_map(
        read_parts, fn_kwargs={"source": source, "reading": reading, "part_records": part_records, "todo": todo,
                               "strict": options.strict}, num_cpus=IO_CPUS,
    ).map_batches(
        tokenize_parts, fn_kwargs={"tokenizer": ex.text_tokenizer(), "spec": spec}, batch_size=1,
        num_cpus=tokenize_cpus,
    ).map_batches(
        EncodeWorker, fn_constructor_kwargs={"job": job}, batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=num_workers), num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
    )  # Ray Data restarts a dead pool actor and retries its task by default (tested by killing one)
    try:
        ds.write_datasink(sink, ray_remote_args={"num_cpus": IO_CPUS})
    except Exception as exc:  # a worker's ExtractError (strict) arrives wrapped by Ray: say it plainly
        cause = getattr(exc, "cause", None) or exc.__cause__
        if isinstance(cause, ExtractError):
            raise ExtractError(str(cause)) from exc
        raise
    finally:
        context.target_max_block_size = block_size
    merged = sink.merged if sink.merged is not None else merge_stores(
        [part_path(out, p) for p in range(parts)], out, overwrite=options.overwrite)
    return RaySummary(parts=parts, already_complete=len(done), records=merged.records, skipped=merged.skipped,
                      seconds=time.perf_counter() - started, merge=merged)


__all__ = ["DEFAULT_PART_RECORDS", "EncodeWorker", "RaySummary", "StoreSink", "extract", "part_path", "read_parts",
           "require_ray", "store_sink", "tokenize_parts", "write_part"]
