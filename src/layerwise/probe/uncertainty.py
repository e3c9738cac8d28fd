"""How sure a probe's score is: bootstrap 95% intervals, and which differences between probes are inside the noise.

A score is computed from per-item counts (an item is a sentence for tagging, a record for a sentence task):
``correct, total`` for accuracy; ``true positives, predicted, gold`` entities for entity F1 (seqeval's default,
conlleval-compatible chunking, sentence by sentence: the same F1 seqeval gives on the whole split). Resampling the
items with replacement (:data:`RESAMPLES` times, one seeded index matrix shared by every probe of a run, so the
resamples are paired) gives each score's percentile interval, and for two probes the interval of their difference:
a difference whose interval holds 0 is inside the noise.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

RESAMPLES = 1000
LEVEL = 0.95


def item_counts(gold: Sequence[Sequence[str]] | Sequence[str], pred: Sequence[Sequence[str]] | Sequence[str],
                metric: str) -> np.ndarray:
    """``[items, 2]`` (``correct, total``) for ``accuracy``, or ``[items, 3]`` (``true positives, predicted,
    gold``) for ``entity F1``; ``gold``/``pred``: tag sequences per sentence, or one label per record."""
    if metric == "entity F1":
        from seqeval.metrics.sequence_labeling import get_entities

        rows = []
        for g, p in zip(gold, pred):
            ge, pe = set(get_entities(list(g))), set(get_entities(list(p)))
            rows.append((len(ge & pe), len(pe), len(ge)))
        return np.asarray(rows, dtype=np.float64).reshape(-1, 3)
    if gold and not isinstance(gold[0], str):  # tagging accuracy: words right per sentence
        return np.asarray([(sum(a == b for a, b in zip(g, p)), len(g)) for g, p in zip(gold, pred)],
                          dtype=np.float64).reshape(-1, 2)
    return np.asarray([(float(a == b), 1.0) for a, b in zip(gold, pred)], dtype=np.float64).reshape(-1, 2)


def score(totals: np.ndarray) -> np.ndarray:
    """The metric from summed counts ``[..., 2]`` (accuracy) or ``[..., 3]`` (entity F1: ``2 tp / (pred + gold)``,
    0 when both are 0, as seqeval)."""
    if totals.shape[-1] == 2:
        return np.divide(totals[..., 0], totals[..., 1], out=np.zeros(totals.shape[:-1]), where=totals[..., 1] > 0)
    denom = totals[..., 1] + totals[..., 2]
    return np.divide(2 * totals[..., 0], denom, out=np.zeros(totals.shape[:-1]), where=denom > 0)


def resample_weights(items: int, resamples: int = RESAMPLES, seed: int = 0) -> np.ndarray:
    """``[resamples, items]``: how many times each item is drawn in each resample (``items`` draws with
    replacement; one matrix shared by every probe scored on a split, so their resamples are paired)."""
    return np.random.default_rng(seed).multinomial(items, np.full(items, 1 / items), size=resamples).astype(np.float64)


def resampled(counts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The score of each resample ``[resamples]`` (``counts [items, c]``, ``weights [resamples, items]``)."""
    return score(weights @ counts)


def interval(samples: np.ndarray, level: float = LEVEL) -> tuple[float, float]:
    """The percentile interval of ``samples`` at ``level``."""
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def within_noise(best: np.ndarray, other: np.ndarray, level: float = LEVEL) -> bool:
    """Whether the paired resampled scores of two probes differ by an amount whose interval holds 0."""
    lo, hi = interval(best - other, level)
    return lo <= 0.0 <= hi
