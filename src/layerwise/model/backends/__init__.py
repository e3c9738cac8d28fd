"""Backends: the one seam between the pipeline and a model runtime.

A backend loads a model, runs the forward pass up to the deepest requested layer and returns the requested states
``[K, batch, tokens, width]``, says its device and dtype, and gives a fingerprint of its weights. Everything above
(windows, batches, combine, pool, stores, the service) talks to :class:`Backend` only, so a new framework or model
kind is a new module here plus one line in :data:`BACKENDS`.

============  ===========================================================  ==================================
name          runtime                                                      sites
============  ===========================================================  ==================================
``auto``      the default: the fastest of ONNX Runtime, OpenVINO and       all of torch's (``block`` only
              PyTorch for the block site among those within 1e-5 of        when quantised)
              PyTorch (checked once per depth), else PyTorch;
              ``quantize``: int8 on OpenVINO, else ONNX Runtime
``torch``     PyTorch with scoped forward hooks and early exit, any        block, raw, attention, intermediate,
              architecture (the layer map of :mod:`layerwise.model.layermap`)    pre_ln (those the model has)
``onnx``      ONNX Runtime (CPU): the encoder exported up to the deepest   block
              requested layer, cached on disk
``openvino``  OpenVINO (CPU, the ``[openvino]`` extra): that export       block
              converted to OpenVINO's IR (cached), the throughput hint,
              async infer requests; float32 exact, or its bf16 hint;
              ``quantize="int8"`` / ``"int8-full"`` by NNCF
``keras``     Keras 3 / keras-hub backbones (a preset directory, or a      block
              Hugging Face directory converted on load); a functional
              sub-model ends at the deepest requested layer
``tf``        a TensorFlow SavedModel in the TF Hub BERT interface         block (layers 1..L unless it
              (``encoder_outputs``); the whole graph runs                  returns ``embedding_output``)
============  ===========================================================  ==================================

``keras`` and ``tf`` need the optional extra ``layerwise[tf]``; their modules import TensorFlow only when a model is
loaded with them. :func:`detect_backend` picks ``keras`` for a keras-hub preset directory and ``tf`` for a
SavedModel directory, ``auto`` otherwise.
"""

from __future__ import annotations

import os

from ...errors import ModelLoadError
from ..loaded import LoadedModel
from ..options import BACKEND_NAMES, ModelOptions
from .auto import AutoBackend
from .base import Backend, refuse_options
from .keras import KerasBackend, is_keras_preset
from .openvino import OpenVinoBackend
from .ort import OnnxBackend
from .pytorch import TorchBackend
from .savedmodel import SavedModelBackend, is_saved_model

BACKENDS: dict[str, type[Backend]] = {"auto": AutoBackend, "torch": TorchBackend, "onnx": OnnxBackend,
                                      "openvino": OpenVinoBackend, "keras": KerasBackend, "tf": SavedModelBackend}


def detect_backend(model: object) -> str:
    """``"keras"`` for a keras-hub preset directory, ``"tf"`` for a SavedModel directory, else ``"auto"``."""
    if isinstance(model, (str, os.PathLike)) and os.path.isdir(model):
        if is_saved_model(model):
            return "tf"
        if is_keras_preset(model):
            return "keras"
    return "auto"


if tuple(BACKENDS) != BACKEND_NAMES:  # pragma: no cover - the vocabulary of ModelOptions and the registry agree
    raise ImportError(f"backend registry {tuple(BACKENDS)} differs from ModelOptions' {BACKEND_NAMES}")


def backend_class(name: object) -> type[Backend]:
    """The backend class registered as ``name``; ``ValueError`` lists the valid names."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ModelLoadError(f"unknown backend {name!r}. Valid backends are: {', '.join(BACKENDS)}")
    return BACKENDS[name]


def create_backend(loaded: LoadedModel, options: ModelOptions) -> Backend:
    """Wrap an already loaded model in the backend ``options.backend`` (default ``auto``), with the options that
    backend honours; one it does not honour is refused."""
    cls = backend_class(options.backend or "auto")
    refuse_options(cls, options)
    return cls.from_loaded(loaded, options)


def load_backend(options: ModelOptions) -> Backend:
    """Load the model ``options`` names in the backend it names, or the one :func:`detect_backend` picks."""
    return backend_class(options.backend or detect_backend(options.model)).load(options)


__all__ = ["AutoBackend", "BACKENDS", "Backend", "KerasBackend", "OnnxBackend", "OpenVinoBackend", "SavedModelBackend",
           "TorchBackend", "backend_class", "create_backend", "detect_backend", "load_backend"]
