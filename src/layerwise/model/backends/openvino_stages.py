"""Rows that leave an OpenVINO batch at their own depth: the encoder run as a chain of one-layer graphs.

A compiled graph runs every row of a batch through every layer it holds. A service whose requests ask for different
depths then either runs each depth's rows as batches of their own (small batches, each paying its overhead) or runs
the shallow rows through layers they do not need. PyTorch cuts the batch between layers
(:mod:`layerwise.model.ragged`); this module does the same for OpenVINO:

- the depth-1 graph of :class:`~layerwise.model.backends.openvino.OpenVinoBackend` runs the embeddings and layer 1 on
  every row;
- layer ``k`` (``k >= 2``) is a graph of its own, cut from the same ONNX export
  (:func:`~layerwise.model.backends.ort.cut_stage`: inputs ``hidden_<k-1>`` and the mask, output ``hidden_<k>``),
  converted and compiled like the depth graphs, cached on disk beside them;
- the rows are ordered deepest first, so layer ``k`` runs on the first ``keep[k]`` rows only (the rows whose depth is
  at least ``k``), cut by rows across the infer requests (one per stream).

What the chain costs against the one graph is measured, not assumed (:meth:`OpenVinoStages.prepare`): a batch of
64 of the bundled sample sentences padded to 32 tokens (a service's batch, not a probe's: the chain's overhead is
per layer call), run to the deepest layer both ways, best of three, alternating. That ratio is the backend's
:meth:`~layerwise.model.backends.base.Backend.ragged_price`, which the service's batcher weighs against running
depths as segments. On the default model (2-core AMD EPYC, 2026-11-26) a chain of a 128-sentence SST-2 batch ran
in 1.02x the graph's time, and the same batch with rows at depths 1..6 (61% of the layers) in 0.57x.

Before it is used, one probe batch with rows at depths ``(d, d-1, 1)`` is checked against the full graph on every
layer (within ``1e-4`` of the states' scale); a model that fails it is never run in stages (said in the log), nor is
one whose layers read more than the state and the mask (ALBERT's read the token ids). Quantised graphs are not cut
into stages (their recipes are per graph).

Example::

    >>> ov = OpenVinoBackend(loaded)                                                  # doctest: +SKIP
    >>> stages = OpenVinoStages(ov)                                                   # doctest: +SKIP
    >>> stages.prepare(6)                                                             # doctest: +SKIP
    1.04
    >>> stages.run(ids, mask, [1, 3, 6], depths=[6, 6, 3, 1]).shape                   # doctest: +SKIP
    torch.Size([3, 4, 11, 384])
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Sequence

import numpy as np
import torch

from ...errors import ModelLoadError
from ...notices import notice
from ..capture import keep_counts
from ..fidelity import sample_texts
from ..ragged import first_difference, probe_rows
from .cache import GraphCache
from .ort import BUILD_LOCK, weights_bytes

if TYPE_CHECKING:
    from .openvino import OpenVinoBackend

log = logging.getLogger("layerwise")

STAGE_FORMAT = 1  # bump when the stage graphs change
TIMING_ROUNDS = 5
TIMING_ROWS, TIMING_TOKENS = 64, 32  # the batch the chain is timed on: a service's batch, not a probe's


class OpenVinoStages:
    """The one-layer graphs of ``backend``'s model, compiled on first use, and the chain that runs a batch whose
    rows need different depths.

    Args:
        backend: the OpenVINO backend whose depth-1 graph, exporter, cache and compile settings the stages share.
    """

    def __init__(self, backend: "OpenVinoBackend"):
        self.backend = backend
        self._compiled: dict[int, tuple[Any, list[Any]]] = {}  # layer -> (compiled model, infer requests)
        self._price: dict[int, float | None] = {}  # depth -> measured price, None: not run in stages
        self._preparing = threading.Lock()  # one preparation at a time (a server's warming and a request)
        self._lock = threading.RLock()  # one batch on the stages' requests at a time
        self._requests: dict[int, list[Any]] = {}  # depth -> infer requests of the stages' own on its graph
        self._runner: ThreadPoolExecutor | None = None  # runs started batches, one at a time (start())

    # ---- graphs ----------------------------------------------------------------------------------------------
    def path_for(self, layer: int) -> Path:
        """Where the converted graph of ``layer`` alone is cached (``.xml`` beside its ``.bin``)."""
        b = self.backend
        key = {"weights": b.fingerprint(), "family": b.loaded.architecture, "stage": layer, "stages": STAGE_FORMAT,
               "onnx": b.onnx.path_for(layer).name, **b.ir_version()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return b.root / f"{b.loaded.architecture}-s{layer}-openvino-{digest}.xml"

    def build(self, layer: int) -> Path:
        """The cached IR of ``layer`` alone, cut and converted now if absent (the time is said on stderr)."""
        path = self.path_for(layer)
        if path.exists() and path.with_suffix(".bin").exists():
            return path
        t0 = time.perf_counter()
        graph = str(self.backend.onnx.stage_graph(layer))
        tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}.xml")
        self.backend.convert(graph, tmp)
        os.replace(tmp.with_suffix(".bin"), path.with_suffix(".bin"))
        os.replace(tmp, path)
        log.info("converted layer %d of %s alone to OpenVINO in %.1f s", layer, self.backend.loaded.name,
                 time.perf_counter() - t0)
        GraphCache(self.backend.root).grew(path, weights_bytes(self.backend.loaded))
        return path

    def compiled(self, layer: int) -> tuple[Any, list[Any]]:
        """The compiled graph of ``layer`` alone and its infer requests (one per stream), compiled on first use."""
        if layer not in self._compiled:
            with BUILD_LOCK:
                if layer not in self._compiled:
                    path = self.build(layer)
                    GraphCache.touch(path, path.with_suffix(".bin"))
                    self._compiled[layer] = self.backend.compile_path(path, f"layer {layer}")
        return self._compiled[layer]

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
        return min((d for d, p in self._price.items() if d > depth and p is not None), default=None) \
            if depth >= 2 else None

    def prepare(self, depth: int, alone: Callable[[], ContextManager[None]] | None = None) -> float | None:
        """Build and compile layers ``2..depth`` as stages, check a chain against the graph of ``depth``, and
        measure what it costs: returns the price (the median over paired runs of chain time over graph time, at least
        1.0), or ``None`` when the model cannot run in stages (a quantised graph, a depth below 2, a layer that reads
        more than the state and the mask, or states that differ; the reason is logged). Once per depth, and not at
        all below a depth already prepared. ``alone``: a context in which the caller starts no forward pass of its
        own (``auto`` holds its caller's next batch meanwhile), so that the chain and the graph are timed as they
        run when serving, not against the caller's batches: a chain of many short runs loses more to a busy machine
        than one graph does, and a price measured under load (1.6x seen, against 1.0-1.1x alone) kept mixed calls
        off the chain for the life of the process."""
        with self._preparing:
            if self.prepared(depth):
                return self.price(depth)
            self._price[depth] = self._measure(depth, alone or contextlib.nullcontext)
            return self._price[depth]

    def _measure(self, depth: int, alone: Callable[[], ContextManager[None]]) -> float | None:
        b = self.backend
        if b.quantize or depth < 2:
            return None
        t0 = time.perf_counter()
        try:
            for layer in range(2, depth + 1):
                self.compiled(layer)
        except ModelLoadError as exc:
            log.info("%s is not run in OpenVINO stages: %s", b.loaded.name, exc)
            return None
        if not self._agrees(depth):
            return None
        texts = sample_texts()
        enc = b.loaded.tokenizer((texts * TIMING_ROWS)[:TIMING_ROWS], padding="max_length", truncation=True,
                                 max_length=TIMING_TOKENS, return_tensors="pt")
        ids, mask = enc["input_ids"], enc["attention_mask"]
        layers = list(range(depth + 1))
        rows = [depth] * ids.shape[0]
        runs = {"chain": lambda: self.run(ids, mask, layers, rows), "whole": lambda: self.whole(ids, mask, depth)}
        times: dict[str, list[float]] = {"chain": [], "whole": []}
        with alone():
            # a first pair untimed (the caller's batches still running finish meanwhile), then pairs, their order
            # alternating: a busy moment slows both of a pair
            for r in range(-1, TIMING_ROUNDS):
                for which in ("chain", "whole") if r % 2 == 0 else ("whole", "chain"):
                    t = time.perf_counter()
                    runs[which]()
                    if r >= 0:
                        times[which].append(time.perf_counter() - t)
        # the median of the pairs' ratios: one slow moment (the caller's own batches, another process) moves it
        # less than a ratio of minimums, and a price measured once holds for the life of the process
        price = max(1.0, float(np.median([c / w for c, w in zip(times["chain"], times["whole"])])))
        chain, whole = float(np.median(times["chain"])), float(np.median(times["whole"]))
        notice(f"OpenVINO runs {b.loaded.name}'s layers 2..{depth} also one graph each, so rows leave a batch at "
               f"their own depth: a token-layer costs {price:.2f}x the graph of layers 0..{depth} ({chain * 1e3:.0f} "
               f"against {whole * 1e3:.0f} ms a batch; prepared in {time.perf_counter() - t0:.1f} s)")
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
            log.info("%s is not run in OpenVINO stages: layer %d differs from the graph of layers 0..%d",
                     b.loaded.name, layer, depth)
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
        out = np.zeros((len(layers), batch, tokens, b.loaded.hidden_size), dtype=np.float32)
        index = {layer: k for k, layer in enumerate(layers)}
        mask = attention_mask.numpy().astype(np.int64, copy=False)
        state, spare = np.empty((2, batch, tokens, b.loaded.hidden_size), dtype=np.float32)
        with self._lock:  # the stages' requests: one batch at a time (the preparation of another depth runs them)
            outputs = {"hidden_1": state} | ({"hidden_0": out[index[0]]} if 0 in index else {})
            _split_run(self._own(1), {"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                                      "attention_mask": mask}, batch, outputs)  # every row: layers 0..1
            if 1 in index:
                out[index[1]] = state
            for layer in range(2, max(max(layers), 1) + 1):
                n = keep[layer]
                if n == 0:
                    break
                _split_run(self.compiled(layer)[1], {f"hidden_{layer - 1}": state, "attention_mask": mask}, n,
                           {f"hidden_{layer}": spare})
                state, spare = spare, state  # what this layer gave is the next one's input
                if layer in index:
                    out[index[layer], :n] = state[:n]
        return torch.from_numpy(out)

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
              depths: Sequence[int]) -> Callable[[], torch.Tensor]:
        """:meth:`run` started in a thread of the stages' own, returning at once: the caller prepares and reduces
        other batches while OpenVINO computes this one (its infer calls release the GIL). Batches started one after
        another run in that order. Returns a callable that waits for the states."""
        if self._runner is None:
            self._runner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerwise-openvino-stages")
        future = self._runner.submit(self.run, input_ids, attention_mask, layers, depths)
        return future.result

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

__all__ = ["STAGE_FORMAT", "TIMING_ROUNDS", "TIMING_ROWS", "TIMING_TOKENS", "OpenVinoStages"]
