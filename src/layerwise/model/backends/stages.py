"""Rows that leave a compiled graph's batch at their own depth: the encoder run as a chain of one-layer graphs.

A compiled graph runs every row of a batch through every layer it holds. A service whose requests ask for different
depths then either runs each depth's rows as batches of their own (small batches, each paying its overhead) or runs
the shallow rows through layers they do not need. PyTorch cuts the batch between layers
(:mod:`layerwise.model.ragged`); this module does the same for the compiled runtimes, whatever the runtime:

- the depth-1 graph runs the embeddings and layer 1 on every row;
- layer ``k`` (``k >= 2``) is a graph of its own, cut from the same ONNX export
  (:func:`~layerwise.model.backends.ort.cut_stage`: inputs ``hidden_<k-1>`` and the mask, output ``hidden_<k>``),
  opened like the depth graphs and cached on disk beside them;
- the rows are ordered deepest first, so layer ``k`` runs on the first ``keep[k]`` rows only (the rows whose depth is
  at least ``k``).

:class:`Stages` holds what does not depend on the runtime: the check against the full graph, the price, the chain's
loop and its thread. A runtime supplies four steps (:meth:`Stages.ready`, :meth:`Stages.head`, :meth:`Stages.layer`,
:meth:`Stages.whole`): :class:`~layerwise.model.backends.openvino_stages.OpenVinoStages` and
:class:`~layerwise.model.backends.ort_stages.OrtStages`. A backend that has stages mixes in :class:`Staged`, which
gives it :meth:`~layerwise.model.backends.base.Backend.ragged_price` and
:meth:`~layerwise.model.backends.base.Backend.start_ragged`.

What the chain costs against the one graph is measured, not assumed (:meth:`Stages.prepare`): batches of about 64 of
the bundled sample sentences padded to about 32 tokens (a service's batch, not a probe's: the chain's overhead is per
layer call), each pair on a shape of its own (a service's batches rarely repeat a shape, and OpenVINO prepares its
kernels per shape: each of the chain's graphs pays that per batch), run to the deepest layer both ways, five pairs,
alternating. That ratio is the backend's ``ragged_price``,
which the service's batcher weighs against running depths as segments. On the default model (2-core AMD EPYC, AVX2
only, 2026-11-27), eight batches of 64 SST-2 sentences with rows at depths 1..6 ran in 3.07 s as ONNX Runtime's chain
and 3.20 s as OpenVINO's, against 5.59 s and 5.25 s through their graphs of depth 6.

Before it is used, one probe batch with rows at depths ``(d, d-1, 1)`` is checked against the full graph on every
layer (within ``1e-4`` of the states' scale); a model that fails it is never run in stages (said in the log), nor is
one whose layers read more than the state and the mask (ALBERT's read the token ids). Quantised graphs are not cut
into stages (their recipes are per graph).

Example::

    >>> ob = OnnxBackend(loaded)                                                       # doctest: +SKIP
    >>> ob.prepare_ragged(6)                                                           # doctest: +SKIP
    1.04
    >>> ob.start_ragged(ids, mask, [1, 3, 6], "block", depths=[6, 6, 3, 1])().shape    # doctest: +SKIP
    torch.Size([3, 4, 11, 384])
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from ...errors import ModelLoadError
from ...notices import notice
from ..capture import keep_counts
from ..fidelity import sample_texts
from ..ragged import first_difference, probe_rows
from .offload import Stopped

log = logging.getLogger("layerwise")

TIMING_ROUNDS = 5
TIMING_ROWS, TIMING_TOKENS = 64, 32  # the batch the chain is timed on: a service's batch, not a probe's


class Stages(ABC):
    """The one-layer graphs of ``backend``'s model, opened on first use, and the chain that runs a batch whose rows
    need different depths.

    Args:
        backend: the compiled backend whose depth graphs, exporter, cache and settings the stages share (it has
            ``loaded``, ``quantize`` and ``forward``).
    """

    label = "a compiled runtime"  # the runtime's name in messages ("OpenVINO", "ONNX Runtime")

    def __init__(self, backend: Any):
        self.backend = backend
        self._price: dict[int, float | None] = {}  # depth -> measured price, None: not run in stages
        self._preparing = threading.Lock()  # one preparation at a time (a server's warming and a request)
        self._lock = threading.RLock()  # one batch on the stages' graphs at a time

    # ---- what a runtime supplies -----------------------------------------------------------------------------
    @abstractmethod
    def ready(self, layer: int) -> None:
        """Build (or read from the cache) and open the graph of ``layer`` alone (``layer >= 2``).

        Raises:
            ModelLoadError: the layer cannot be cut as a stage (it reads more than the state and the mask).
        """

    @abstractmethod
    def head(self, input_ids: np.ndarray, attention_mask: np.ndarray, outputs: dict[str, np.ndarray]) -> None:
        """Run layers ``0..1`` on every row of ``input_ids`` ``[batch, tokens]`` (int64) and copy each named output
        (``hidden_1``, and ``hidden_0`` when asked) into ``outputs`` (name -> ``[batch, tokens, hidden]``)."""

    @abstractmethod
    def layer(self, layer: int, state: np.ndarray, attention_mask: np.ndarray, rows: int,
              into: np.ndarray) -> None:
        """Run ``layer`` alone on the first ``rows`` rows of ``state`` (``hidden_<layer-1>``, ``[batch, tokens,
        hidden]``) and write ``hidden_<layer>`` into the same rows of ``into`` (same shape)."""

    @abstractmethod
    def whole(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, depth: int) -> torch.Tensor:
        """Layers ``0..depth`` of one batch through the graph of ``depth``: ``[depth + 1, batch, tokens, hidden]``,
        whatever the caller runs meanwhile (OpenVINO: on infer requests of the stages' own; ONNX Runtime: a session
        takes concurrent runs)."""

    # ---- readiness and price ---------------------------------------------------------------------------------
    def price(self, depth: int) -> float | None:
        """The measured price of a token-layer run in stages up to ``depth`` against the graph of ``depth``
        (:meth:`prepare`), or ``None`` while not prepared or where the model is not run in stages. A deeper chain
        that was prepared covers ``depth``: its stages are the same graphs, checked and timed, so its price holds."""
        if depth in self._price:
            return self._price[depth]
        deeper = self._covering(depth)
        return None if deeper is None else self._price[deeper]

    def prepared(self, depth: int) -> bool:
        """Whether :meth:`prepare` ran for ``depth`` or for a deeper chain that runs in stages (whatever it
        found)."""
        return depth in self._price or self._covering(depth) is not None

    def _covering(self, depth: int) -> int | None:
        """The shallowest prepared depth above ``depth`` whose chain runs in stages, if any (none below 2)."""
        return min((d for d, p in list(self._price.items()) if d > depth and p is not None), default=None) \
            if depth >= 2 else None  # (a copy: another thread's prepare() may add a depth meanwhile)

    def prepare(self, depth: int, alone: Callable[[], ContextManager[None]] | None = None) -> float | None:
        """Build and open layers ``2..depth`` as stages, check a chain against the graph of ``depth``, and measure
        what it costs: returns the price (the median over paired runs of chain time over graph time, at least 1.0),
        or ``None`` when the model cannot run in stages (a quantised graph, a depth below 2, a layer that reads more
        than the state and the mask, states that differ, or a runtime's error while building them; the reason is
        logged, and the depth is not tried again). Once per depth, and not at all
        below a depth already prepared. ``alone``: a context in which the caller starts no forward pass of its own
        (``auto`` holds its caller's next batch meanwhile), so that the chain and the graph are timed as they run
        when serving, not against the caller's batches: a chain of many short runs loses more to a busy machine than
        one graph does, and a price measured under load (1.6x seen, against 1.0-1.1x alone) kept mixed calls off the
        chain for the life of the process."""
        with self._preparing:
            if self.prepared(depth):
                return self.price(depth)
            try:
                price = self._measure(depth, alone or contextlib.nullcontext)
            except Stopped:
                raise
            except Exception as exc:  # a runtime's error (a conversion, a session): never retried by every call
                log.warning("%s is not run in %s stages: preparing layers 2..%d failed: %s: %s",
                            self.backend.loaded.name, self.label, depth, type(exc).__name__, exc)
                price = None
            self._price[depth] = price
            return price

    def _measure(self, depth: int, alone: Callable[[], ContextManager[None]]) -> float | None:
        b = self.backend
        if b.quantize or depth < 2:
            return None
        t0 = time.perf_counter()
        try:
            for layer in range(2, depth + 1):
                self.ready(layer)
        except ModelLoadError as exc:
            log.info("%s is not run in %s stages: %s", b.loaded.name, self.label, exc)
            return None
        if not self._agrees(depth):
            return None
        texts = sample_texts()
        batches = []  # a new shape for every pair, as a service's batches come (a runtime that compiles kernels per
        for r in range(-1, TIMING_ROUNDS):  # shape pays for it here as it does there)
            rows, tokens = TIMING_ROWS - 2 * (r + 1), TIMING_TOKENS + r + 1
            enc = b.loaded.tokenizer((texts * rows)[:rows], padding="max_length", truncation=True,
                                     max_length=tokens, return_tensors="pt")
            batches.append((enc["input_ids"], enc["attention_mask"]))
        layers = list(range(depth + 1))

        def spread(rows: int) -> list[int]:  # the rows' depths spread over 1..depth, deepest first, as mixed calls'
            return sorted((1 + (i * depth) // rows for i in range(rows)), reverse=True)

        runs = {"chain": lambda ids, mask: self.run(ids, mask, layers, spread(ids.shape[0])),
                "whole": lambda ids, mask: self.whole(ids, mask, depth)}
        # the chain runs each row only to its depth: its time is weighed by the layers it ran against the graph's
        needed = [sum(spread(ids.shape[0])) / (ids.shape[0] * depth) for ids, _ in batches[1:]]
        times: dict[str, list[float]] = {"chain": [], "whole": []}
        with alone():
            # a first pair untimed (the caller's batches still running finish meanwhile), then pairs, their order
            # alternating: a busy moment slows both of a pair
            for r in range(-1, TIMING_ROUNDS):
                for which in ("chain", "whole") if r % 2 == 0 else ("whole", "chain"):
                    t = time.perf_counter()
                    runs[which](*batches[r + 1])
                    if r >= 0:
                        times[which].append(time.perf_counter() - t)
        # the median of the pairs' ratios: one slow moment (the caller's own batches, another process) moves it
        # less than a ratio of minimums, and a price measured once holds for the life of the process
        price = max(1.0, float(np.median([c / (w * f) for c, w, f in zip(times["chain"], times["whole"], needed)])))
        chain, whole = float(np.median(times["chain"])), float(np.median(times["whole"]))
        notice(f"{self.label} runs {b.loaded.name}'s layers 2..{depth} also one graph each, so rows leave a batch at "
               f"their own depth: a token-layer costs {price:.2f}x the graph of layers 0..{depth} (a batch of rows at "
               f"depths 1..{depth}: {chain * 1e3:.0f} ms, through the graph {whole * 1e3:.0f} ms; prepared in "
               f"{time.perf_counter() - t0:.1f} s)")
        return price

    def _agrees(self, depth: int) -> bool:
        """The probe rows of :func:`~layerwise.model.ragged.probe_rows` run in stages equal the full graph on every
        layer ``1..depth``, on the rows that ran it (:func:`~layerwise.model.ragged.first_difference`)."""
        b = self.backend
        ids, mask, depths = probe_rows(b.loaded.tokenizer, depth)
        layers = list(range(1, depth + 1))
        staged = self.run(ids, mask, layers, depths)
        layer = first_difference(staged, self.whole(ids, mask, depth)[1:], mask, depths, layers, b.loaded.num_layers)
        if layer is not None:
            log.info("%s is not run in %s stages: layer %d differs from the graph of layers 0..%d",
                     b.loaded.name, self.label, layer, depth)
        return layer is None

    # ---- the chain -------------------------------------------------------------------------------------------
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
            depths: Sequence[int]) -> torch.Tensor:
        """Run one batch with each row only to its own depth.

        Args:
            input_ids: ``[batch, tokens]``.
            attention_mask: ``[batch, tokens]``, right-padded.
            layers: the states wanted, ``0..max(depths)``, in output order.
            depths: per row, its deepest layer, non-increasing (deepest first).

        Returns:
            ``[len(layers), batch, tokens, hidden]`` float32: a row holds the layers up to its depth (layers 0 and 1
            for every row: they run as one graph), zeros elsewhere.
        """
        b = self.backend
        keep = keep_counts(depths, b.loaded.num_layers)
        batch, tokens = input_ids.shape
        # each wanted layer is written straight into its place in the result, which the next layer then reads (no
        # copies); only the rows that do not reach a layer are zeroed
        out = np.empty((len(layers), batch, tokens, b.loaded.hidden_size), dtype=np.float32)
        index = {layer: k for k, layer in enumerate(layers)}
        mask = attention_mask.numpy().astype(np.int64, copy=False)
        scratch = list(np.empty((2, batch, tokens, b.loaded.hidden_size), dtype=np.float32))

        def target(layer: int, state: np.ndarray | None) -> np.ndarray:
            """Where ``layer``'s states go: its place in the result, else a scratch buffer that is not ``state``."""
            if layer in index:
                return out[index[layer]]
            return scratch[0] if state is None or scratch[0] is not state else scratch[1]

        ran = {layer: batch for layer in (0, 1)}  # layer -> the rows that ran it
        with self._lock:  # one batch at a time (the preparation of another depth runs the same graphs)
            state = target(1, None)
            outputs = {"hidden_1": state} | ({"hidden_0": out[index[0]]} if 0 in index else {})
            self.head(input_ids.numpy().astype(np.int64, copy=False), mask, outputs)  # every row: layers 0..1
            for layer in range(2, max(max(layers), 1) + 1):
                n = keep[layer]
                if n == 0:
                    break
                into = target(layer, state)
                self.layer(layer, state, mask, n, into)
                state, ran[layer] = into, n  # what this layer gave is the next one's input
        for layer, k in index.items():
            out[k, ran.get(layer, 0):] = 0.0  # rows that stopped before the layer
        return torch.from_numpy(out)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
              depths: Sequence[int]) -> Callable[[], torch.Tensor]:
        """:meth:`run` started in the process's chain thread (:func:`chain_runner`), returning at once: the caller
        prepares and reduces other batches while the runtime computes this one (its calls release the GIL). Batches
        started one after another run in that order, whichever runtime's chain runs them. Returns a callable that
        waits for the states."""
        future = chain_runner().submit(self.run, input_ids, attention_mask, layers, depths)
        return future.result


