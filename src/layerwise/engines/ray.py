"""Extraction on a Ray cluster: the parts of a sharded extraction as Ray Data tasks on an actor pool, then one merge.

``lw.ray.extract(input, output, spec, model=..., num_workers=2)`` (CLI ``layerwise extract ... --engine ray``):

1. the input is split into ``parts`` parts by record number (the rule of ``--num-shards``/``--shard-index``, stable
   across reruns; default :data:`DEFAULT_PARTS`, independent of the number of workers so a rerun with other workers
   still resumes);
2. a Ray Data pipeline maps the part numbers over an actor pool (``ActorPoolStrategy(size=num_workers)``): each actor
   loads the model once, with ``cpus_per_worker`` torch threads and ``gpus_per_worker`` GPUs, and runs the local
   engine on its parts, each into ``OUTPUT.parts/part-NNNNN`` (an ordinary resumable store: token-budget batches,
   bad records logged, shards flushed as they fill);
3. the parts are merged into ``output`` in input order (:func:`layerwise.store.merge_stores`).

Faults: a worker that dies is restarted by Ray and its task retried, and the retried part resumes after its last
finished shard; a driver that dies leaves finished parts complete and the others resumable: the same call (or
command) resumes them and merges. The layerwise manifests are the source of truth for what is done; Ray's own
checkpointing is not used. Leave at least one CPU outside the pool (``num_workers * cpus_per_worker < CPUs``) for
reading, writing and the driver.

Needs ``pip install 'layerwise[ray]'``.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..engine import ExtractOptions
from ..engine import extract as extract_local
from ..readers import ReadOptions
from ..spec import EncodeSpec
from ..store import MergeSummary, merge_stores

DEFAULT_PARTS = 32
INSTALL = "pip install 'layerwise[ray]'"


def require_ray() -> Any:
    """The ``ray`` module; ``ValueError`` saying what to install when it is missing."""
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--engine ray needs Ray Data: {INSTALL}") from exc
    return ray


@dataclass
class RaySummary:
    """What a Ray extraction did: the parts run (and how many were already complete) and the merge."""

    parts: int
    already_complete: int
    records: int
    skipped: int
    seconds: float
    merge: MergeSummary


class PartWorker:
    """A Ray actor: loads the model once, then extracts whole parts with the local engine."""

    def __init__(self, job: dict[str, Any]):
        import torch

        from ..extractor import Extractor

        torch.set_num_threads(max(1, int(job["cpus_per_worker"])))
        self.job = job
        self.ex = Extractor(job["model"], device=job["device"])

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[Any]]:
        job = self.job
        out: dict[str, list[Any]] = {"part": [], "records": [], "skipped": [], "status": []}
        for part in [int(p) for p in batch["id"]]:
            options = replace(job["options"], num_shards=job["parts"], shard_index=part, progress=False)
            summary = extract_local(job["input"], part_path(job["output"], part), job["spec"], model=self.ex,
                                    reading=job["reading"], options=options, on_shard=job.get("on_shard"))
            out["part"].append(part)
            out["records"].append(summary.records)
            out["skipped"].append(summary.skipped)
            out["status"].append(summary.status)
        return out


def part_path(output: str | os.PathLike, part: int) -> Path:
    """Where part ``part`` of a Ray extraction into ``output`` is written: ``OUTPUT.parts/part-NNNNN``."""
    out = Path(output)
    return out.with_name(out.name + ".parts") / f"part-{part:05d}"


def extract(
    input: str | os.PathLike,
    output: str | os.PathLike,
    spec: EncodeSpec | None = None,
    *,
    model: str | os.PathLike | None = None,
    device: str | None = None,
    reading: ReadOptions | None = None,
    options: ExtractOptions | None = None,
    num_workers: int = 2,
    cpus_per_worker: int = 1,
    gpus_per_worker: float = 0,
    parts: int = DEFAULT_PARTS,
    address: str | None = None,
    on_shard: Any = None,
) -> RaySummary:
    """Extract ``input`` into the store ``output`` on Ray (see the module docstring).

    Args:
        input: a corpus file every worker can read (a shared file system on a cluster).
        output: the merged store's directory; parts go to ``OUTPUT.parts/``.
        spec, reading, options: as for :func:`layerwise.extract` (``options.num_shards``/``shard_index`` are set
            per part).
        model: a model directory or hub id each worker loads (``None``: the embedded default model).
        device: each worker's device (default: CUDA when it has a GPU, else CPU).
        num_workers: actors in the pool. cpus_per_worker: CPUs (and torch threads) per actor. gpus_per_worker:
            GPUs per actor.
        parts: how many parts the input is split into (keep it across reruns: parts resume by number).
        address: a running Ray cluster (``ray.init(address=...)``); default: the one already initialised, else a
            local one.
        on_shard: called in the worker after each shard a part writes (tests).

    Raises:
        ValueError: bad counts, an Extractor instead of a model path (workers load their own), Ray missing.
    """
    from ..checks import positive_ints

    positive_ints(num_workers=num_workers, cpus_per_worker=cpus_per_worker, parts=parts)
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise ValueError("with Ray each worker loads the model itself: pass its directory or hub id, not an Extractor")
    ray = require_ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    spec, reading, options = spec or EncodeSpec(), reading or ReadOptions(), options or ExtractOptions()
    job = {"input": os.fspath(input), "output": os.fspath(output), "spec": spec, "reading": reading,
           "options": options, "parts": parts, "model": None if model is None else os.fspath(model), "device": device,
           "cpus_per_worker": cpus_per_worker, "on_shard": on_shard}
    started = time.perf_counter()
    # from_items: the part numbers live in the driver, so no read task waits for a CPU the actor pool holds
    ds = ray.data.from_items([{"id": p} for p in range(parts)], override_num_blocks=parts).map_batches(
        PartWorker, fn_constructor_kwargs={"job": job}, batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=num_workers), num_cpus=cpus_per_worker, num_gpus=gpus_per_worker,
    )  # Ray Data restarts a dead pool actor and retries its task by default (tested by killing one)
    rows = ds.take_all()
    merged = merge_stores([part_path(output, p) for p in range(parts)], output, overwrite=options.overwrite)
    return RaySummary(parts=parts, already_complete=sum(r["status"] == "already_complete" for r in rows),
                      records=merged.records, skipped=merged.skipped, seconds=time.perf_counter() - started,
                      merge=merged)


__all__ = ["DEFAULT_PARTS", "PartWorker", "RaySummary", "extract", "part_path", "require_ray"]
