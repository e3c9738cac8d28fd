"""``auto``'s decisions, one per depth: what is known of each depth (which runtimes agreed with PyTorch there, the
runtime that serves it and why), the race once per model, and the runtime a store is pinned to.

:class:`Decisions` gathers the facts (builds and checks the compiled runtimes, times the race with
:mod:`~layerwise.model.backends.race`), asks :mod:`~layerwise.model.backends.policy` for the decision and records it. It
runs either on the caller's path (a named or pinned runtime, :meth:`Decisions.decide_now`) or as the Preparer's
``"runtime"`` job (:meth:`Decisions.background`), and never both for one key: both go through the
:class:`~layerwise.model.backends.preparer.Preparer`'s Future of ``(model, depth, purpose)``.

Its lock (``_lock``) owns ``_depths``, ``_race``, ``_pin`` and ``_gain``; it is never held while a runtime is built,
checked or timed, nor while a Future is waited for."""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Mapping, Sequence

import torch

from ...errors import ModelLoadError
from ...notices import notice
from ..capture import capture
from ..discovery import probe_batch
from . import offload, policy
from .offload import Stopped
from .ort import weights_bytes
from .policy import LABELS, Decision, pays_back
from .preparer import Preparer
from .race import Racer


@dataclass
class DepthState:
    """One depth's state (owned by :class:`Decisions`' lock): its decision, which runtimes agreed with PyTorch there,
    and whether rows of mixed depths were asked for up to it."""

    decision: Decision | None = None
    exact: dict[str, bool] = field(default_factory=dict)
    ragged_asked: bool = False
    busy: float = 0.0  # seconds PyTorch computed this depth for the caller while it was undecided


