"""The one description of a loaded model: what :meth:`Extractor.describe <layerwise.Extractor.describe>` returns,
what ``GET /v1/model`` of the service answers (with the service's own vocabularies and limits), and what a store's
manifest records about its model (:func:`model_identity`, the stable part a resume must match)."""

from __future__ import annotations

from typing import Any, Protocol

from .backends import Backend
from .positions import UNLIMITED

# the keys of a description that a store's manifest keeps as its model's identity (a resume must match them)
IDENTITY_KEYS = ("name", "family", "num_layers", "hidden_size", "backend", "precision")


class Described(Protocol):
    """What :func:`describe` reads (an :class:`~layerwise.Extractor` has it)."""

    backend: Backend
    max_length: int
    stride: int

    @property
    def sites(self) -> tuple[str, ...]: ...

    def site_width(self, site: str) -> int: ...


def describe(ex: Described) -> dict[str, Any]:
    """What layerwise knows about one loaded model, as a JSON-ready dict.

    Keys: ``name``, ``architecture`` (and ``family``, the same), ``num_layers`` (``L``), ``layers`` (``"0..L"``),
    ``hidden_size``, ``intermediate_size`` (0 when none), ``layer_map`` (where the layers are and how the map was
    found: ``table``, ``discovered`` (verified at load) or ``given``), ``final`` (the module whose output is
    ``hidden_states[L]``, e.g. a decoder's final norm; the ``raw`` site gives the state before it), ``sites`` (name
    -> width), ``positions`` (kind and real maximum), ``window`` and ``stride`` (tokens; ``window`` is ``None``
    without a limit), ``pooler``, ``padding_side``, ``device``, ``compute_dtype``, ``precision`` (the compute dtype,
    or ``int8``/``int8-weights``/``int8-full`` when quantised), ``backend``, for ``auto`` ``runtime`` (which runtime
    served what so far), ``weights`` (which blocks are in memory: ``resident_blocks`` of ``blocks``, the
    ``held_dtype``, ``weights_bytes`` in memory against ``checkpoint_bytes``, ``max_layer``, ``max_memory``, whether
    the whole model would be ``streamed``; :meth:`layerwise.model.blocks.Blocks.describe`), and for reduced
    precision ``fidelity`` (per depth served: the minimum cosine to float32 of
    every layer on the sample sentences, :mod:`layerwise.model.fidelity`; for ``int8-full`` also its ``calibration``
    report); for ``quantize="int8"`` under ``auto``, once timed, ``int8_timing`` (the int8 runtimes against float32 on
    this machine, :meth:`layerwise.model.backends.quantized.Int8Timing.measure`).
    """
    backend = ex.backend
    lm = backend.loaded
    lmap = lm.layer_map
    runtime = getattr(backend, "runtime", None)
    fidelity = getattr(backend, "fidelity", None)
    int8_timing = getattr(backend, "int8_timing", None)
    return {
        "name": lm.name,
        "architecture": lm.architecture,
        "family": lm.architecture,
        "num_layers": lm.num_layers,
        "layers": f"0..{lm.num_layers}",
        "hidden_size": lm.hidden_size,
        "intermediate_size": lm.intermediate_size,
        "layer_map": f"{lmap.path} ({lmap.source})",
        "final": lmap.final_path,
        "sites": {s: ex.site_width(s) for s in ex.sites},
        "positions": lm.positions.describe(),
        "window": ex.max_length if ex.max_length < UNLIMITED else None,
        "stride": ex.stride,
        "pooler": lm.pooler is not None,
        "padding_side": getattr(backend, "padding_side", "right"),
        "device": str(lm.device),
        "compute_dtype": str(lm.dtype).replace("torch.", ""),
        "precision": backend.precision,
        "backend": backend.name,
        "weights": lm.blocks.describe() if lm.blocks is not None else {"resident_blocks": lm.num_layers,
                                                                       "blocks": lm.num_layers, "loaded": "whole"},
        **({"runtime": runtime()} if callable(runtime) else {}),
        **({"fidelity": {str(d): f for d, f in sorted(fidelity.items())}} if fidelity else {}),
        **({"int8_timing": int8_timing} if int8_timing else {}),
    }


def model_identity(description: dict[str, Any], fingerprint: str) -> dict[str, Any]:
    """The ``model`` section of a store's manifest: the :data:`IDENTITY_KEYS` of a :func:`describe` result and the
    weights' fingerprint (what a resume must match: not the device, the window or which runtime won a race)."""
    return {"name": description["name"], "fingerprint": fingerprint,
            **{k: description[k] for k in IDENTITY_KEYS if k != "name"}}


__all__ = ["Described", "IDENTITY_KEYS", "describe", "model_identity"]