_RUNNER: ThreadPoolExecutor | None = None
_RUNNER_LOCK = threading.Lock()


def chain_runner() -> ThreadPoolExecutor:
    """The one thread of the process that runs chains (:meth:`Stages.start`), whatever the runtime: two runtimes'
    chains never run at once (a service that tries ONNX Runtime's chain and OpenVINO's on alternate calls would
    otherwise run both together, each slowing the other and each call charged for the other's time)."""
    global _RUNNER
    with _RUNNER_LOCK:
        if _RUNNER is None:
            _RUNNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerwise-stages")
        return _RUNNER


class Staged:
    """What a backend with :class:`Stages` (its ``stages`` attribute) offers a caller with rows of mixed depths:
    :meth:`ragged_price` and :meth:`start_ragged` (those of :class:`~layerwise.model.backends.base.Backend`), and
    :meth:`prepare_ragged`, which builds them (``auto`` calls it in the background, a server warming several
    depths at start)."""

    stages: Stages

    def ragged_price(self, depth: int, site: str) -> float | None:
        """:meth:`Backend.ragged_price`: the measured price of running layers ``2..depth`` one graph each (about 1.0
        and more: the chain's overhead), once :meth:`prepare_ragged` ran for ``depth``; ``None`` before, for a
        quantised model, or where the stages differ from the graph."""
        return self.stages.price(depth) if site == "block" else None

    def prepare_ragged(self, depth: int, alone: Callable[[], ContextManager[None]] | None = None) -> float | None:
        """Build, check and time the one-layer graphs up to ``depth`` (once; see :meth:`Stages.prepare`, and
        ``alone`` there); returns :meth:`ragged_price`."""
        return self.stages.prepare(depth, alone)

    def start_ragged(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str,
        depths: Sequence[int],
    ) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start_ragged`: each row through the one-layer graphs up to its own depth where they are
        prepared for ``max(layers)``, else every row through the graph of ``max(layers)``. Returns at once (the
        chain runs in a thread of the stages')."""
        if self.ragged_price(max(layers), site) is None:
            return self.start(input_ids, attention_mask, layers, site)  # type: ignore[attr-defined]
        return self.stages.start(input_ids, attention_mask, layers, depths)


__all__ = ["TIMING_ROUNDS", "TIMING_ROWS", "TIMING_TOKENS", "Staged", "Stages", "chain_runner"]
