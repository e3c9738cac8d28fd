"""Sizing the Ray encode pool from the cluster's resources, and refusing a pool that cannot run.

A Ray Data run has four stages; the encode actors hold their CPUs (and GPUs) for the whole run, while the read,
tokenise and write tasks need CPUs of their own beside them (:data:`STAGE_CPUS`). A pool that leaves them less
than their share starves them: Ray Data backpressures the read task for want of a CPU and the run waits forever
without a word. :func:`size_pool` refuses such a pool before anything starts, with the numbers and the fix, and
sizes ``num_workers="auto"`` from the resources: ``GPUs // gpus_per_worker`` when the workers take GPUs (capped by
the CPUs), else ``(CPUs - STAGE_CPUS) // cpus_per_worker``.

:func:`local_resources` counts this machine as a local Ray cluster would (CPUs from the affinity mask and the
cgroup quota; ``ray.init`` itself takes seconds), so a pool that cannot run is refused in the first second;
:func:`cluster_resources` reads a running cluster's (``ray.cluster_resources()``), which the run checks again.
"""

from __future__ import annotations

import math
import multiprocessing
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ExtractError

IO_CPUS = 0.25  # CPUs the read task and each write task reserve: they mostly wait on files
TOKENIZE_CPUS = 0.5  # default CPUs per tokenise task


def stage_cpus(tokenize_cpus: float) -> float:
    """CPUs the stages beside the pool need at least: a read task, a tokenise task and a write task."""
    return IO_CPUS + tokenize_cpus + IO_CPUS


@dataclass(frozen=True)
class Resources:
    """What a Ray cluster offers: ``cpus``, ``gpus``, ``object_store_bytes`` (``None``: not known before start),
    and ``where`` (how messages name it)."""

    cpus: float
    gpus: float
    object_store_bytes: int | None
    where: str


