"""Which runtime computes a store: decided before its first record, named in its manifest and in each shard, and
kept from its first record to its last (a resume continues on it).

Runtimes differ in the last bits (PyTorch, ONNX Runtime and OpenVINO by up to 2e-6 on the default model), so a store
whose shards came from two of them would not equal either's uninterrupted run. Under ``backend="auto"``
:func:`store_runtime` decides once, in this order:

1. a resume: the runtime the store records (its graph rebuilt first where the cache lost it; refused, saying what to
   run, where it cannot run here);
2. ``$LAYERWISE_AUTO_RUNTIME`` naming a runtime: that one where it is exact;
3. the race recorded for this model on this machine (``races.json``): its winner where it is exact;
4. otherwise PyTorch, unless the corpus is large enough that waiting for the preparation (export, check, race) pays
   back (:func:`~layerwise.model.backends.policy.pays_back`): PyTorch's rate is measured on the model (one batch of
   1,024 tokens at the store's depth), the tokens per record on the first records, the gain and the preparation's
   cost from what this machine recorded.

One ``layerwise:`` line says the choice and why. Another backend (``torch``, ``onnx``, ...) is its own runtime; a
resume with another one than the store records is refused, naming both.

Example::

    >>> choice = store_runtime(ex, spec, records=20_000, tokens_per_record=30.0)   # doctest: +SKIP
    >>> choice["name"], choice["why"][:40]                                        # doctest: +SKIP
    ('torch', 'PyTorch: 20,000 records (about 41 s on P')
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import torch

from ..encoding.spec import EncodeSpec
from ..errors import ExtractError, ModelLoadError
from ..extractor import Extractor
from ..model.backends import policy
from ..model.backends.policy import LABELS, Decision, versions
from ..model.backends.race import race_batches
from ..model.backends.router import AutoBackend
from ..notices import notice


def recorded_runtime(manifest: dict[str, Any] | None) -> str | None:
    """The runtime a store's manifest names (``None``: none recorded, a store of an older layerwise)."""
    runtime = (manifest or {}).get("runtime")
    return runtime.get("name") if isinstance(runtime, dict) else None


def torch_seconds_per_token(ex: Extractor, depth: int) -> float:
    """PyTorch's seconds per token through layers ``0..depth``, timed on one race batch (1,024 tokens; best of 2)."""
    ids = race_batches(ex.loaded)[1]
    layers = list(range(depth + 1))
    backend = ex.backend.torch if isinstance(ex.backend, AutoBackend) else ex.backend
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        backend.forward(ids, torch.ones_like(ids), layers, "block")
        best = min(best, time.perf_counter() - t0)
    return best / ids.numel()


def _auto(ex: Extractor, backend: AutoBackend, spec: EncodeSpec, count: Callable[[], int | None] | int | None,
          tokens_per_record: float) -> Decision:
    depth = max(max(spec.layer_indices), 1)
    if spec.site != "block" or not backend.compiled_runtimes or backend.loaded.streams(depth):
        return Decision("torch", "the compiled runtimes serve the block site of a model held whole only"
                        if backend.compiled_runtimes else f"ONNX Runtime {backend.why_torch}")
    if backend.quantize:  # int8 exists on one runtime only: the one that serves it
        served = backend.serving(depth)
        return Decision(served, f"quantize={backend.quantize!r} runs on {LABELS[served]} here")
    choice = policy.runtime_choice()
    if choice != "fastest":
        return backend.decisions.decide_now(depth, choice)
    race = backend.racer.recorded()
    if race is not None:
        won = str(policy.winner(race))
        if won == "torch" or backend.decisions.exact(depth, won):
            return Decision(won, f"{policy.race_line(race, depth, True)}")
        return Decision("torch", f"{LABELS[won]} won the race here but is not exact at depth {depth}")
    records = count() if callable(count) else count  # (counted only here: no scan of a corpus when a race decides)
    if not records:
        return Decision("torch", "no race recorded for this model here, and the corpus size is unknown (stdin)")
    per_token = torch_seconds_per_token(ex, depth)
    alone = records * tokens_per_record * per_token
    gain, prepare = backend.decisions.gain(), backend.decisions.preparation_seconds(depth)
    said = (f"{records:,} records of about {tokens_per_record:.0f} tokens take about {alone:.0f} s on PyTorch; a "
            f"compiled runtime {gain:.2f}x faster would save {alone * (1 - 1 / gain):.0f} s after about "
            f"{prepare:.0f} s of preparation")
    if not policy.pays_back(alone, gain, prepare):
        return Decision("torch", f"{said}: not worth the wait (set LAYERWISE_AUTO_RUNTIME to choose)")
    decision = backend.decisions.decide_now(depth, "fastest")
    return Decision(decision.runtime, f"{said}: prepared first; {decision.why}")


def store_runtime(ex: Extractor, spec: EncodeSpec, *, recorded: str | None = None,
                  records: Callable[[], int | None] | int | None = None,
                  tokens_per_record: float = 32.0) -> dict[str, str]:
    """The runtime that computes a store of ``spec`` (resolved) with ``ex``: ``{"name", "label", "why"}``, said in
    one ``layerwise:`` line (see the module docstring).

    Args:
        recorded: the runtime the store being resumed names (:func:`recorded_runtime`).
        records: how many records the run will encode (``None``: unknown), or a function that counts them (called
            only where the choice depends on it).
        tokens_per_record: their mean length in tokens (measured on the first records).

    Raises:
        ExtractError: a resume with another backend than the one the store records, or a recorded runtime that cannot
            run here (what to run is said).
    """
    backend = ex.backend
    if isinstance(backend, AutoBackend):
        try:
            if recorded is not None:
                decision = Decision(recorded, "the runtime this store was started with (a resume continues on it)")
                with backend.pinned(recorded):
                    backend.runtime_name(spec.layer_indices, spec.site)  # its graph rebuilt now if the cache lost it
            else:
                decision = _auto(ex, backend, spec, records, tokens_per_record)
        except ModelLoadError as exc:
            raise ExtractError(str(exc)) from exc
    else:
        name = backend.runtime_name(spec.layer_indices, spec.site)
        if recorded is not None and recorded != name and not (recorded in LABELS and name == "auto"):
            raise ExtractError(f"this store was computed by {recorded!r}, and this run would compute with {name!r}: "
                               f"resume with --backend {recorded} (or auto), or pass --overwrite to recompute it")
        decision = Decision(name, f"backend={name!r}")
    label = versions().get(decision.runtime, decision.runtime) if decision.runtime in LABELS else decision.runtime
    notice(f"{LABELS.get(decision.runtime, decision.runtime)} computes this store ({decision.why})")
    return {"name": decision.runtime, "label": label, "why": decision.why}


@contextlib.contextmanager
def pinned(ex: Extractor, runtime: dict[str, Any] | None) -> Iterator[None]:
    """Within it, ``ex`` computes with the store's ``runtime`` (:func:`store_runtime`'s) at every call."""
    name = (runtime or {}).get("name")
    if isinstance(ex.backend, AutoBackend) and name in LABELS:
        with ex.backend.pinned(str(name)):
            yield
    else:
        yield


__all__ = ["pinned", "recorded_runtime", "store_runtime", "torch_seconds_per_token"]
