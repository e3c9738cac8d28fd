"""ONNX Runtime's half of the one-layer chain (:mod:`~layerwise.model.backends.stages`): layer ``k`` (``k >= 2``)
cut from the ONNX export as a graph of its own (:meth:`~layerwise.model.backends.ort.OnnxBackend.stage_graph`, its
weights read from the export's ``.onnx.data``), opened as an inference session with the backend's own settings;
layers ``0..1`` run on the backend's depth-1 session.

Where ONNX Runtime serves (``auto``'s race put it first on a 2-core AVX2-only AMD EPYC, 2026-11-27), eight batches
of 64 SST-2 sentences with rows at depths 1..6 ran in 3.07 s as this chain, against 5.59 s through the graph of
depth 6; a server's mixed load (layers 1..6, 58% of the layers) ran 1.43-1.53x as fast as the same load all at the
last layer, where the choice between PyTorch's ragged forward and the cut gave 1.00-1.29x before
(benchmarks/README.md, runs 12-14). ONNX Runtime's calls release the GIL, and its sessions take concurrent runs. A
stage graph holds no weights (29 KB on disk for a MiniLM layer; OpenVINO's converted stage holds its layer's 7 MB).

Example::

    >>> ob = OnnxBackend(loaded)                                                       # doctest: +SKIP
    >>> ob.stages.prepare(6)                                                           # doctest: +SKIP
    1.02
    >>> ob.stages.run(ids, mask, [1, 3, 6], depths=[6, 6, 3, 1]).shape                 # doctest: +SKIP
    torch.Size([3, 4, 11, 384])
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .cache import GraphCache
from .stages import Stages

if TYPE_CHECKING:
    from .ort import OnnxBackend


class OrtStages(Stages):
    """The one-layer ONNX Runtime sessions of ``backend``'s model, opened on first use (:class:`Stages` runs the
    chain).

    Args:
        backend: the ONNX Runtime backend whose depth-1 session, export, cache and session settings the stages
            share.
    """

    label = "ONNX Runtime"
    backend: "OnnxBackend"

    def __init__(self, backend: "OnnxBackend"):
        super().__init__(backend)
        self._sessions: dict[int, Any] = {}  # layer -> its inference session

    def session(self, layer: int) -> Any:
        """The inference session of ``layer`` alone (``layer >= 2``): its graph cut now if absent, opened on first
        use."""
        if layer not in self._sessions:
            b = self.backend
            # leased with the export it reads while the session is open (the backend holds the lease)
            (path, *_), lease = GraphCache(b.root).hold(lambda: [b.stage_graph(layer), *b.export_files(layer)])
            b.leases.hold(("stage", layer), lease)
            self._sessions[layer] = b.ort.InferenceSession(str(path), b.options(), providers=["CPUExecutionProvider"])
        return self._sessions[layer]

    # ---- the steps of the chain -----------------------------------------------------------------------------
    def ready(self, layer: int) -> None:
        """:meth:`Stages.ready`: the session of ``layer`` alone opened."""
        self.session(layer)

    def head(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        """:meth:`Stages.head` on the backend's depth-1 session."""
        names = list(outputs)
        got = self.backend.session([0, 1]).run(names, {"input_ids": input_ids, "attention_mask": attention_mask})
        for name, value in zip(names, got):
            outputs[name][...] = value

    def layer(self, layer: int, state: np.ndarray, attention_mask: np.ndarray, rows: int,
              into: np.ndarray) -> None:
        """:meth:`Stages.layer` on the layer's own session."""
        into[:rows] = self.session(layer).run([f"hidden_{layer}"], {f"hidden_{layer - 1}": state[:rows],
                                                                     "attention_mask": attention_mask[:rows]})[0]

    def whole(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, depth: int) -> torch.Tensor:
        """Layers ``0..depth`` through the backend's graph of ``depth`` (a session takes concurrent runs)."""
        return self.backend.forward(input_ids, attention_mask, list(range(depth + 1)), "block")


__all__ = ["OrtStages"]
