"""Sizing the Ray encode pool from a cluster's resources (no Ray needed): what is refused, with which numbers and
fix, and what ``auto`` takes."""

from __future__ import annotations

import pytest

import layerwise as lw
from layerwise.extraction.pool import Resources, check_object_store, local_resources, size_pool


def res(cpus, gpus=0, store=None):
    return Resources(cpus=cpus, gpus=gpus, object_store_bytes=store, where="the Ray cluster")


def size(n, r, cpus=1, gpus=0.0):
    return size_pool(n, r, cpus_per_worker=cpus, gpus_per_worker=gpus)


def test_a_pool_that_leaves_the_stages_no_cpu_is_refused_with_the_fix():
    with pytest.raises(lw.ExtractError) as err:
        size(2, res(2))
    assert str(err.value) == (
        "2 workers x 1 CPU on a 2-CPU cluster (the Ray cluster) leaves 0 CPUs for reading, tokenising and writing, "
        "which need 1: the run would wait forever; use --num-workers 1, or --num-workers auto")
    with pytest.raises(lw.ExtractError, match=r"1 worker x 4 CPU on a 4-CPU cluster .* use --num-workers auto with "
                                              r"fewer --cpus-per-worker"):
        size(1, res(4), cpus=4)
    assert size(1, res(2)) == 1 and size(3, res(4)) == 3


def test_auto_takes_what_the_cluster_offers():
    assert size("auto", res(2)) == 1
    assert size("auto", res(16)) == 15
    assert size("auto", res(16), cpus=4) == 3
    assert size("auto", res(64, gpus=8), gpus=1) == 8  # one worker a GPU
    assert size("auto", res(64, gpus=8), gpus=0.5) == 16
    assert size("auto", res(4, gpus=8), gpus=1) == 3  # the CPUs cap it
    with pytest.raises(lw.ExtractError, match=r"has 1 CPUs; the read, tokenise and write stages need 1 beside a "
                                              r"worker's 1; run on a cluster with more CPUs"):
        size("auto", res(1))
    with pytest.raises(lw.ExtractError, match=r"has 0 GPUs, room for no worker; give --gpus-per-worker 0"):
        size("auto", res(8), gpus=1)
    with pytest.raises(lw.ExtractError, match=r"2 workers x 1 GPU on the Ray cluster with 1 GPUs would wait "
                                              r"forever for GPUs; use --num-workers 1"):
        size(2, res(8, gpus=1), gpus=1)
    with pytest.raises(lw.ExtractError, match="num_workers must be a positive int or 'auto', got 0"):
        size(0, res(8))


def test_this_machine_is_counted_as_ray_counts_it():
    here = local_resources()
    assert here.cpus >= 1 and here.gpus >= 0 and here.where == "this machine"


def test_a_part_must_fit_the_object_store():
    check_object_store(res(2, store=1 << 30), 100 << 20)
    check_object_store(res(2), 100 << 30)  # not known before the cluster starts: not checked
    with pytest.raises(lw.ExtractError, match=r"about 300 MiB and the Ray cluster has a 1,024 MiB object store .* "
                                              r"use a smaller --part-records"):
        check_object_store(res(2, store=1 << 30), 300 << 20)