def _cgroup_cpus() -> float | None:
    """The CPU quota of this process's cgroup (v2 ``cpu.max``, v1 ``cfs_quota_us``), ``None`` when unlimited."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period_us = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        return None if quota_us <= 0 else quota_us / period_us
    except (OSError, ValueError):
        return None


def local_resources() -> Resources:
    """This machine as a local Ray cluster sees it: CPUs (the cgroup quota, truncated, when it is below the count of
    CPUs, as Ray counts them; ``RAY_USE_MULTIPROCESSING_CPU_COUNT`` respected), GPUs from ``CUDA_VISIBLE_DEVICES``
    or ``/proc/driver/nvidia/gpus`` (0 when neither says)."""
    cpus: float = multiprocessing.cpu_count()
    quota = None if os.environ.get("RAY_USE_MULTIPROCESSING_CPU_COUNT") else _cgroup_cpus()
    if quota is not None and quota < cpus:
        cpus = max(1, int(quota))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    else:
        nvidia = Path("/proc/driver/nvidia/gpus")
        gpus = len(list(nvidia.iterdir())) if nvidia.is_dir() else 0
    return Resources(cpus=float(cpus), gpus=float(gpus), object_store_bytes=None, where="this machine")


def cluster_resources(ray: Any, address: str | None) -> Resources:
    """The resources of the Ray cluster the driver is connected to (``ray.cluster_resources()``)."""
    res = ray.cluster_resources()
    store = res.get("object_store_memory")
    return Resources(cpus=float(res.get("CPU", 0)), gpus=float(res.get("GPU", 0)),
                     object_store_bytes=int(store) if store else None,
                     where=f"the Ray cluster at {address}" if address else "the Ray cluster")


def _n(x: float) -> str:
    """``2``, ``1.5``: a resource count as people write it."""
    return f"{x:g}"


def _workers(n: int) -> str:
    return f"{n} worker{'' if n == 1 else 's'}"


def size_pool(num_workers: int | str, res: Resources, *, cpus_per_worker: int, gpus_per_worker: float,
              tokenize_cpus: float = TOKENIZE_CPUS) -> int:
    """How many encode actors to start on ``res``: ``num_workers`` checked, or sized for ``"auto"``.

    Raises:
        ExtractError: a pool that leaves the read, tokenise and write stages less than :func:`stage_cpus`, that
            asks for more GPUs than the cluster has, or ``"auto"`` that finds room for no worker; the message
            gives the numbers and the fix.
    """
    need = stage_cpus(tokenize_cpus)
    cpu_room = res.cpus - need
    auto = num_workers == "auto"
    if not auto and (isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1):
        raise ExtractError(f"num_workers must be a positive int or 'auto', got {num_workers!r}")
    workers = 0 if auto else int(num_workers)
    by_cpu = max(0, math.floor(cpu_room / cpus_per_worker + 1e-9))
    if gpus_per_worker > 0:
        by_gpu = math.floor(res.gpus / gpus_per_worker + 1e-9)
        if auto:
            if by_gpu < 1:
                raise ExtractError(
                    f"--num-workers auto with --gpus-per-worker {_n(gpus_per_worker)}: {res.where} has "
                    f"{_n(res.gpus)} GPUs, room for no worker; give --gpus-per-worker 0 to encode on CPUs, or run on "
                    f"a cluster with GPUs (--address)")
            workers = min(by_gpu, by_cpu) if by_cpu >= 1 else by_gpu
        elif workers * gpus_per_worker > res.gpus + 1e-9:
            raise ExtractError(
                f"{_workers(workers)} x {_n(gpus_per_worker)} GPU on {res.where} with {_n(res.gpus)} GPUs "
                f"would wait forever for GPUs; use --num-workers {max(by_gpu, 1) if by_gpu else 'auto'}"
                f"{'' if by_gpu else ' with --gpus-per-worker 0'}, or --num-workers auto")
    elif auto:
        if by_cpu < 1:
            raise ExtractError(
                f"--num-workers auto: {res.where} has {_n(res.cpus)} CPUs; the read, tokenise and write stages need "
                f"{_n(need)} and a worker {cpus_per_worker}, so there is room for no worker; use --cpus-per-worker "
                f"{max(1, math.floor(cpu_room))} or a bigger cluster (--address)" if cpu_room >= 1 else
                f"--num-workers auto: {res.where} has {_n(res.cpus)} CPUs; the read, tokenise and write stages need "
                f"{_n(need)} beside a worker's {cpus_per_worker}; run on a cluster with more CPUs (--address), or "
                f"use the local engine (--engine local)")
        workers = by_cpu
    left = res.cpus - workers * cpus_per_worker
    if left + 1e-9 < need:
        fix = (f"use --num-workers {by_cpu}, or --num-workers auto" if by_cpu >= 1 else
               "use --num-workers auto with fewer --cpus-per-worker, or a bigger cluster (--address)")
        raise ExtractError(
            f"{_workers(workers)} x {cpus_per_worker} CPU on a {_n(res.cpus)}-CPU cluster ({res.where}) leaves "
            f"{_n(max(left, 0))} CPUs for reading, tokenising and writing, which need {_n(need)}: the run would wait "
            f"forever; {fix}")
    return workers


def check_object_store(res: Resources, part_bytes: int) -> None:
    """Refuse parts whose features do not fit a quarter of the cluster's object store (a part travels whole between
    stages, several at once)."""
    if res.object_store_bytes is not None and part_bytes * 4 > res.object_store_bytes:
        raise ExtractError(
            f"one part's features take about {part_bytes / 2**20:,.0f} MiB and {res.where} has a "
            f"{res.object_store_bytes / 2**20:,.0f} MiB object store (a part must fit a quarter of it); use a "
            f"smaller --part-records")


__all__ = ["IO_CPUS", "TOKENIZE_CPUS", "Resources", "check_object_store", "cluster_resources", "local_resources",
           "size_pool", "stage_cpus"]
