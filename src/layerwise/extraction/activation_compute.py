"""Where a batch of packed contexts is computed and converted to a token-activation store's dtype: in this process
(:class:`LocalCompute`: the store's runtime, ``plan.ahead`` batches in flight), or on Ray (:class:`RayCompute`:
``extract --context-size N --engine ray``, a pool of actors each loading the model once from its
:class:`~layerwise.ModelOptions`, fed the driver's batches round-robin and read back in the order they were sent).

Reading, packing and writing stay in the driver (:mod:`layerwise.extraction.activations`), so a store written on
Ray has the same layout, contexts and shards as one written locally; its values are the same runtime's on the same
contexts (a worker's thread count may change the last float bits of a product; a test holds them within 1e-5 of the
local run's). Each actor converts its batch to the store's dtype before sending it, so float8 and bfloat16 cross the
network at their stored size. float8 is e4m3 with a float32 scale per token (``amax / 448``), and its cosine to float32
is measured where it is converted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ..encoding.contexts import ContextSpec
from ..extractor import Extractor
from ..model.options import ModelOptions
from .cluster import RayCluster
from .ray import require_ray
from .runtime import pinned

MAX_AHEAD = 256  # batches in flight at most (their token ids wait in memory)
FLOAT8_MAX = 448.0  # the largest finite e4m3 value
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                "float8": torch.float8_e4m3fn}


@dataclass
class Converted:
    """One layer of a batch as stored: ``values [rows, W]`` in the store's dtype, float8's ``scale [rows]`` and its
    ``cosine [rows]`` to float32 (else ``None``)."""

    values: torch.Tensor
    scale: torch.Tensor | None = None
    cosine: torch.Tensor | None = None


def convert(states: torch.Tensor, dtype: str) -> list[Converted]:
    """Each layer of ``states [K, b, N, W]`` as ``[b * N, W]`` rows in ``dtype``, converted on the states' device
    (float8: e4m3 with a float32 scale per token, ``amax / 448``, and its cosine to float32)."""
    rows = states.shape[1] * states.shape[2]
    out = []
    for i in range(states.shape[0]):
        x = states[i].reshape(rows, -1)
        if dtype == "float8":
            x = x.float()
            scale = x.abs().amax(dim=-1).clamp_min(1e-12) / FLOAT8_MAX
            q = (x / scale[:, None]).to(torch.float8_e4m3fn)
            cosine = torch.nn.functional.cosine_similarity(q.float() * scale[:, None], x, dim=-1)
            out.append(Converted(q, scale, cosine))
        else:
            out.append(Converted(x.to(TORCH_DTYPES[dtype])))
    return out


class LocalCompute:
    """The compute stage in this process: each batch started on the store's runtime (``plan``), up to
    ``plan.ahead`` in flight, converted where it was computed."""

    def __init__(self, ex: Extractor, layers: tuple[int, ...], site: str, dtype: str):
        self.plan = ex.backend.plan(layers, site)
        self.layers, self.site, self.dtype = layers, site, dtype
        # a streamed model starts its batches before it waits for the first (the backend groups them into chunks);
        # the run's own bound keeps the contexts waiting in memory bounded whatever the corpus
        self.ahead = max(1, min(self.plan.ahead(layers, site), MAX_AHEAD))
        device = ex.backend.device
        self.pin = getattr(device, "type", str(device)) == "cuda"  # shard buffers in pinned host memory

    def batch_tokens_cap(self) -> int | None:
        """The most tokens a batch may hold (a model streamed block by block: what ``max_memory`` leaves)."""
        return self.plan.batch_tokens_cap(self.layers, self.site)

    def start(self, ids: np.ndarray) -> Callable[[], list[Converted]]:
        """Start the batch ``ids [b, N]``; the returned function waits for its converted layers."""
        t = torch.from_numpy(ids.astype(np.int64))
        wait = self.plan.start(t, torch.ones_like(t), self.layers, self.site)
        return lambda: convert(wait(), self.dtype)



class ContextWorker:
    """One actor: the model loaded once, batches of contexts in, converted layers out."""

    def __init__(self, options: str, runtime: dict[str, Any], spec: dict[str, Any], threads: int):
        torch.set_num_threads(max(1, threads))
        self.spec = ContextSpec.from_dict(spec)
        self.runtime = runtime
        self.ex = Extractor.from_options(ModelOptions.from_json(options))

    def run(self, ids: np.ndarray) -> list[Converted]:
        """``ids [b, N]`` through the model on the store's runtime; each layer converted (on the CPU, to send)."""
        with pinned(self.ex, self.runtime):
            out = LocalCompute(self.ex, self.spec.layers, self.spec.site, self.spec.dtype).start(ids)()
        return [Converted(c.values.cpu(), None if c.scale is None else c.scale.cpu(),
                          None if c.cosine is None else c.cosine.cpu()) for c in out]


class RayCompute:
    """The compute stage on ``num_workers`` Ray actors (a context manager: the cluster of
    :class:`~layerwise.extraction.cluster.RayCluster`, connected to or started, and the actors ended at the exit).

    ``ahead`` batches are in flight (two per actor); :meth:`start` sends one to the next actor in turn."""

    pin = False

    def __init__(self, options: ModelOptions, runtime: dict[str, Any], spec: ContextSpec, *, num_workers: int,
                 cpus_per_worker: int, gpus_per_worker: float, address: str | None):
        self.ray = require_ray()
        self.options, self.runtime, self.spec = options, runtime, spec
        self.workers, self.cpus, self.gpus = max(1, num_workers), cpus_per_worker, gpus_per_worker
        self.address = address
        self.ahead = 2 * self.workers
        self.actors: list[Any] = []
        self._cluster: RayCluster | None = None
        self._next = 0

    def __enter__(self) -> "RayCompute":
        self._cluster = RayCluster(self.ray, self.address).__enter__()
        actor = self.ray.remote(ContextWorker).options(num_cpus=self.cpus, num_gpus=self.gpus)
        self.actors = [actor.remote(self.options.to_json(), self.runtime, self.spec.to_dict(), self.cpus)
                       for _ in range(self.workers)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []
        if self._cluster is not None:
            self._cluster.__exit__(*exc)

    def batch_tokens_cap(self) -> int | None:
        """No cap from here: each actor's runtime runs the batches it is given."""
        return None

    def start(self, ids: np.ndarray) -> Callable[[], list[Converted]]:
        """Send ``ids [b, N]`` to the next actor; the returned function waits for its converted layers."""
        ref = self.actors[self._next % len(self.actors)].run.remote(ids)
        self._next += 1
        return lambda: _owned(self.ray.get(ref))


def _owned(converted: list[Converted]) -> list[Converted]:
    """What an actor sent, in memory of this process's own (nothing left pointing into Ray's object store, which
    ``ray.shutdown()`` unmaps)."""
    return [Converted(c.values.clone(), None if c.scale is None else c.scale.clone(),
                      None if c.cosine is None else c.cosine.clone()) for c in converted]


__all__ = ["Converted", "ContextWorker", "LocalCompute", "RayCompute", "TORCH_DTYPES", "convert"]
