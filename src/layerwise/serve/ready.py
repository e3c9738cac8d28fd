"""Ready means ready: the depths a server warms before it says so (``layerwise serve --warm LAYERS``), and
``GET /ready``.

``/health`` answers as soon as the process serves HTTP. ``/ready`` answers 200 only once the default request's depth
(the last layer) and every ``--warm`` depth are prepared: their blocks loaded and, under ``backend="auto"``, their
runtime decided (the compiled graph exported, checked and raced in the background; PyTorch answers requests
meanwhile, so nothing waits for it). A server that warms several depths will batch requests of different depths
together, so it also prepares what lets each row leave a batch at its own depth (on ONNX Runtime or OpenVINO, under
``auto`` or named, the one-layer graphs of :mod:`~layerwise.model.backends.stages`). Until then it answers 503 with
what is still being prepared, which is what a load balancer's readiness probe expects. Once ready it stays ready:
a request at a depth nobody warmed is served at once (by PyTorch until its runtime is decided), and that depth's
preparation is said in ``preparing``, never in the status. A named compiled runtime (``--backend onnx`` or
``openvino``) compiles the warmed depths before it is ready and then serves only from them: a request for another
depth runs on the shallowest warmed graph that covers it, never compiling a graph on a request's path.

Example::

    $ layerwise serve --warm 3 --warm -4:
    $ curl -s localhost:8000/ready
    {"ready": true, "depths": {"3": "onnx", "6": "onnx"}, "pending": [], "preparing": [], "error": null}
"""

from __future__ import annotations

import threading
import time
from typing import Any, ContextManager, Sequence

from ..encoding.layers import LayerSpec, resolve_layers
from ..encoding.spec import EncodeSpec
from ..extractor import Extractor


def warm_depths(ex: Extractor, specs: Sequence[LayerSpec] = ()) -> list[int]:
    """The depths to prepare: the default request's (``EncodeSpec().layers``) and the deepest layer of each of
    ``specs`` (each at least 1: a graph serves layers ``0..depth``), in order, once each.

    Raises:
        SpecError: a spec that is not a layer spec of this model (its valid values said).
    """
    depths: list[int] = []
    for spec in [EncodeSpec().layers, *specs]:
        depth = max(1, max(resolve_layers(spec, ex.num_layers)))
        if depth not in depths:
            depths.append(depth)
    return depths


class Readiness:
    """The warming of ``depths`` on ``ex``'s backend, started by :meth:`start` in a thread (the server answers
    meanwhile), and its state for ``/ready``."""

    def __init__(self, ex: Extractor, depths: Sequence[int], model_lock: ContextManager[Any] | None = None):
        self.ex, self.depths = ex, list(depths)
        # held while a named compiled runtime's one-layer stages are timed: the service's calls wait, so the price is
        # the chain's alone (auto holds its caller's passes itself)
        self.model_lock = model_lock
        self.done = threading.Event()
        self.error: str | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "Readiness":
        """Start warming (returns at once)."""
        self._thread = threading.Thread(target=self._warm, name="layerwise-warm", daemon=True)
        self._thread.start()
        return self

    def _warm(self) -> None:
        try:
            for depth in self.depths:
                self.ex.backend.warm(list(range(depth + 1)))
            if len(self.depths) > 1:  # requests of several depths will share batches: rows leave at their own
                prepare = getattr(self.ex.backend, "prepare_ragged", None)  # a compiled runtime's one-layer stages
                if prepare is not None:  # (a failure is logged there: rows of mixed depths then run as segments)
                    lock = self.model_lock
                    prepare(max(self.depths), alone=None if lock is None else lambda: lock)
                else:  # auto queues its stages in its background preparation (pending() until done); others: no-op
                    self.ex.backend.ragged_price(max(self.depths), "block")
            while set(self.ex.backend.pending()) & set(self.depths):  # the warmed depths' background preparation
                time.sleep(0.1)
            serve_only = getattr(self.ex.backend, "serve_only", None)  # a named compiled runtime (auto prepares on
            if serve_only is not None:  # its own): another depth runs on a warmed graph, never compiled on a request
                serve_only(self.depths)
        except Exception as exc:  # said by /ready; requests still run (and say their own errors)
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.done.set()

    def state(self) -> dict[str, Any]:
        """``{"ready": bool, "depths": {depth: runtime or "preparing"}, "pending": [warmed depths not ready],
        "preparing": [other depths being prepared], "error": str | None}``. Ready once the warming of the default and
        ``--warm`` depths finished without error, and from then on: a request at another depth, and what the
        background prepares for it, is said in ``preparing`` and never changes the status."""
        warming = [] if self.done.is_set() else list(self.depths)
        background = [d for d in self.ex.backend.pending() if d not in warming]
        return {"ready": self.done.is_set() and self.error is None,
                "depths": {str(d): "preparing" if d in warming else self._runtime(d) for d in self.depths},
                "pending": warming, "preparing": sorted(background), "error": self.error}

    def _runtime(self, depth: int) -> str:
        """The runtime serving a warmed ``depth``, asked without side effects (no call is planned)."""
        decisions = getattr(self.ex.backend, "decisions", None)
        decided = decisions.decision(depth) if decisions is not None else None
        if decided is not None:
            return decided.runtime
        runtime_for = getattr(self.ex.backend, "runtime_for", None)
        return runtime_for(list(range(depth + 1)), "block") if runtime_for else self.ex.backend.name

__all__ = ["Readiness", "warm_depths"]
