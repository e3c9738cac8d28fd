"""``ModelOptions``: the one way a model is named and loaded. Imports no torch.

Every entry point that loads a model takes one: :meth:`Extractor.from_options <layerwise.Extractor.from_options>`
(and ``Extractor(model, **fields)``), :func:`layerwise.extract`, :func:`layerwise.ray.extract` (its encode actors
load from it), :func:`layerwise.heads.train` (a head's config keeps it), :func:`layerwise.probe.run`, the service and
the explorer; the CLI declares the model flags once (``layerwise.cli.options``) and builds one. A store's manifest
records it (``model_options``). So an option given anywhere reaches the loaded model: none can be dropped on the way.

==========================  ==================================================================================
field                       valid values
==========================  ==================================================================================
``model``                   a local model directory or hub id; ``None``: the embedded all-MiniLM-L6-v2
``device``                  ``cpu``, ``cuda``, ``cuda:1``...; ``None``: CUDA when available, else CPU
``compute_dtype``           how the model runs: ``float32`` (``None`` is float32) ``| float16 | bfloat16``
                            (reduced precision is never a default; on a CPU without native support it is warned
                            about). Features are returned in the spec's ``output_dtype``
``backend``                 ``auto | torch | onnx | openvino | keras | tf``; ``None``: ``keras`` for a keras-hub preset
                            directory, ``tf`` for a SavedModel, else ``auto``
``quantize``                ``None`` (``"none"`` reads as ``None``) ``| int8 | int8-full``. ``int8``: int8 weights on
                            OpenVINO (the ``[openvino]`` extra), else ONNX Runtime's dynamic int8; ``int8-full``:
                            weights and activations in int8 on OpenVINO, calibrated, least exact and fastest
``quantize_calibration``    ``quantize="int8-full"`` only: a text file (one text a line) to calibrate on; ``None``:
                            the bundled neutral sample
``padding_side``            ``right | left`` (the decoder embedding-model convention; the same states)
``layer_modules``           the module path of the layer list (``"model.layers"``) when it is not found by itself
``max_length``, ``stride``  window length and overlap in tokens (``None``: the model's defaults)
``allow_pickle``            also load pickle checkpoints. RISK: unpickling runs code from the file
``trust_remote_code``       run modelling code shipped with a hub repository. RISK: it runs with your permissions
``revision``                a hub revision (branch, tag or commit), for hub ids only
``tokenizer``               ``backend="tf"`` only: a directory with the SavedModel's Hugging Face tokenizer
``onnx_cache``              where exported ONNX graphs are cached (default ``$LAYERWISE_CACHE/onnx``)
``max_layer``               the deepest layer this model will run (``-1``: the last): its blocks are loaded at
                            once and a deeper request is refused (a hard memory bound for servers); ``None``:
                            blocks are loaded when a layer first needs them
``max_memory``              a memory budget (``"4GB"``, ``"512MiB"``, bytes) for the weights: layers whose
                            blocks exceed it run block by block over chunks of records, each block read from
                            the checkpoint once per chunk (a throughput mode); ``None``: no budget
==========================  ==================================================================================

JSON written by layerwise 0.x (a head's ``model``/``max_length``, the flags ``dtype`` and ``layers``) is read with
the new names: ``dtype`` is ``compute_dtype`` and ``layers`` is ``layer_modules`` (see :data:`LEGACY_FIELDS`).

Example::

    >>> import layerwise as lw
    >>> opts = lw.ModelOptions(compute_dtype="bfloat16", backend="torch")
    >>> lw.ModelOptions.from_json(opts.to_json()) == opts
    True
    >>> ex = lw.Extractor.from_options(opts)                                       # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config_json import dump_json, fields_from, read_json_arg
from ..encoding.vocab import PADDING_SIDES
from ..errors import ModelLoadError

COMPUTE_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")
BACKEND_NAMES: tuple[str, ...] = ("auto", "torch", "onnx", "openvino", "keras", "tf")  # layerwise.model.backends
QUANTIZE_MODES: tuple[str, ...] = ("int8", "int8-full")
LEGACY_FIELDS = {"dtype": "compute_dtype", "layers": "layer_modules"}  # names of layerwise 0.x
# keyword arguments named as transformers names them (``from_pretrained(dtype=...)``, formerly ``torch_dtype``)
TRANSFORMERS_NAMES = {"dtype": "compute_dtype", "torch_dtype": "compute_dtype"}


def _text(value: object, name: str) -> str | None:
    """``None``, or a string (a path-like becomes its string; a torch dtype or device its name); ``TypeError`` for
    anything else."""
    if value is None:
        return None
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, str):
        return value
    if type(value).__module__ == "torch":  # torch.dtype / torch.device, accepted without importing torch
        return str(value).removeprefix("torch.")
    what = "a path or hub id string" if name == "model" else "a string"
    raise TypeError(f"{name} must be {what}, got {type(value).__name__}")


@dataclass(frozen=True)
class ModelOptions:
    """Which model, and how it is loaded and run (see the module docstring for every field's valid values)."""

    model: str | None = None
    device: str | None = None
    compute_dtype: str | None = None
    backend: str | None = None
    quantize: str | None = None
    quantize_calibration: str | None = None
    padding_side: str = "right"
    layer_modules: str | None = None
    max_length: int | None = None
    stride: int | None = None
    allow_pickle: bool = False
    trust_remote_code: bool = False
    revision: str | None = None
    tokenizer: str | None = None
    onnx_cache: str | None = None
    max_layer: int | None = None
    max_memory: str | int | None = None

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        for name in ("model", "device", "compute_dtype", "backend", "quantize", "quantize_calibration",
                     "layer_modules", "revision", "tokenizer", "onnx_cache"):
            set_(name, _text(getattr(self, name), name))
        if self.quantize == "none":
            set_("quantize", None)
        for name, valid, noun in (("compute_dtype", COMPUTE_DTYPES, "values"), ("backend", BACKEND_NAMES, "backends"),
                                  ("quantize", ("none", *QUANTIZE_MODES), "values")):
            value = getattr(self, name)
            if value is not None and value not in valid:
                raise ModelLoadError(f"unknown {name} {value!r}. Valid {noun} are: {', '.join(valid)}")
        if self.quantize_calibration is not None and self.quantize != "int8-full":
            raise ModelLoadError(f"quantize_calibration={self.quantize_calibration!r} calibrates quantize='int8-full', "
                                 f"not quantize={self.quantize!r}: add quantize='int8-full' or leave it out")
        if self.padding_side not in PADDING_SIDES:
            raise ModelLoadError(f"unknown padding_side {self.padding_side!r}. Valid values are: "
                                 f"{', '.join(PADDING_SIDES)}")
        if self.max_memory is not None:
            from .memory import parse_size

            parse_size(self.max_memory)  # refused now, with the units, rather than at load
        for name, unit in (("max_length", "tokens"), ("stride", "tokens"), ("max_layer", "a layer index")):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ModelLoadError(f"{name} must be an int ({unit}), got {value!r}")  # its range: by the model
        for name in ("allow_pickle", "trust_remote_code"):
            if not isinstance(getattr(self, name), bool):
                raise ModelLoadError(f"{name} must be True or False, got {getattr(self, name)!r}")

    # ---- JSON ----------------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModelOptions":
        """Build from :meth:`to_dict` output (names of layerwise 0.x are read as today's); unknown keys are refused,
        naming them and the valid ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        return cls(**fields_from(data, known, LEGACY_FIELDS, "ModelOptions", ModelLoadError))

    def to_json(self, path: str | Path | None = None) -> str:
        """The options as JSON text; also written to ``path`` when given."""
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "ModelOptions":
        """Read options from JSON text or a ``.json`` file."""
        return cls.from_dict(read_json_arg(text_or_path, "ModelOptions", ModelLoadError))

    def replace(self, **changes: Any) -> "ModelOptions":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def of(cls, model: "ModelOptions | str | os.PathLike | None" = None, **fields: Any) -> "ModelOptions":
        """``model`` itself when it is already options (``fields`` applied), else ``ModelOptions(model, **fields)``.

        ``dtype=`` (and ``torch_dtype=``), transformers' names for the compute dtype, are taken as ``compute_dtype``.

        Raises:
            ModelLoadError: an unknown field name (listing the valid ones) or value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        for alias, name in TRANSFORMERS_NAMES.items():  # transformers' names for the same option
            if alias in fields:
                value = fields.pop(alias)
                if name in fields and fields[name] != value:
                    raise ModelLoadError(f"{alias}={value!r} and {name}={fields[name]!r} name the same option "
                                         f"(transformers calls it {alias}); give one")
                fields[name] = value
        unknown = sorted(set(fields) - known)
        if unknown:
            hint = {k: LEGACY_FIELDS[k] for k in unknown if k in LEGACY_FIELDS}
            renamed = f" ({', '.join(f'{a!r} is now {b!r}' for a, b in hint.items())})" if hint else ""
            raise ModelLoadError(f"unknown model option(s) {unknown}{renamed}; valid options are: "
                                 f"{', '.join(sorted(known - {'model'}))}")
        if isinstance(model, ModelOptions):
            return model.replace(**fields) if fields else model
        return cls(model=_text(model, "model"), **fields)


__all__ = ["BACKEND_NAMES", "COMPUTE_DTYPES", "LEGACY_FIELDS", "ModelOptions", "QUANTIZE_MODES", "TRANSFORMERS_NAMES"]
