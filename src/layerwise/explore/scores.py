"""How well one layer's vectors separate the labels, as numbers to put next to its picture.

- ``knn``: leave-one-out accuracy of a k-nearest-neighbour vote (cosine similarity, ``k = 10``);
- ``probe``: accuracy of a logistic-regression probe, stratified 5-fold cross-validation (fewer folds when a label
  has fewer records), features standardised;
- ``silhouette``: the silhouette coefficient of the labels under cosine distance (-1..1; higher is better
  separated).

All three use the full-width vectors, never the 2D projection.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> x = np.concatenate([rng.normal(0, 1, (40, 8)), rng.normal(3, 1, (40, 8))])
    >>> s = layer_scores(x, ["a"] * 40 + ["b"] * 40)
    >>> s["knn"] > 0.9, s["probe"] > 0.9
    (True, True)
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import LayerwiseError

KNN_K = 10
FOLDS = 5


def knn_accuracy(x: np.ndarray, y: np.ndarray, k: int = KNN_K) -> float:
    """Leave-one-out accuracy of a majority vote of the ``k`` most cosine-similar other records (``x [n, w]``)."""
    n = len(x)
    if n < 2:
        return float("nan")
    unit = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
    k = min(k, n - 1)
    classes, codes = np.unique(y, return_inverse=True)
    hits = 0
    for lo in range(0, n, 1024):  # [block, n] similarities at a time
        sim = unit[lo : lo + 1024] @ unit.T
        sim[np.arange(len(sim)), np.arange(lo, lo + len(sim))] = -np.inf  # not itself
        nearest = np.argpartition(-sim, k - 1, axis=1)[:, :k]
        votes = np.zeros((len(sim), len(classes)))
        np.add.at(votes, (np.arange(len(sim))[:, None], codes[nearest]), 1)
        hits += int((votes.argmax(1) == codes[lo : lo + len(sim)]).sum())
    return hits / n


def probe_accuracy(x: np.ndarray, y: np.ndarray, seed: int = 0) -> float:
    """Mean accuracy of a standardised logistic-regression probe over stratified folds (``x [n, w]``)."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold, cross_val_score
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    _, counts = np.unique(y, return_counts=True)
    folds = min(FOLDS, int(counts.min()))
    if len(counts) < 2 or folds < 2:
        return float("nan")
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=1000, C=1.0))
    cv = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    return float(np.mean(cross_val_score(model, x, y, cv=cv)))


def silhouette(x: np.ndarray, y: np.ndarray) -> float:
    """The labels' silhouette coefficient under cosine distance (``nan`` with fewer than 2 labels)."""
    from sklearn.metrics import silhouette_score

    labels = np.unique(y)
    if len(labels) < 2 or len(labels) >= len(x):
        return float("nan")
    return float(silhouette_score(x, y, metric="cosine"))


def layer_scores(x: np.ndarray, labels: Sequence[str], seed: int = 0) -> dict[str, float]:
    """``{"knn", "probe", "silhouette"}`` for ``x [n, width]`` and ``n`` labels (``nan`` where undefined)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(labels)
    if len(y) != len(x):
        raise LayerwiseError(f"got {len(y)} labels for {len(x)} vectors")
    return {"knn": knn_accuracy(x, y), "probe": probe_accuracy(x, y, seed), "silhouette": silhouette(x, y)}


__all__ = ["FOLDS", "KNN_K", "knn_accuracy", "layer_scores", "probe_accuracy", "silhouette"]
