"""``backend="auto"`` (the default): the fastest runtime that gives the exact states on this machine, chosen once per
depth and kept for every batch of a call.

The block site of a family-table encoder in float32 on the CPU has up to three candidates: ONNX Runtime, OpenVINO
(the ``[openvino]`` extra) and PyTorch. Each compiled runtime must agree with PyTorch on a probe batch, and the exact
ones race PyTorch once per model and machine (:mod:`~layerwise.model.backends.policy` decides,
:mod:`~layerwise.model.backends.race` times). Every other site, device, dtype or architecture runs on PyTorch.

:class:`AutoBackend` is a router: it composes a :class:`~layerwise.model.backends.pytorch.TorchBackend` and the
compiled runtimes, and delegates each call to one of them (vLLM's executor: the implementation is chosen once and
called by delegation). :meth:`AutoBackend.plan` makes one :class:`~layerwise.model.backends.base.Plan` per call, which
its batches (``ahead``, ``start``, ``ragged_price``, ``start_ragged``) all use: a depth decided in the middle of a call
serves from the next call on. How a depth moves:

1. **asked** (:meth:`plan`): under ``$LAYERWISE_AUTO_RUNTIME=fastest`` (the default) PyTorch serves it at once; a
   ``"runtime"`` job is queued on the :class:`~layerwise.model.backends.preparer.Preparer` once the caller's work at
   the depth says it pays back (:meth:`Decisions.worth_preparing
   <layerwise.model.backends.decisions.Decisions.worth_preparing>`), or when a server warms it; a named runtime, or
   one a store is pinned to, is prepared on the caller's path;
2. **prepared** (the job, in the background at a quiet moment, its export and conversion in a child process):
   built, checked against PyTorch, raced once per model (``races.json`` keeps the race for later processes);
3. **decided**: the :class:`~layerwise.model.backends.policy.Decision` is recorded, a ``layerwise:`` line says it, and
   the next call's plan takes it. Where mixed depths were asked for, ``"stages-<runtime>"`` jobs build the one-layer
   graphs of each compiled runtime, ONNX Runtime's first (:mod:`~layerwise.model.backends.stages`).

Rows of mixed depths: each prepared chain of one-layer graphs is priced against the serving graph (the serving
runtime's at its measured price, the other's at its own price times its graph's race time over the serving graph's),
and the plan runs them on the cheapest, said once in a ``layerwise:`` line; the others stay on offer
(:meth:`Plan.ragged_prices <layerwise.model.backends.base.Plan.ragged_prices>`, :meth:`Plan.chain
<layerwise.model.backends.base.Plan.chain>`). Why both runtimes: which chain is cheaper is a fact of the machine and
of the shapes. On a 2-core AVX-512 EPYC (2026-11-28) OpenVINO's chain was the cheaper of the two on repeated batches
(856 against 929 ms for eleven batches of 44 SST-2 sentences at depths 1..6) and the dearer by far in the server,
whose batches rarely repeat a shape: every mixed call on OpenVINO's chain gave 0.95-1.06x the all-last throughput,
on ONNX Runtime's 1.22-1.33x (best of 3-5 rounds, 32 and 64 clients). Timed on a new shape per batch (as
:meth:`Stages.prepare <layerwise.model.backends.stages.Stages.prepare>` now does), OpenVINO's chain costs 1.43-1.48x
its graph and ONNX Runtime's 1.00-1.03x.

Who owns what: the router's ``_lock`` owns the compiled runtimes' switch (:meth:`torch_only`); the
:class:`~layerwise.model.backends.decisions.Decisions` own each depth's state, the race and the pin (their lock); the
Preparer owns its Futures, the Activity the caller's passes. No lock is held while another is taken, while a job runs
or while a Future is waited for, so there is no lock order to keep.

``quantize`` (:mod:`~layerwise.model.backends.quantized`) and bf16 are explicit options, never chosen here."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Sequence

import torch

from ...errors import ModelLoadError
from ...notices import notice
from ..loaded import LoadedModel
from ..options import ModelOptions
from . import policy
from .base import Backend, Plan
from .decisions import Decisions
from .openvino import openvino_version
from .ort import check_quantize
from .policy import RaceRecord, versions
from .preparer import Counted, Preparer
from .pytorch import TorchBackend
from .quantized import Int8Timing
from .race import Racer
from .stages import Staged


class AutoBackend(Backend):
    """The fastest exact runtime per depth for the block site, PyTorch elsewhere (see the module docstring).

    Args:
        loaded: the model.
        padding_side: as for :class:`~layerwise.model.backends.pytorch.TorchBackend` (``"left"`` runs PyTorch).
        cache: directory for exported graphs and ``races.json`` (see :func:`layerwise.model.backends.ort.cache_dir`).
        quantize: ``None``, ``"int8"`` or ``"int8-full"`` (block site only).
        calibration: ``quantize="int8-full"``: a text file to calibrate on (``None``: the bundled sample).
    """

    name = "auto"
    sites = TorchBackend.sites
    accepts = TorchBackend.accepts | {"quantize", "quantize_calibration", "onnx_cache"}

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "AutoBackend":
        """``AutoBackend(loaded, padding_side, cache=options.onnx_cache, quantize=options.quantize,
        calibration=options.quantize_calibration)``."""
        return cls(loaded, options.padding_side, cache=options.onnx_cache, quantize=options.quantize,
                   calibration=options.quantize_calibration)

    def __init__(self, loaded: LoadedModel, padding_side: str = "right", cache: Any = None,
                 quantize: str | None = None, calibration: str | None = None):
        super().__init__(loaded)
        self.torch = TorchBackend(loaded, padding_side)
        self.padding_side = padding_side
        self.quantize = check_quantize(quantize)
        self.onnx, self.openvino, self.why_torch = policy.candidates(loaded, padding_side, cache, self.quantize,
                                                                     calibration)
        first = self.onnx or self.openvino
        self.races = RaceRecord(first.root) if first is not None else None
        self.preparer = Preparer("layerwise-auto")
        self.int8 = Int8Timing(self) if self.quantize else None
        self._lock = threading.Lock()  # owns the switch of the compiled runtimes (onnx, openvino, why_torch)
        self._chain_said: dict[str, str] = {}  # serving runtime -> the chain last said to run its mixed rows
        self.racer = Racer(loaded, self.torch, lambda: self.compiled_runtimes, self.races, self.preparer.activity,
                           self.preparer.stopping, self.fingerprint, versions)
        self.decisions = Decisions(self.racer, self.preparer, lambda: self.why_torch, self._queue_stages_if_asked)

    # ---- facts -----------------------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        """The weights' sha256 (computed once, shared with the exporter)."""
        first = self.onnx or self.openvino
        return first.fingerprint() if first is not None else self.torch.fingerprint()

    @property
    def compiled_runtimes(self) -> dict[str, Backend]:
        """The runtimes other than PyTorch that can serve the block site here: ``{"onnx": ..., "openvino": ...}``."""
        with self._lock:
            return {n: rt for n, rt in (("onnx", self.onnx), ("openvino", self.openvino)) if rt is not None}

    @property
    def fidelity(self) -> dict[int, dict]:
        """The measured fidelity to float32 per depth of the reduced-precision runtime serving it."""
        out: dict[int, dict] = {}
        for runtime in self.compiled_runtimes.values():
            out.update(getattr(runtime, "fidelity", {}))
        return out

    @property
    def int8_timing(self) -> dict[str, Any] | None:
        """``quantize``: the int8 runtimes timed against float32 here, once done (else ``None``)."""
        return self.int8.result() if self.int8 is not None else None

    @property
    def model_sites(self) -> tuple[str, ...]:
        """Every site PyTorch records; only ``block`` when quantised."""
        return ("block",) if self.quantize else self.torch.model_sites

    @property
    def precision(self) -> str:
        """When quantised, the recipe's (``"int8-weights"`` on OpenVINO, ``"int8"`` on ONNX Runtime), else the
        dtype."""
        quantized = self.openvino or self.onnx
        return quantized.precision if self.quantize and quantized is not None else self.torch.precision

    # ---- switching off, pinning ---------------------------------------------------------------------------
    def torch_only(self, reason: str) -> None:
        """Run PyTorch from now on (e.g. the weights are about to change: an exported graph would be stale).

        Raises:
            ModelLoadError: when quantised (int8 exists only in the compiled runtimes).
        """
        if self.quantize:
            raise ModelLoadError(f"quantize={self.quantize!r} runs on OpenVINO or ONNX Runtime only; it cannot "
                                 f"switch to PyTorch ({reason})")
        self.preparer.stop()
        with self._lock:
            self.onnx, self.openvino, self.why_torch = None, None, f"is off: {reason}"
        self.decisions.clear()

    def pinned(self, runtime: str) -> contextlib.AbstractContextManager[None]:
        """:meth:`Decisions.pinned <layerwise.model.backends.decisions.Decisions.pinned>`: every call for the block
        site on ``runtime`` within it (a store's)."""
        return self.decisions.pinned(runtime)

    def serving(self, depth: int) -> str:
        """The runtime serving layers ``0..depth`` of the block site now: under ``fastest`` PyTorch until the
        background decided it; a named or pinned runtime prepared now; a quantised model's int8 runtime."""
        if self.int8 is not None and self.compiled_runtimes:  # quantised: int8 exists on its runtime only
            self.int8.queue(depth)
            return "openvino" if self.openvino is not None else "onnx"
        return self.decisions.serving(depth)

    # ---- the plan of a call -------------------------------------------------------------------------------
    def runtime_name(self, layers: Sequence[int], site: str) -> str:
        """:meth:`Backend.runtime_name`: ``"torch"``, ``"onnx"`` or ``"openvino"``."""
        return self.runtime_for(layers, site)

    def runtime_for(self, layers: Sequence[int], site: str) -> str:
        """Which runtime a call for ``layers`` at ``site`` runs on now: ``"onnx"``, ``"openvino"`` or ``"torch"``
        (always PyTorch for layers streamed block by block under ``max_memory``: an export needs every block)."""
        self.preparer.activity.touch()
        if site != "block" or self.loaded.streams(max(layers)):
            return "torch"
        return self.serving(max(max(layers), 1))

    def staged(self, depth: int, site: str = "block") -> Staged | None:
        """The compiled runtime serving ``depth`` at ``site`` where it can run one-layer stages, else ``None``."""
        return self._staged_on(self.runtime_for((depth,), site))
    def _staged_on(self, runtime: str) -> Staged | None:
        backend = self.compiled_runtimes.get(runtime)
        return backend if isinstance(backend, Staged) and not self.quantize else None

    def _queue_stages_if_asked(self, depth: int) -> None:
        """Once ``depth`` is decided: its one-layer graphs where rows of mixed depths were asked for up to it."""
        if self.decisions.ragged_asked(depth):
            self._queue_stages(depth)

    def _queue_stages(self, depth: int) -> None:
        """Queue the one-layer graphs up to ``depth`` of every compiled runtime that has them, once the depth is
        decided for one of them (once per depth and runtime): :meth:`plan` offers each chain, priced against the
        serving graph, and the caller measures which runs its mixed calls faster."""
        decision = self.decisions.decision(depth)
        serving = decision.runtime if decision is not None else "torch"
        if serving == "torch":
            return
        # ONNX Runtime's first: its one-layer graphs open in seconds, and OpenVINO's are compiled from them (about
        # 10 s for six layers of MiniLM on 2 cores, from an empty cache), so a mixed load has a chain soonest
        for name in sorted(self.compiled_runtimes, key=lambda name: name != "onnx"):
            staged = self._staged_on(name)
            if staged is not None and not staged.stages.prepared(depth):
                job = lambda staged=staged: staged.prepare_ragged(depth, alone=self.preparer.activity.alone)  # noqa: E731
                self.preparer.submit((self.loaded.name, depth, f"stages-{name}"), job)

    def _say_chain(self, use: str, best: str, prices: dict[str, float]) -> None:
        """A ``layerwise:`` line when the chain that runs the rows of mixed depths is first chosen or changes."""
        if self._chain_said.get(use) == best:
            return
        self._chain_said[use] = best

        def label(name: str) -> str:  # the runtime's name in messages, as its stages give it
            staged = self._staged_on(name)
            return staged.stages.label if staged is not None else name

        others = "; ".join(f"{label(n)}'s {p:.2f}x" for n, p in prices.items() if n != best)
        notice(f"rows of mixed depths leave their batch at their own depth on {label(best)}'s one-layer graphs while "
               f"{label(use)} serves: a token-layer there costs {prices[best]:.2f}x {label(use)}'s graph"
               + (f" ({others})" if others else ""))

    def _chains(self, use: str) -> dict[str, tuple[Backend, Callable[[int, str], float | None]]]:
        """The other compiled runtimes' chains of one-layer graphs, each priced against ``use``'s graph: its own
        price (chain over its graph) times its graph's race time over ``use``'s (none where either is unknown)."""
        times = self.decisions.race_times()
        chains: dict[str, tuple[Backend, Callable[[int, str], float | None]]] = {}
        if times.get(use, 0.0) <= 0.0:
            return chains
        for name in self.compiled_runtimes:
            staged = self._staged_on(name)
            if name == use or staged is None or times.get(name, 0.0) <= 0.0:
                continue
            ratio = times[name] / times[use]

            def price(depth: int, site: str, staged: Staged = staged, ratio: float = ratio) -> float | None:
                own = staged.ragged_price(depth, site)
                return None if own is None else own * ratio

            chains[name] = (staged, price)  # type: ignore[assignment]
        return chains

    def plan(self, layers: Sequence[int], site: str) -> Plan:
        """:meth:`Backend.plan`: the runtime serving ``layers`` at ``site`` now, for every batch of the call; rows of
        mixed depths on that runtime's one-layer graphs where prepared, else on PyTorch at the measured price."""
        use = self.runtime_for(layers, site)
        backend = self.compiled_runtimes.get(use, self.torch)
        depth = max(max(layers), 1)
        staged = self._staged_on(use)
        offers: dict[str, tuple[Backend, Callable[[int, str], float | None], float]] = {}
        own = staged.ragged_price(depth, site) if staged is not None and staged.stages.prepared(depth) else None
        if staged is not None and own is not None:
            offers[use] = (staged, staged.ragged_price, own)  # type: ignore[assignment]
        for name, (chain, price_of) in (self._chains(use) if use != "torch" else {}).items():
            value = price_of(depth, site)
            if value is not None:
                offers[name] = (chain, price_of, value)
        if offers:  # the cheapest chain runs the rows of mixed depths; the others stay on offer (Plan.chain)
            best = min(offers, key=lambda name: (offers[name][2], name != use))
            self._say_chain(use, best, {name: value for name, (_, _, value) in offers.items()})
            chain, price_of, _ = offers[best]
            return Counted(self.preparer.activity, use, backend, ragged=chain, price=price_of, ragged_runtime=best,
                           chains={name: (o[0], o[1]) for name, o in offers.items() if name != best})
        if staged is not None and staged.stages.prepared(depth):  # prepared, but the model is not run in stages
            return Counted(self.preparer.activity, use, backend, ragged=staged)

        def price(depth: int, site: str) -> float | None:
            self.decisions.ask_ragged(depth)
            if staged is not None:
                self._queue_stages(depth)
            if not self.torch.can_leave_early(depth, site):
                return None
            if use == "torch":
                return 1.0
            times = self.decisions.race_times()
            if times.get(use, 0.0) <= 0.0 or "torch" not in times:
                return None
            return times["torch"] / times[use]

        undecided = use == "torch" and site == "block" and self.decisions.decision(depth) is None
        spent = (lambda seconds: self.decisions.spent(depth, seconds)) if undecided else None
        return Counted(self.preparer.activity, use, backend, ragged=self.torch, price=price, spent=spent,
                       ragged_runtime="torch")

    # ---- the Backend interface, each call through its plan ------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
                site: str) -> torch.Tensor:
        """``[K, batch, tokens, width]`` (see :meth:`Backend.forward`) on the runtime :meth:`plan` picks."""
        return self.plan(layers, site).start(input_ids, attention_mask, layers, site)()

    def start(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int],
              site: str) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start` on the runtime :meth:`plan` picks."""
        return self.plan(layers, site).start(input_ids, attention_mask, layers, site)

    def ragged_price(self, depth: int, site: str) -> float | None:
        """:meth:`Backend.ragged_price` of the plan for ``depth`` (the first ask queues the one-layer graphs)."""
        return self.plan((depth,), site).ragged_price(depth, site)

    def start_ragged(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str,
                     depths: Sequence[int]) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start_ragged` on the plan's ragged runtime."""
        return self.plan(layers, site).start_ragged(input_ids, attention_mask, layers, site, depths)

    def ahead(self, layers: Sequence[int], site: str) -> int:
        """:meth:`Backend.ahead` of the runtime serving ``layers`` at ``site``."""
        return self.plan(layers, site).ahead(layers, site)

    def batch_tokens_cap(self, layers: Sequence[int], site: str) -> int | None:
        """:meth:`Backend.batch_tokens_cap` of PyTorch (streamed layers always run there)."""
        return self.torch.batch_tokens_cap(layers, site)

    # ---- background work ----------------------------------------------------------------------------------
    def warm(self, layers: Sequence[int], site: str = "block") -> None:
        """Load the blocks ``layers`` need and decide their runtime (``fastest``: queued now, as a server that warms
        a depth will serve it long, :meth:`pending` lists it until done; a named runtime: now)."""
        self.torch.warm(layers, site)
        if self.runtime_for(layers, site) == "torch" and site == "block" and not self.quantize and \
                not self.loaded.streams(max(layers)) and policy.runtime_choice() == "fastest":
            self.decisions.prepare(max(max(layers), 1))

    def pending(self) -> list[int]:
        """The depths whose runtime or one-layer graphs are being prepared in the background."""
        jobs = self.preparer.pending()
        return list(dict.fromkeys(key[1] for key in jobs if str(key[2]).startswith(("runtime", "stages"))))

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every background job is done (``timeout`` seconds at most); ``True`` when none is left."""
        return self.preparer.settle(timeout)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background work after the step it is in (the depths not decided stay on PyTorch)."""
        self.preparer.stop(timeout)

    @property
    def prepared(self) -> dict[int, float]:
        """Seconds each depth's background preparation took (``{depth: s}``)."""
        return {key[1]: s for key, s in dict(self.preparer.seconds).items() if key[2] == "runtime"}

    def runtime(self) -> str:
        """Which runtime serves what so far, and why: e.g. ``"openvino 2026.4.1 for the block site at depths [6]
        (exact; fastest here: ...); torch for other sites"``."""
        if not self.compiled_runtimes:
            return f"torch (ONNX Runtime {self.why_torch})"
        bf16 = " bf16" if self.loaded.dtype == torch.bfloat16 else ""
        named = {**{k: v + bf16 for k, v in versions().items()}, "torch": f"torch{bf16}"}
        if self.quantize:
            if self.openvino is not None:
                what = "int8 weights and activations" if self.quantize == "int8-full" else "int8 weights"
                return f"{named['openvino']} with {what} (nncf {openvino_version('nncf')}) for the block site"
            return f"{named['onnx']} ({self.quantize}, dynamic) for the block site"
        return self.decisions.describe(named, self.pending())


__all__ = ["AutoBackend"]
