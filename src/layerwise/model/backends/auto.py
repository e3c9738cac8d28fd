"""``backend="auto"`` (the default): the fastest runtime that gives the exact states on this machine.

Three modules, one concept each (``docs/architecture.md`` draws how a depth moves through them):

- :mod:`~layerwise.model.backends.policy`: which runtimes may serve a depth and which one does (eligibility,
  exactness, the race's record and the decision), without threads;
- :mod:`~layerwise.model.backends.preparer`: the background work, one worker and a Future per
  ``(model, depth, purpose)``;
- :mod:`~layerwise.model.backends.router`: :class:`AutoBackend`, which composes PyTorch and the compiled runtimes and
  makes one plan per call.

``$LAYERWISE_AUTO_RUNTIME`` changes the choice among exact runtimes: ``fastest`` (the default), ``onnx``, ``openvino``
(that runtime, prepared on the caller's path, since it was asked for) or ``torch`` (no timing).

Example::

    >>> ex = lw.Extractor()                                   # doctest: +SKIP
    >>> ex.encode(["I love Paris"]); ex.backend.settle()      # doctest: +SKIP
    >>> ex.backend.runtime_for([6], "block")                  # doctest: +SKIP
    'onnx'
"""

from __future__ import annotations

from .policy import BF16_AGREE, CHOICES, EXACT, RACE_ROUNDS, RACE_SHAPES, RaceRecord, runtime_choice
from .router import AutoBackend

__all__ = ["BF16_AGREE", "CHOICES", "EXACT", "RACE_ROUNDS", "RACE_SHAPES", "AutoBackend", "RaceRecord",
           "runtime_choice"]
