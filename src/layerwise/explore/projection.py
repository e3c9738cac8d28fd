"""2D pictures of one layer's vectors: PCA (always), UMAP (when ``umap-learn`` is installed).

    >>> import numpy as np
    >>> xy, info = project(np.random.default_rng(0).normal(size=(50, 8)), "pca")
    >>> xy.shape, info["method"]
    ((50, 2), 'pca')
"""

from __future__ import annotations

import importlib.util

import numpy as np

from ..errors import LayerwiseError, MissingExtraError

METHODS = ("pca", "umap")


def available_methods() -> list[str]:
    """The projections this environment can compute (``umap`` needs ``pip install umap-learn``)."""
    return ["pca"] + (["umap"] if importlib.util.find_spec("umap") is not None else [])


def project(x: np.ndarray, method: str = "pca", seed: int = 0) -> tuple[np.ndarray, dict]:
    """Project ``x [n, width]`` to ``[n, 2]``.

    Returns:
        ``(xy [n, 2] float32, info)``; for PCA ``info["explained"]`` is the share of variance of each axis.

    Raises:
        ValueError: an unknown method. MissingExtraError: ``umap`` when umap-learn is not installed.
    """
    if method not in METHODS:
        raise LayerwiseError(f"unknown projection {method!r}. Valid values are: {', '.join(METHODS)}")
    if method not in available_methods():
        raise MissingExtraError("projection 'umap' (or use 'pca')", "umap", "umap-learn")
    x = np.asarray(x, dtype=np.float64)
    if method == "umap" and len(x) > 3:
        import umap

        xy = umap.UMAP(n_components=2, random_state=seed, n_neighbors=min(15, len(x) - 1)).fit_transform(x)
        return np.asarray(xy, dtype=np.float32), {"method": "umap"}
    centred = x - x.mean(0, keepdims=True)
    if len(x) < 2:
        return np.zeros((len(x), 2), np.float32), {"method": "pca", "explained": [0.0, 0.0]}
    _, s, vt = np.linalg.svd(centred, full_matrices=False)
    axes = vt[:2]
    xy = centred @ axes.T  # Shape: (n, <=2)
    # a fixed sign per axis (largest loading positive), so a picture does not flip between runs
    signs = np.sign(axes[np.arange(len(axes)), np.abs(axes).argmax(1)])
    xy = xy * signs
    if xy.shape[1] < 2:
        xy = np.pad(xy, ((0, 0), (0, 2 - xy.shape[1])))
    var = s**2
    explained = (var[:2] / var.sum()).tolist() if var.sum() > 0 else [0.0, 0.0]
    return xy.astype(np.float32), {"method": "pca", "explained": explained + [0.0] * (2 - len(explained))}


__all__ = ["METHODS", "available_methods", "project"]
