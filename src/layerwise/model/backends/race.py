"""Timing runtimes against each other: the race ``auto`` runs once per model and machine, and the int8 runtimes'
timing against float32. Each contestant runs the batches of :data:`~layerwise.model.backends.policy.RACE_SHAPES`
(one token budget, the shapes length-sorted batches take) through layers ``0..depth``, started the way the pipeline
starts them (up to :meth:`~layerwise.model.backends.base.Backend.ahead` at once, so an asynchronous runtime is timed
with its overlap), after one warm-up run each, alternating, best of
:data:`~layerwise.model.backends.policy.RACE_ROUNDS`. One repeated shape would favour a runtime that caches per shape
(PyTorch bf16 won a 16x64 race by 15% on an AMX Xeon and then ran SST-2 30% slower than OpenVINO's bf16).

No threads of its own; the caller holds the machine (:meth:`~layerwise.model.backends.preparer.Activity.alone`).

Example::

    >>> times = timed(loaded, 2, {"torch": torch_backend, "onnx": onnx_backend})   # doctest: +SKIP
    >>> sorted(times)                                                              # doctest: +SKIP
    ['onnx', 'torch']
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, ContextManager, Mapping, Sequence

import torch

from ..hardware import cpu_model
from ..loaded import LoadedModel
from .base import Backend
from .offload import Stopped
from .policy import RACE_ROUNDS, RACE_SHAPES, RaceRecord
from .preparer import Activity


def race_batches(loaded: LoadedModel) -> list[torch.Tensor]:
    """The batches a race times: one of each of :data:`RACE_SHAPES` (``[texts, tokens]`` token ids, seeded), rows
    shortened to the model's positions (the same token budget in more, shorter rows)."""
    vocab = int(getattr(loaded.model.config, "vocab_size", 1000))
    seeded = torch.Generator().manual_seed(0)
    longest = loaded.max_length
    shapes = [(n * t // min(t, longest), min(t, longest)) for n, t in RACE_SHAPES]
    return [torch.randint(min(1000, vocab - 1), vocab, shape, generator=seeded) for shape in shapes]


def timed(loaded: LoadedModel, depth: int, contestants: Mapping[str, Backend],
          stop: Callable[[], Any] = lambda: None, hold: Callable[[], ContextManager[Any]] = contextlib.nullcontext,
          pace: Callable[[float], Any] = lambda seconds: None) -> dict[str, float]:
    """Seconds per batch of each of ``contestants`` through layers ``0..depth`` on :func:`race_batches` (best of
    :data:`RACE_ROUNDS`, alternating, after a warm-up each). ``stop`` is called between runs (it raises to stop);
    each run is made within ``hold()`` (the machine to itself) and followed by ``pace(its seconds)``."""
    batches = race_batches(loaded)
    layers = list(range(depth + 1))

    def runs(backend: Backend) -> None:
        ahead = max(1, backend.ahead(layers, "block"))
        started: list[Callable[[], torch.Tensor]] = []
        for ids in batches:
            if len(started) >= ahead:
                started.pop(0)()
            started.append(backend.start(ids, torch.ones_like(ids), layers, "block"))
        for done in started:
            done()

    def run(backend: Backend) -> float:
        stop()
        with hold():
            t0 = time.perf_counter()
            runs(backend)
            seconds = time.perf_counter() - t0
        pace(seconds)
        return seconds

    best = {name: float("inf") for name in contestants}
    for backend in contestants.values():
        run(backend)  # warm-up: first-call allocations
    for _ in range(RACE_ROUNDS):
        for name, backend in contestants.items():
            best[name] = min(best[name], run(backend) / len(batches))
    return best


class Racer:
    """A model's runtimes and their race, once per model and machine: timed now (with the machine to itself) or read
    from ``races.json``.

    Args:
        loaded: the model. torch_backend: its PyTorch backend. compiled: the compiled runtimes available now
        (``{"onnx": ..., "openvino": ...}``). races: ``races.json`` (``None``: no cache). activity: the caller's passes
        (held off while timing). stopping: set when the process exits (a timing stops between runs). fingerprint: the
        weights' digest. versions: each runtime's version.
    """

    def __init__(self, loaded: LoadedModel, torch_backend: Backend, compiled: Callable[[], dict[str, Backend]],
                 races: RaceRecord | None, activity: Activity, stopping: threading.Event,
                 fingerprint: Callable[[], str], versions: Callable[[], Mapping[str, str]]):
        self.loaded, self.torch, self.compiled, self.races = loaded, torch_backend, compiled, races
        self.activity, self.stopping, self.fingerprint, self.versions = activity, stopping, fingerprint, versions

    def check_stopped(self) -> None:
        """Between two steps of the background work: raises :class:`~layerwise.model.backends.offload.Stopped` once
        the process is exiting."""
        if self.stopping.is_set():
            raise Stopped

    def race(self, depth: int, runtimes: Sequence[str] = ("onnx", "openvino")) -> dict[str, float]:
        """Seconds per batch of PyTorch and each of ``runtimes`` available, through layers ``0..depth``, with the
        machine to each of its runs (:func:`timed`, paced): ``{"torch": s, "onnx": s, ...}``."""
        contestants: dict[str, Backend] = {"torch": self.torch}
        contestants.update({n: b for n, b in self.compiled().items() if n in runtimes})
        return timed(self.loaded, depth, contestants, self.check_stopped, self.activity.alone, self.pace)

    def pace(self, seconds: float) -> None:
        """After a background step of ``seconds``: the caller's share back (:meth:`Activity.pace
        <layerwise.model.backends.preparer.Activity.pace>`)."""
        self.activity.pace(seconds, self.stopping)

    def key(self, runtimes: Sequence[str]) -> str:
        """The ``races.json`` key of a race of ``runtimes`` of this model on this machine."""
        return RaceRecord.key(self.fingerprint(), torch.get_num_threads(), runtimes, cpu_model(), self.versions())

    def recorded(self) -> dict[str, float] | None:
        """The race of every compiled runtime here against PyTorch, from ``races.json`` (``None``: not run here)."""
        names = ["torch", *self.compiled()]
        known = self.races.get(self.key(names)) if self.races is not None and len(names) > 1 else None
        return known if known is not None and set(known) == set(names) else None

    def timed_race(self, depth: int, exact: Sequence[str]) -> tuple[dict[str, float], bool]:
        """The race of PyTorch and the ``exact`` runtimes at ``depth``: from ``races.json`` where this machine ran it
        (``True``), else run now and recorded (``False``)."""
        names = ["torch", *exact]
        known = self.races.get(self.key(names)) if self.races is not None else None
        if known is not None and set(known) == set(names):
            return known, True
        times = self.race(depth, list(exact))
        if self.races is not None:
            self.races.put(self.key(names), times)
        return times, False


def int8_report(depth: int, quantize: str, times: Mapping[str, float]) -> dict[str, Any]:
    """What :func:`timed` found of the int8 runtimes (names starting ``"int8"``) against float32 (``"float32 ..."``):
    ``{"depth", "ms_per_batch", "slower"}`` and, when every int8 runtime is slower than the fastest float32 one,
    ``"said"``: the line that says so, naming the faster exact path."""
    int8 = {n: t for n, t in times.items() if n.startswith("int8")}
    exact = {n: t for n, t in times.items() if n.startswith("float32")}
    fastest = min(exact, key=lambda n: exact[n])
    slower = min(int8.values()) > exact[fastest]
    out: dict[str, Any] = {"depth": depth, "ms_per_batch": {n: round(t * 1e3, 2) for n, t in times.items()},
                           "slower": slower}
    if slower:
        listed = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in int8.items())
        out["said"] = (f"quantize={quantize!r} is slower than float32 on this CPU ({cpu_model()}): {listed} against "
                       f"{fastest} {exact[fastest] * 1e3:.1f} ms a batch; drop quantize for the faster, exact path "
                       f"(backend='auto' serves float32 with the fastest runtime here)")
    return out


__all__ = ["Racer", "int8_report", "race_batches", "timed"]
