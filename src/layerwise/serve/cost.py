"""What a forward pass costs, measured as the service runs, and how the requests of one call are cut by depth.

A forward pass over ``T`` tokens to depth ``D`` costs about ``overhead * batches + unit * T * D`` seconds, where
``batches`` is the number of forward batches it takes (``ceil(T / batch_tokens)``, at least one): a fixed price per
batch (launching kernels, padding, Python) and a price per token and layer. :class:`CostModel` starts from a prior
for the device (a CPU pays little per batch and much per layer; a GPU the reverse) and refits both prices by least
squares on every finished call, so it follows the model and machine actually serving.

:func:`plan` uses it: the requests of one call ask for different depths. Running each depth on its own pays the
per-batch price once more per depth (a part-filled batch); running a shallow request in a deeper segment pays its
tokens through the layers it does not need. The depths, sorted, are cut into contiguous segments (each run to its
deepest member) by dynamic programming over the segment costs. The segments of a call share one pipeline of forward
batches (:meth:`Extractor.encode_shared <layerwise.Extractor.encode_shared>`), so a segment costs no more than its
batches.

Example::

    >>> model = CostModel(batch_tokens=1024, overhead=0.002, unit=2e-5)
    >>> plan({1: 120, 6: 4000}, model)     # 120 tokens at depth 1, 4000 at depth 6: five layers each are dearer
    [[1], [6]]
    >>> plan({5: 50, 6: 800}, model)       # one layer more for 50 tokens is cheaper than a batch of their own
    [[5, 6]]
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

PRIORS = {"cpu": (0.002, 2e-5), "cuda": (0.004, 2e-7)}  # (seconds per batch, seconds per token-layer)
PRIOR_WEIGHT = 2.0  # the prior counts as this many observed calls
DECAY = 0.98  # each new call weighs 1, earlier ones fade by this factor


@dataclass
class CostModel:
    """Seconds of one forward call: ``overhead * max(1, ceil(tokens / batch_tokens)) + unit * tokens * depth``.

    Args:
        batch_tokens: the extractor's token budget per forward batch.
        overhead: the prior price of one batch, seconds.
        unit: the prior price of one token through one layer, seconds.
    """

    batch_tokens: int
    overhead: float
    unit: float
    calls: int = 0
    _prior: tuple[float, float] = (0.0, 0.0)
    _seen: list[float] = field(default_factory=lambda: [0.0] * 5, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def for_device(cls, device: str, batch_tokens: int) -> "CostModel":
        """The prior of ``device`` (``"cpu"``, ``"cuda"``; others take the CPU's) for ``batch_tokens``."""
        overhead, unit = PRIORS.get(device, PRIORS["cpu"])
        return cls(batch_tokens, overhead, unit)

    def __post_init__(self) -> None:
        self._prior = (self.overhead, self.unit)

    def batches(self, tokens: int) -> int:
        """Forward batches ``tokens`` take (at least one)."""
        return max(1, math.ceil(tokens / self.batch_tokens))

    def seconds(self, tokens: int, depth: int) -> float:
        """The predicted seconds of one call of ``tokens`` to ``depth``."""
        return self.overhead * self.batches(tokens) + self.unit * tokens * max(depth, 1)

    def observe(self, batches: int, work: int, seconds: float) -> None:
        """Refit the prices on one finished call: ``batches`` forward batches, ``work`` tokens x layers run (each
        segment's tokens times its depth, summed), ``seconds`` of model time."""
        if batches < 1 or seconds <= 0:
            return
        a0, u0 = self._prior
        # in units of the prior prices (x = overhead / a0, z = unit / u0), so that a ridge toward (1, 1) weighs both
        # alike: calls that are all alike (which cannot tell the prices apart) move them as little as they can
        b, w, y = float(batches) * a0, float(work) * u0, float(seconds)
        with self._lock:
            self._seen = [DECAY * a + v for a, v in zip(self._seen, (b * b, b * w, w * w, b * y, w * y))]
            bb, bw, ww, by, wy = self._seen
            ridge = PRIOR_WEIGHT * a0**2  # the prior weighs as PRIOR_WEIGHT calls of one batch that cost only it
            bb, ww, by, wy = bb + ridge, ww + ridge, by + ridge, wy + ridge
            det = bb * ww - bw * bw
            x, z = (by * ww - bw * wy) / det, (bb * wy - bw * by) / det
            if x > 0 and z > 0:  # a fit that is not physical keeps the last prices
                self.overhead, self.unit = x * a0, z * u0
            self.calls += 1

def plan(tokens_by_depth: dict[int, int], model: CostModel) -> list[list[int]]:
    """The cheapest cut of the depths of one call into contiguous segments, each run to its deepest member.

    Args:
        tokens_by_depth: tokens per depth.
        model: the prices.

    Returns:
        The segments, shallowest first, each its depths ascending.
    """
    depths = sorted(tokens_by_depth)
    n = len(depths)
    best = [0.0] + [math.inf] * n  # best[j]: cheapest cost of depths[:j]
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        tokens = 0
        for i in range(j - 1, -1, -1):  # the last segment is depths[i:j], run at depths[j - 1]
            tokens += tokens_by_depth[depths[i]]
            cost = best[i] + model.seconds(tokens, depths[j - 1])
            if cost < best[j]:
                best[j], cut[j] = cost, i
    segments = []
    j = n
    while j > 0:
        segments.append(depths[cut[j]:j])
        j = cut[j]
    return segments[::-1]


__all__ = ["CostModel", "PRIORS", "plan"]
