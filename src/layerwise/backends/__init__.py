"""Backends: the one seam between the pipeline and a model runtime.

A backend loads a model, runs the forward pass up to the deepest requested layer and returns the requested states
``[K, batch, tokens, width]``, says its device and dtype, and gives a fingerprint of its weights. Everything above
(windows, batches, combine, pool, stores, the service) talks to :class:`Backend` only, so a new framework or model
kind is a new module here plus one line in :data:`BACKENDS`.

==========  ===========================================================  ==================================
name        runtime                                                      sites
==========  ===========================================================  ==================================
``torch``   PyTorch with scoped forward hooks and early exit, any        block, raw, attention, intermediate,
            architecture (the layer map of :mod:`layerwise.layermap`)    pre_ln (those the model has)
``onnx``    ONNX Runtime (CPU): the encoder exported up to the deepest   block
            requested layer, cached on disk
==========  ===========================================================  ==================================
"""

from __future__ import annotations

from typing import Any

from ..loading import LoadedModel
from .base import Backend
from .ort import OnnxBackend
from .pytorch import TorchBackend

BACKENDS: dict[str, type[Backend]] = {"torch": TorchBackend, "onnx": OnnxBackend}


def backend_class(name: object) -> type[Backend]:
    """The backend class registered as ``name``; ``ValueError`` lists the valid names."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}. Valid backends are: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def create_backend(name: str, loaded: LoadedModel, **options: Any) -> Backend:
    """Wrap an already loaded model in the backend ``name`` (``options`` go to the backend's constructor)."""
    return backend_class(name)(loaded, **options)


__all__ = ["BACKENDS", "Backend", "OnnxBackend", "TorchBackend", "backend_class", "create_backend"]
