"""OpenVINO's half of the one-layer chain (:mod:`~layerwise.model.backends.stages`): layer ``k`` (``k >= 2``) cut
from the ONNX export as a graph of its own (:meth:`~layerwise.model.backends.ort.OnnxBackend.stage_graph`), compiled
like the depth graphs and cached as a blob beside them; each step of the chain cut by rows across the infer
requests (one per stream).

On the default model (2-core AMD EPYC, 2026-11-26) a chain of a 128-sentence SST-2 batch ran in 1.02x the graph's
time, and the same batch with rows at depths 1..6 (61% of the layers) in 0.57x.

Example::

    >>> ov = OpenVinoBackend(loaded)                                                  # doctest: +SKIP
    >>> ov.stages.prepare(6)                                                          # doctest: +SKIP
    1.04
    >>> ov.stages.run(ids, mask, [1, 3, 6], depths=[6, 6, 3, 1]).shape                # doctest: +SKIP
    torch.Size([3, 4, 11, 384])
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from .cache import GraphCache
from .ort import ATTEMPTS, BUILD_LOCK, weights_bytes
from .stages import Stages

if TYPE_CHECKING:
    from .openvino import OpenVinoBackend

log = logging.getLogger("layerwise")

STAGE_FORMAT = 1  # bump when the stage graphs change


class OpenVinoStages(Stages):
    """The one-layer OpenVINO graphs of ``backend``'s model, compiled on first use (:class:`Stages` runs the chain).

    Args:
        backend: the OpenVINO backend whose depth-1 graph, exporter, cache and compile settings the stages share.
    """

    label = "OpenVINO"
    backend: "OpenVinoBackend"

    def __init__(self, backend: "OpenVinoBackend"):
        super().__init__(backend)
        self._compiled: dict[int, tuple[Any, list[Any]]] = {}  # layer -> (compiled model, infer requests)
        self._requests: dict[int, list[Any]] = {}  # depth -> infer requests of the stages' own on its graph

    # ---- graphs ----------------------------------------------------------------------------------------------
    def path_for(self, layer: int) -> Path:
        """Where the compiled graph of ``layer`` alone is cached (a ``.blob``, compiled from its ONNX stage graph)."""
        b = self.backend
        return b.blob_path(b.onnx.stage_path(layer), f"{b.loaded.architecture}-s{layer}-openvino-f{STAGE_FORMAT}")

    def build(self, layer: int) -> Path:
        """The cached compiled graph of ``layer`` alone, cut and compiled now if absent (the time is logged)."""
        path = self.path_for(layer)
        if path.exists():
            return path
        b = self.backend
        cache = GraphCache(b.root)
        t0 = time.perf_counter()
        with BUILD_LOCK:
            files, lease = cache.hold(lambda: [b.onnx.stage_graph(layer), *b.onnx.export_files(layer)], ATTEMPTS)
            try:
                wrote = cache.put(path, lambda tmp: b.compile_source(files[0], tmp / path.name),
                                  weights_bytes(b.loaded), keep=files)
            finally:
                lease.release()
        if wrote:
            log.info("compiled layer %d of %s alone for OpenVINO in %.1f s", layer, b.loaded.name,
                     time.perf_counter() - t0)
        return path

    def compiled(self, layer: int) -> tuple[Any, list[Any]]:
        """The compiled graph of ``layer`` alone and its infer requests (one per stream), compiled on first use; its
        blob leased while it is open."""
        if layer not in self._compiled:
            with BUILD_LOCK:
                if layer not in self._compiled:
                    (path,), lease = GraphCache(self.backend.root).hold(lambda: [self.build(layer)], ATTEMPTS)
                    self.backend.leases.hold(("stage", layer), lease)
                    self._compiled[layer] = self.backend.open_compiled(path, f"layer {layer}")
        return self._compiled[layer]

    # ---- the steps of the chain -----------------------------------------------------------------------------
    def ready(self, layer: int) -> None:
        """:meth:`Stages.ready`: the IR of ``layer`` alone converted (or read from the cache) and compiled."""
        self.compiled(layer)

    def head(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        """:meth:`Stages.head` on infer requests of the stages' own on the depth-1 graph."""
        _split_run(self._own(1), {"input_ids": input_ids, "attention_mask": attention_mask}, len(input_ids),
                   outputs)

    def layer(self, layer: int, state: np.ndarray, attention_mask: np.ndarray, rows: int,
              into: np.ndarray) -> None:
        """:meth:`Stages.layer`, the rows cut across the layer's infer requests."""
        _split_run(self.compiled(layer)[1], {f"hidden_{layer - 1}": state, "attention_mask": attention_mask}, rows,
                   {f"hidden_{layer}": into})

    def whole(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, depth: int) -> torch.Tensor:
        """Layers ``0..depth`` of one batch through the graph of ``depth``, on infer requests of the stages' own
        (the caller's requests may be running another batch meanwhile): ``[depth + 1, batch, tokens, hidden]``."""
        batch, tokens = input_ids.shape
        out = np.empty((depth + 1, batch, tokens, self.backend.loaded.hidden_size), dtype=np.float32)
        with self._lock:
            _split_run(self._own(depth), {"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                                          "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)},
                       batch, {f"hidden_{layer}": out[layer] for layer in range(depth + 1)})
        return torch.from_numpy(out)

    def _own(self, depth: int) -> list[Any]:
        """Infer requests of the stages' own on the backend's compiled graph of layers ``0..depth``."""
        if depth not in self._requests:
            compiled, requests = self.backend.compiled(list(range(depth + 1)))
            self._requests[depth] = [compiled.create_infer_request() for _ in requests]
        return self._requests[depth]


def _split_run(requests: Sequence[Any], inputs: dict[str, np.ndarray], rows: int,
               outputs: dict[str, np.ndarray]) -> None:
    """Run the first ``rows`` rows of ``inputs`` (name -> ``[batch, ...]``) cut by rows across ``requests``, at once,
    and copy each named output into the same rows of ``outputs`` (name -> ``[batch, tokens, hidden]``)."""
    bounds = np.linspace(0, rows, min(len(requests), rows) + 1).astype(int)
    running = []
    for request, start, end in zip(requests, bounds[:-1], bounds[1:]):
        request.start_async({name: value[start:end] for name, value in inputs.items()})
        running.append((request, start, end))
    for request, start, end in running:
        request.wait()
        for name, into in outputs.items():
            into[start:end] = request.get_tensor(name).data

__all__ = ["STAGE_FORMAT", "OpenVinoStages"]
