"""``auto`` with ``quantize``: the int8 runtimes timed against float32, once per model, as advice.

``quantize="int8"`` (block site only) runs OpenVINO with int8 weights (NNCF) where the ``[openvino]`` extra is
installed, which keeps the layers (last-layer minimum cosine 0.995 on SST-2 dev), else ONNX Runtime's dynamic int8
(0.966); the two are different precisions of a store (``int8-weights``, ``int8``). ``quantize="int8-full"`` (weights
and activations, calibrated) runs on OpenVINO only. Where int8 is slower than float32 (an AVX2-only CPU), a
``layerwise:`` line says so once, naming the faster exact path: :class:`Int8Timing` times them in the router's
background (:class:`~layerwise.model.backends.preparer.Preparer`), at a quiet moment.

Example::

    >>> ex = lw.Extractor(quantize="int8"); ex.encode(["a"]); ex.backend.settle()    # doctest: +SKIP
    >>> sorted(ex.backend.int8_timing)                                               # doctest: +SKIP
    ['depth', 'ms_per_batch', 'slower']
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ...notices import notice
from .offload import Stopped
from .race import int8_report, timed

if TYPE_CHECKING:
    from .base import Backend
    from .router import AutoBackend


class Int8Timing:
    """The int8 runtimes of ``router`` against float32 (PyTorch and ONNX Runtime), timed once per model."""

    def __init__(self, router: "AutoBackend"):
        self.router = router

    @property
    def key(self) -> tuple[str, int, str]:
        """The Preparer's key of the timing (one per model)."""
        return (self.router.loaded.name, 0, "int8")

    def queue(self, depth: int) -> None:
        """Queue the timing at ``depth`` (once; never for ``int8-full``, which has no float32 twin to advise)."""
        if self.router.quantize != "int8-full" and self.router.preparer.future(self.key) is None:
            self.router.preparer.submit(self.key, lambda: self._run(depth))

    def result(self) -> dict[str, Any] | None:
        """The timing once done (``{"depth", "ms_per_batch", "slower"[, "said"]}``, or ``{"error"}``), else
        ``None``."""
        future = self.router.preparer.future(self.key)
        if future is None or not future.done() or future.cancelled() or future.exception() is not None:
            return None
        return future.result()

    def _run(self, depth: int) -> dict[str, Any] | None:
        try:
            timing = self.measure(depth)
        except Stopped:
            raise
        except Exception as exc:  # the timing is advice: it never fails the caller's job
            return {"error": f"{type(exc).__name__}: {exc}"}
        if timing.get("said"):
            notice(timing["said"])
        return timing

    def measure(self, depth: int) -> dict[str, Any]:
        """Seconds per batch through layers ``0..depth`` of the int8 runtimes available (OpenVINO int8 weights,
        ONNX Runtime dynamic int8) and of float32 (PyTorch, and ONNX Runtime exact), as the race times them; see
        :func:`~layerwise.model.backends.race.int8_report`."""
        from .ort import OnnxBackend

        router = self.router
        cache = (router.openvino or router.onnx).root  # type: ignore[union-attr]
        contestants: dict[str, Backend] = {}
        if router.openvino is not None:
            contestants["int8 OpenVINO"] = router.openvino
        contestants["int8 ONNX Runtime"] = router.onnx if router.onnx is not None and router.onnx.quantize else \
            OnnxBackend(router.loaded, cache=cache, quantize="int8")
        contestants["float32 PyTorch"] = router.torch
        contestants["float32 ONNX Runtime"] = OnnxBackend(router.loaded, cache=cache)
        for backend in contestants.values():  # built (or read from the cache) one by one, stopping at exit
            if router.preparer.stopping.is_set():
                raise Stopped
            if backend is not router.torch:
                backend.warm(list(range(depth + 1)))
        times = timed(router.loaded, depth, contestants, router.racer.check_stopped, router.preparer.activity.alone,
                      router.racer.pace)
        return int8_report(depth, str(router.quantize), times)


__all__ = ["Int8Timing"]
