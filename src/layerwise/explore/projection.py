"""2D pictures of one layer's vectors: PCA (always), UMAP (when ``umap-learn`` is installed).

    >>> import numpy as np
    >>> xy, info = project(np.random.default_rng(0).normal(size=(50, 8)), "pca")
    >>> xy.shape, info["method"]
    ((50, 2), 'pca')
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import warnings
from typing import Any, Iterator

import numpy as np

from ..errors import LayerwiseError, MissingExtraError

METHODS = ("pca", "umap")


def available_methods() -> list[str]:
    """The projections this environment can compute (``umap`` needs ``pip install umap-learn``)."""
    return ["pca"] + (["umap"] if importlib.util.find_spec("umap") is not None else [])


# what TensorFlow's import writes to file descriptor 2 on its own (absl's C++ logging before it is initialised, which
# TF_CPP_MIN_LOG_LEVEL does not reach; the CPU feature guard's two lines)
TF_IMPORT_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWE]\d{4} [\d:.]+\s+\d+ [\w.]+:\d+\] .*"
    r"|To enable the following instructions: .*rebuild TensorFlow with the appropriate compiler flags\.)\s*$"
)


@contextlib.contextmanager
def _without_import_noise() -> Iterator[None]:
    """Hold back what is written to file descriptor 2 meanwhile and write it back without :data:`TF_IMPORT_NOISE`
    (anything else, another thread's line included, still reaches stderr, after the block)."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no stderr to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [line for line in held.read().decode("utf-8", "replace").splitlines(keepends=True)
                    if not TF_IMPORT_NOISE.match(line)]
            if kept:
                os.write(2, "".join(kept).encode("utf-8"))


def quiet_umap() -> Any:
    """The ``umap`` module, imported without the noise of its import.

    umap-learn imports TensorFlow (for its ParametricUMAP) wherever TensorFlow is installed, and TensorFlow's import
    writes C++ log lines (absl, CUDA, the CPU feature guard) and Python warnings to stderr: a command's output is no
    place for them. For the import only, ``TF_CPP_MIN_LOG_LEVEL`` is 3 (a value the user set is kept), Python warnings
    are ignored, the ``tensorflow`` and ``absl`` loggers say errors only, and the lines absl writes before it is
    initialised (which no setting reaches) are held back from file descriptor 2; everything is as before afterwards.
    """
    if "umap" in sys.modules:
        return sys.modules["umap"]
    saved_env = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
    loggers = {name: logging.getLogger(name) for name in ("tensorflow", "absl", "h5py", "numba")}
    levels = {name: logger.level for name, logger in loggers.items()}
    if saved_env is None:
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"  # read by TensorFlow's C++ logging when it loads
    for logger in loggers.values():
        logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), _without_import_noise():
            warnings.simplefilter("ignore")
            import umap
    finally:
        if saved_env is None:
            os.environ.pop("TF_CPP_MIN_LOG_LEVEL", None)
        for name, logger in loggers.items():
            logger.setLevel(levels[name])
    return umap


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
        umap = quiet_umap()
        with warnings.catch_warnings():  # "n_jobs overridden by random_state", numba's notes: not the user's business
            warnings.simplefilter("ignore")
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


__all__ = ["METHODS", "available_methods", "project", "quiet_umap"]
