"""What a forward pass costs, measured as the service runs, and how the requests of one call are cut by depth.

A forward pass over ``T`` tokens to depth ``D`` costs about ``batches * (overhead + layer_overhead * D) + unit * T *
D`` seconds, where ``batches`` is the number of forward batches it takes (``ceil(T / batch_tokens)``, at least one): a
fixed price per batch (padding, Python), a price per batch and layer (launching each layer's kernels: PyTorch on a CPU
pays 5 ms for one text to layer 1 and 21 ms to layer 6), and a price per token and layer. :class:`CostModel` starts
from a prior for the device (a CPU pays little per batch and much per layer; a GPU the reverse) and refits the three
prices by least squares on every finished call, so it follows the model and machine actually serving.

:func:`plan` uses it: the requests of one call ask for different depths. Running each depth on its own pays the
per-batch price once more per depth (a part-filled batch); running a shallow request in a deeper segment pays its
tokens through the layers it does not need. The depths, sorted, are cut into contiguous segments (each run to its
deepest member) by dynamic programming over the segment costs. The segments of a call share one pipeline of forward
batches (:meth:`Extractor.encode_shared <layerwise.Extractor.encode_shared>`), so a segment costs no more than its
batches.

:class:`WayCorrections` keeps the choice between the ways of running a call of several depths honest: cut into
segments, one segment run whole to its deepest depth, or one segment whose rows each leave at their own depth (a
ragged call, on the chain of one-layer graphs the runtime chose). Three linear prices cannot say
everything a runtime does: a call of one part-filled batch leaves a stream of a two-stream runtime idle, a chain of
one-layer graphs loses more to a busy machine than one graph. Real traffic, whose batches are mostly full, cannot tell a
price per batch from a price per token either. So each way's predictions are corrected by what that way's calls
actually took, and a way not run for a while is run once more, so that a correction never goes stale unseen. (On a
2-core CPU, 2026-11-26, OpenVINO serving a mixed load of layers 1..6: the cut calls took 1.26x their predicted seconds,
the ragged calls 0.37-0.77x. Every mixed call run cut gave 168-176 texts/s, every one ragged 235-237, in process.)

Example::

    >>> model = CostModel(batch_tokens=1024, overhead=0.002, layer_overhead=0.0, unit=2e-5)
    >>> plan({1: 120, 6: 4000}, model)     # 120 tokens at depth 1, 4000 at depth 6: five layers each are dearer
    [[1], [6]]
    >>> plan({5: 50, 6: 800}, model)       # one layer more for 50 tokens is cheaper than a batch of their own
    [[5, 6]]
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np

PRIORS = {"cpu": (0.002, 0.003, 2e-5), "cuda": (0.004, 0.0005, 2e-7)}  # per batch, per batch-layer, per token-layer
PRIOR_WEIGHT = 2.0  # the prior weighs as this many calls of one batch that cost only their prior price
DECAY = 0.98  # each new call weighs 1, earlier ones fade by this factor
SCALES = (1e-3, 1e-4, 1e-6)  # the unit of a price whose prior is zero, for the fit


@dataclass
class CostModel:
    """Seconds of one forward segment: ``batches * (overhead + layer_overhead * depth) + unit * tokens * depth``, with
    ``batches = max(1, ceil(tokens / batch_tokens))``.

    Args:
        batch_tokens: the extractor's token budget per forward batch.
        overhead: the prior price of one batch, seconds.
        layer_overhead: the prior price of one batch through one layer, seconds.
        unit: the prior price of one token through one layer, seconds.
    """

    batch_tokens: int
    overhead: float
    layer_overhead: float
    unit: float
    calls: int = 0
    _prior: tuple[float, float, float] = (0.0, 0.0, 0.0)
    _gram: np.ndarray = field(default_factory=lambda: np.zeros((3, 3)), repr=False)
    _rhs: np.ndarray = field(default_factory=lambda: np.zeros(3), repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def for_device(cls, device: str, batch_tokens: int) -> "CostModel":
        """The prior of ``device`` (``"cpu"``, ``"cuda"``; others take the CPU's) for ``batch_tokens``."""
        return cls(batch_tokens, *PRIORS.get(device, PRIORS["cpu"]))

    def __post_init__(self) -> None:
        self._prior = (self.overhead, self.layer_overhead, self.unit)

    def batches(self, tokens: int) -> int:
        """Forward batches ``tokens`` take (at least one)."""
        return max(1, math.ceil(tokens / self.batch_tokens))

    def features(self, segments: list[tuple[int, int]], shared: bool = False) -> tuple[float, float, float]:
        """``(batches, batches x depth, tokens x depth)`` summed over ``segments`` of ``(tokens, depth)``. With
        ``shared`` the segments share their batches, each row leaving at its own depth (a ragged call): the batches
        of all their tokens, each run to the deepest depth, and every segment's tokens through its own depth."""
        if shared:
            b = self.batches(sum(t for t, _ in segments))
            return float(b), float(b * max(max(d, 1) for _, d in segments)), float(sum(t * max(d, 1)
                                                                                     for t, d in segments))
        b = sum(self.batches(t) for t, _ in segments)
        bd = sum(self.batches(t) * max(d, 1) for t, d in segments)
        td = sum(t * max(d, 1) for t, d in segments)
        return float(b), float(bd), float(td)

    def seconds(self, tokens: int, depth: int) -> float:
        """The predicted seconds of one segment of ``tokens`` to ``depth``."""
        return self.predict([(tokens, depth)])

    def predict(self, segments: list[tuple[int, int]], shared: bool = False, price: float = 1.0) -> float:
        """The predicted seconds of a call of ``segments`` of ``(tokens, depth)`` (``shared``: a ragged call, see
        :meth:`features`), its layers at ``price`` times their measured prices (a runtime that runs the rows of a
        ragged call another way: :meth:`Backend.ragged_price <layerwise.model.backends.base.Backend.ragged_price>`)."""
        b, bd, td = self.features(segments, shared)
        return self.overhead * b + price * (self.layer_overhead * bd + self.unit * td)

    def predict_ragged(self, segments: list[tuple[int, int]], price: float) -> float:
        """The predicted seconds of a ragged call of ``segments`` of ``(tokens, depth)`` on a chain priced at
        ``price``: what its tokens would cost to their deepest depth, times ``price``, times the share of those
        token-layers the rows need. That is how a chain's price is measured (its time on rows at mixed depths over
        the serving graph's time on the same batch, weighed by the token-layers the rows needed:
        :meth:`Stages.prepare <layerwise.model.backends.stages.Stages.prepare>`), so it holds however the fitted
        prices split a call's time between its batches, their layers and their tokens."""
        tokens = sum(t for t, _ in segments)
        depth = max(max(d, 1) for _, d in segments)
        needed = sum(t * max(d, 1) for t, d in segments) / max(tokens * depth, 1)
        return self.predict([(tokens, depth)]) * price * needed

    def observe(self, segments: list[tuple[int, int]], seconds: float, shared: bool = False) -> None:
        """Refit the prices on one finished call: its ``segments`` of ``(tokens, depth)`` took ``seconds``
        (``shared``: a ragged call, see :meth:`features`)."""
        if not segments or seconds <= 0:
            return
        prior = np.array(self._prior)
        # in units of the prior prices (a zero prior: of a small price of its kind), so that a ridge toward the prior
        # weighs all three alike: calls that are all alike (which cannot tell the prices apart) move them as little
        # as they can
        scale = np.where(prior > 0, prior, SCALES)
        x = np.array(self.features(segments, shared)) * scale
        with self._lock:
            self._gram = DECAY * self._gram + np.outer(x, x)
            self._rhs = DECAY * self._rhs + x * seconds
            ridge = PRIOR_WEIGHT * scale[0] ** 2
            fit = np.linalg.solve(self._gram + ridge * np.eye(3), self._rhs + ridge * prior / scale)
            if (fit >= 0).all():  # a fit that is not physical keeps the last prices
                self.overhead, self.layer_overhead, self.unit = (float(v) for v in fit * scale)
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


CUT, WHOLE, RAGGED = "cut", "whole", "ragged"  # the ways of running a call of several depths
CORRECTION_DECAY = 0.95  # each call of a way weighs 1 in its correction, the earlier ones fade by this factor
FIRST_RUNS = 2  # each way runs this many calls before the corrections alone decide
RETRY_AFTER = 64  # calls of several depths after which a way not chosen runs once more
HOPELESS = 2.0  # a way predicted (corrected) above this many times the best is not run to check ...
HOPELESS_RETRY = 8 * RETRY_AFTER  # ... but after this many choices without a call it is run once more


def ragged_way(runtime: str = "") -> str:
    """The name of the way that runs a call's rows to their own depths on ``runtime``'s chain: :data:`RAGGED`, or
    ``"ragged:onnx"`` where several runtimes offer one (the corrections and the metrics keep them apart)."""
    return f"{RAGGED}:{runtime}" if runtime else RAGGED


@dataclass
class WayCorrections:
    """What the cost model's predictions miss for each way of running a call of several depths (:data:`CUT` into
    segments, :data:`WHOLE` as one segment to its deepest depth, :data:`RAGGED` each row to its own depth, or
    :func:`ragged_way` on one runtime's chain of several), learned from the calls each way ran.

    A correction is the seconds that way's calls took over the seconds predicted for them, both summed with the
    earlier calls fading by :data:`CORRECTION_DECAY` for each choice made since (a ratio of sums: small calls, whose
    share moves most, weigh least), ``1.0`` before any. The batcher reports as a call's seconds its wall time from the
    previous call's end: its share of the service's throughput.

    :meth:`choose` compares the corrected predictions. The way predicted cheapest runs first; once it has run
    :data:`FIRST_RUNS` calls, each other way runs as many in turn; after that a way not chosen in the last
    :data:`RETRY_AFTER` choices runs the next call, unless it is predicted above :data:`HOPELESS` times the best
    (corrected, or before its first runs as predicted); such a way still runs once after :data:`HOPELESS_RETRY`
    choices without a call.
    """

    took: dict[str, float] = field(default_factory=dict)  # way -> seconds, fading sums
    predicted: dict[str, float] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    last: dict[str, int] = field(default_factory=dict)
    seen: dict[str, int] = field(default_factory=dict)  # way -> the choice count when it last reported a call
    choices: int = 0

    def correction(self, way: str) -> float:
        """The factor that multiplies ``way``'s predictions (``seconds / predicted`` of its calls)."""
        predicted = self.predicted.get(way, 0.0)
        return self.took.get(way, 0.0) / predicted if predicted > 0 else 1.0

    def choose(self, predicted: dict[str, float]) -> str:
        """The way to run a call, from the cost model's ``predicted`` seconds of each way offered (:data:`CUT`,
        :data:`RAGGED` or :func:`ragged_way` names)."""
        self.choices += 1
        corrected = {way: seconds * self.correction(way) for way, seconds in predicted.items()}
        # the cheapest; a tie goes to a ragged way (no layer run that is not needed), then to the first offered
        best = min(corrected, key=lambda way: (corrected[way], way in (CUT, WHOLE)))
        for other in (way for way in predicted if way != best):
            # the predicted way first; once it has run its first calls, each other runs its own (weighed
            # uncorrected: it has no correction yet); then the corrections decide, a way not chosen run again every
            # RETRY_AFTER choices
            if self.runs.get(other, 0) < FIRST_RUNS:
                due, weigh = self.runs.get(best, 0) >= FIRST_RUNS, predicted
            else:
                since = self.choices - self.last.get(other, 0)
                due, weigh = since >= RETRY_AFTER, corrected
                if since >= HOPELESS_RETRY:  # its correction is that old: whatever it said, look again
                    weigh = {other: 0.0, best: corrected[best]}
            if due and weigh[other] <= HOPELESS * weigh[best]:
                self.last[other] = self.choices  # tried now: not due again before RETRY_AFTER more choices
                return other
        return best

    def observe(self, way: str, predicted: float, seconds: float) -> None:
        """One call of ``way`` that the cost model predicted at ``predicted`` seconds took ``seconds``."""
        if predicted <= 0 or seconds <= 0:
            return
        # the earlier calls fade by CORRECTION_DECAY per choice made since this way last ran, not per call of the
        # way: a way run once in RETRY_AFTER choices is judged by its last calls, so one bad start cannot keep it
        # out for good
        fade = CORRECTION_DECAY ** max(1, self.choices - self.seen.get(way, self.choices))
        self.seen[way] = self.choices
        self.took[way] = fade * self.took.get(way, 0.0) + seconds
        self.predicted[way] = fade * self.predicted.get(way, 0.0) + predicted
        self.runs[way] = self.runs.get(way, 0) + 1
        self.last[way] = max(self.last.get(way, 0), self.choices)

    def ways(self) -> list[str]:
        """The ways seen so far (offered or run)."""
        return list(dict.fromkeys([CUT, *self.predicted]))


__all__ = ["CUT", "CostModel", "HOPELESS_RETRY", "PRIORS", "RAGGED", "WHOLE", "WayCorrections", "plan", "ragged_way"]
