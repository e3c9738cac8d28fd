"""Optional extras: import a framework that an extra installs, or say which ``pip install`` line brings it.

============  ==========================================================  ===================================
extra         what needs it                                               packages
============  ==========================================================  ===================================
``tf``        ``backend="keras"`` / ``"tf"``                              tensorflow, keras, keras-hub
``ray``       ``extract --engine ray``, :func:`layerwise.ray.extract`     ray[data]
``hf``        ``store.to_dataset()``                                      datasets
``umap``      UMAP projections in the explorer                            umap-learn
``onnx``      ``backend="onnx"`` (a core dependency; the extra remains)   onnxruntime, onnx
``openvino``  ``backend="openvino"``; ``auto`` races it where installed   openvino
============  ==========================================================  ===================================

Example::

    >>> from layerwise.extras import require
    >>> np = require("numpy", what="this example", extra="test")
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError


def require(*modules: str, what: str, extra: str, packages: str = "") -> ModuleType:
    """Import ``modules`` (all of them) and return the first.

    Raises:
        MissingExtraError: one is not installed; the message names ``what`` needs it and the
            ``pip install 'layerwise[extra]'`` line.
    """
    loaded = []
    for name in modules:
        try:
            loaded.append(importlib.import_module(name))
        except ImportError as exc:
            raise MissingExtraError(what, extra, packages) from exc
    return loaded[0]


__all__ = ["require"]