class Decisions:
    """The decisions of one model's depths (see the module docstring).

    Args:
        racer: the model's runtimes and their race (:class:`~layerwise.model.backends.race.Racer`). preparer: the
            background's owner. why_torch: why the compiled runtimes cannot serve (``None``: they can). on_decided:
            called with a depth once the background decided it.
    """

    def __init__(self, racer: Racer, preparer: Preparer, why_torch: Callable[[], str | None],
                 on_decided: Callable[[int], None]):
        self.racer, self.preparer, self.why_torch, self.on_decided = racer, preparer, why_torch, on_decided
        self.loaded, self.compiled, self.races = racer.loaded, racer.compiled, racer.races
        self._lock = threading.Lock()
        self._depths: dict[int, DepthState] = {}
        self._race: tuple[dict[str, float], bool] | None = None  # the race's seconds a batch, and whether recorded
        self._pin: str | None = None  # the runtime a store is computed with
        self._gain: float | None = None  # the speed-up expected of a compiled runtime here (policy.prior_gain)

    def _state(self, depth: int) -> DepthState:
        """``depth``'s state (the caller holds ``_lock``)."""
        return self._depths.setdefault(depth, DepthState())

    def clear(self) -> None:
        """Forget every decision and the race (the compiled runtimes were switched off)."""
        with self._lock:
            self._depths.clear()
            self._race = None

    def decided(self) -> dict[int, Decision]:
        """``{depth: decision}`` of the depths decided so far."""
        with self._lock:
            return {d: s.decision for d, s in self._depths.items() if s.decision is not None}

    def decision(self, depth: int) -> Decision | None:
        """``depth``'s decision, or ``None`` while it is undecided."""
        with self._lock:
            state = self._depths.get(depth)
            return state.decision if state is not None else None

    def pin(self) -> str | None:
        """The runtime calls are pinned to now (:meth:`pinned`), or ``None``."""
        with self._lock:
            return self._pin

    def race_times(self) -> dict[str, float]:
        """The race's seconds a batch per runtime (empty before the race)."""
        with self._lock:
            return dict(self._race[0]) if self._race is not None else {}

    def ragged_asked(self, depth: int) -> bool:
        """Whether rows of mixed depths were asked for up to ``depth``."""
        with self._lock:
            return self._state(depth).ragged_asked

    def ask_ragged(self, depth: int) -> None:
        """Rows of mixed depths were asked for up to ``depth`` (its one-layer graphs are built once it is decided)."""
        with self._lock:
            self._state(depth).ragged_asked = True

    @contextlib.contextmanager
    def pinned(self, runtime: str) -> Iterator[None]:
        """Within it, every block-site call runs on ``runtime`` (``"torch"``, ``"onnx"``, ``"openvino"``; else
        ``ModelLoadError``), prepared on the caller's path: a store's one runtime (extraction/runtime.py)."""
        if runtime not in LABELS:
            raise ModelLoadError(f"unknown runtime {runtime!r}. Valid runtimes are: {', '.join(LABELS)}")
        with self._lock:
            before, self._pin = self._pin, runtime
        try:
            yield
        finally:
            with self._lock:
                self._pin = before

    def exact(self, depth: int, runtime: str = "onnx") -> bool:
        """Whether ``runtime`` gives PyTorch's states for layers ``0..depth`` (built now if needed; checked once per
        runtime and depth, :func:`~layerwise.model.backends.policy.agrees`)."""
        backend = self.compiled().get(runtime)
        if backend is None:
            return False
        with self._lock:
            known = self._state(depth).exact.get(runtime)
        if known is None:
            ids, mask = probe_batch(self.loaded.tokenizer)
            layers = list(range(depth + 1))
            want = capture(self.loaded, ids, mask, layers)  # Shape: (layers, 2, tokens, hidden)
            known = policy.agrees(want, backend.forward(ids, mask, layers, "block"), mask.bool())
            with self._lock:
                self._state(depth).exact[runtime] = known
        return known

    def decide(self, depth: int, choice: str) -> Decision:
        """Build, check and (once per model) race the compiled runtimes for ``depth``, then decide and record."""
        with self._lock:
            race = self._race
        candidates = list(self.compiled())
        first = policy.winner(race[0]) if race is not None else None
        if choice == "fastest" and first is not None:
            candidates = [c for c in candidates if c == first]  # only the winner is built for a new depth
        elif choice != "fastest":
            candidates = [c for c in candidates if c == choice]
        exact: dict[str, bool] = {}
        for c in candidates if choice != "torch" and first != "torch" else ():
            self.racer.check_stopped()
            t0, waited = time.perf_counter(), offload.waited()
            exact[c] = self.exact(depth, c)  # built (in a child), opened and checked: the caller's share back after it
            self.racer.pace(time.perf_counter() - t0 - (offload.waited() - waited))
        if choice == "fastest" and race is None and any(exact.values()):
            race = self.racer.timed_race(depth, [c for c in exact if exact[c]])
            with self._lock:
                self._race = race
        if choice == "fastest" and first == "torch" and race is not None:
            decision = Decision("torch", policy.race_line(race[0], depth, race[1]))
        else:
            decision = policy.decide(depth, choice, candidates, exact, race=race[0] if race else None,
                                     known=bool(race and race[1]), bf16=self.loaded.dtype != torch.float32)
        with self._lock:
            if self.compiled() or decision.runtime == "torch":
                self._state(depth).decision = decision
        return decision

    def background(self, depth: int) -> Decision | None:
        """The ``"runtime"`` job of ``depth``: decide it; a failure leaves it on PyTorch, said (``None``: stopped)."""
        t0 = time.perf_counter()
        try:
            decision = self.decide(depth, "fastest")
        except Stopped:
            return None
        except Exception as exc:  # a runtime that fails to build is not a reason to fail the caller's job
            decision = Decision("torch", f"preparing the compiled runtimes failed: {type(exc).__name__}: {exc}")
            with self._lock:
                self._state(depth).decision = decision
        notice(f"{LABELS[decision.runtime]} serves layers 0..{depth} from the next call on ({decision.why}; "
               f"prepared in the background in {time.perf_counter() - t0:.1f} s while PyTorch served)")
        self.on_decided(depth)
        return decision

    def decide_now(self, depth: int, choice: str = "fastest") -> Decision:
        """Decide ``depth`` on the caller's path under ``choice`` (:data:`~layerwise.model.backends.policy.CHOICES`):
        the background's job if one is queued or running for it (waited for), else one run now; ``ModelLoadError``
        when the preparation was stopped (the process is exiting)."""
        with self._lock:
            decision = self._state(depth).decision
        if decision is not None and choice == "fastest":
            return decision
        purpose = "runtime" if choice == "fastest" else f"runtime-{choice}"
        job = (lambda: self.background(depth)) if choice == "fastest" else (lambda: self.decide(depth, choice))
        decision = self.preparer.submit((self.loaded.name, depth, purpose), job, background=False).result()
        if decision is None:
            raise ModelLoadError(f"the preparation of depth {depth} was stopped (the process is exiting)")
        return decision

    def serving(self, depth: int) -> str:
        """The runtime serving layers ``0..depth`` of the block site now (see the module docstring: under
        ``fastest`` PyTorch until the background decided it; a named or pinned runtime prepared now)."""
        if not self.compiled():
            return "torch"
        with self._lock:
            decision, pin = self._state(depth).decision, self._pin
        if pin is not None:
            return self.pinned_runtime(depth, pin)
        if decision is not None:
            return decision.runtime
        choice = policy.runtime_choice()
        if choice == "fastest":
            if self.worth_preparing(depth):
                self.prepare(depth)
            return "torch"
        return self.decide_now(depth, choice).runtime

    def prepare(self, depth: int) -> None:
        """Queue ``depth``'s ``"runtime"`` job on the Preparer (once; a server warming the depth asks at once), unless
        it is decided, pinned, or no compiled runtime can serve."""
        with self._lock:
            if self._state(depth).decision is not None or self._pin is not None:
                return
        if not self.compiled():
            return
        self.preparer.submit((self.loaded.name, depth, "runtime"), lambda: self.background(depth))

    def spent(self, depth: int, seconds: float) -> None:
        """The caller's pass at ``depth`` took ``seconds`` on PyTorch while the depth was undecided."""
        with self._lock:
            self._state(depth).busy += seconds
        if self.worth_preparing(depth):
            self.prepare(depth)

    def preparation_seconds(self, depth: int) -> float:
        """What preparing ``depth`` should cost here (:func:`~layerwise.model.backends.policy.preparation_seconds`)."""
        onnx = self.compiled().get("onnx")
        exported = getattr(onnx, "export_files", None)
        cached = exported is not None and all(p.exists() for p in exported(depth))
        share = (depth + 1) / (self.loaded.num_layers + 1)
        return policy.preparation_seconds(weights_bytes(self.loaded), share, cached)

    def worth_preparing(self, depth: int) -> bool:
        """Whether the caller's work at ``depth`` so far says preparing a compiled runtime pays back: a job is
        expected to run about as long again as it has (:func:`~layerwise.model.backends.policy.pays_back`, with the
        speed-up this machine's races show). A script's short job never starts a conversion."""
        with self._lock:
            busy, decided = self._state(depth).busy, self._state(depth).decision is not None
        if busy <= 0 or decided or self.preparer.future((self.loaded.name, depth, "runtime")) is not None:
            return False
        gain = self.gain()
        if not pays_back(busy, gain, policy.PREPARE_CACHED_S):  # not even the cheapest preparation: no need to look
            return False  # for the graph (its path digests the weights)
        return pays_back(busy, gain, self.preparation_seconds(depth))

    def gain(self) -> float:
        """The speed-up over PyTorch this machine's races say a compiled runtime gives
        (:func:`~layerwise.model.backends.policy.prior_gain`; ``races.json`` read once)."""
        with self._lock:
            known = self._gain
        if known is None:
            known = policy.prior_gain(self.races.read() if self.races is not None else {})
            with self._lock:
                self._gain = known
        return known

    def pinned_runtime(self, depth: int, runtime: str) -> str:
        """``runtime`` for ``depth`` (a pinned store's), built and checked now; refused, saying what to run, where it
        is not installed or not exact there."""
        if runtime == "torch":
            return "torch"
        if runtime not in self.compiled():
            why = self.why_torch()
            raise ModelLoadError(f"this store is computed by {LABELS[runtime]}, which cannot run here ("
                                 f"{'ONNX Runtime ' + why if why else 'not installed'}): "
                                 f"install it (pip install 'layerwise[openvino]' for OpenVINO) to resume, or pass "
                                 f"--overwrite to recompute the store with the runtimes here")
        key = (self.loaded.name, depth, f"exact-{runtime}")
        if not self.preparer.submit(key, lambda: self.exact(depth, runtime), background=False).result():
            raise ModelLoadError(f"{LABELS[runtime]} is not within {policy.EXACT} of PyTorch at depth {depth} here, "
                                 f"and this store is computed by it: pass --overwrite to recompute it, or "
                                 f"--backend torch into another directory")
        return runtime

    def describe(self, named: Mapping[str, str], pending: Sequence[int]) -> str:
        """Which runtime serves which depth and why (``named``: each runtime with its version; ``pending``: the depths
        being prepared), e.g. ``"openvino 2026.4.1 for the block site at depths [6] (exact; ...); torch for other
        sites"``."""
        decided, pin = self.decided(), self.pin()
        parts = [f"{named[dec.runtime]} {'for the block site ' if dec.runtime != 'torch' else ''}at depths [{d}] "
                 f"({dec.why})" for name in ("openvino", "onnx", "torch")
                 for d, dec in sorted(decided.items()) if dec.runtime == name]
        parts += [f"torch at depths [{d}] (while the compiled runtimes are prepared in the background)"
                  for d in pending if d not in decided]
        if pin is not None:
            parts.insert(0, f"{named[pin]} for the block site at every depth (pinned: a store computed by it)")
        candidates = " or ".join(named[n] for n in (*self.compiled(), "torch"))
        return "; ".join(parts or [f"{candidates} for the block site (decided at first use of each depth)"]) \
            + "; torch for other sites"


__all__ = ["DepthState", "Decisions"]
