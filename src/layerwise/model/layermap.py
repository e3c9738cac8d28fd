"""Where the layers of one loaded model are: the modules the capture hooks, and how their outputs become layers.

A :class:`LayerMap` is what :mod:`layerwise.model.capture` needs to record any site of any model: the layer modules in
call order, the sub-module of each sub-layer site, the module (if any) that transforms the last layer's output into
``hidden_states[L]`` (a decoder's final norm), and DeBERTa-v2's convolution after layer 1. It comes from one of three
sources, named in :attr:`LayerMap.source`:

* ``table``: a row of :mod:`layerwise.model.families` (the seven BERT-family encoders, the fast path: no check at load);
* ``discovered``: found by :mod:`layerwise.model.discovery` for any model ``AutoModel`` loads, and verified against
  ``output_hidden_states=True`` with one tiny forward pass at load time;
* ``given``: a module path or list the caller named (``layers=`` / ``Extractor.from_module``), verified as a chain
  (layer ``i + 1`` reads what layer ``i`` wrote).

The layer rule is the Hugging Face one: layer 0 is the input of the first layer call (the embeddings output),
layer ``i`` is the output of the ``i``-th layer call, except where the model itself says otherwise in
``hidden_states``: a ``final`` module (decoders' final norm, T5's ``final_layer_norm``, ModernBERT's ``final_norm``)
whose output is ``hidden_states[L]``, and DeBERTa-v2's convolution whose output is ``hidden_states[1]``. The ``raw``
site always gives the layer modules' own outputs (the state before the final norm at layer ``L``).

Example::

    >>> import layerwise as lw
    >>> lm = lw.Extractor().loaded
    >>> lm.layer_map.source, lm.layer_map.path, len(lm.layer_map.layers)
    ('table', 'encoder.layer', 6)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import nn

from .families import Family, layer_modules, post_layer1_override, resolve_path

Where = Literal["out", "in"]
Source = Literal["table", "discovered", "given"]


@dataclass
class LayerMap:
    """The modules of one loaded model that realise its layers and sites.

    Attributes:
        name: the architecture (``"bert"``, ``"llama"``, ``"module"``...).
        source: ``"table"``, ``"discovered"`` or ``"given"`` (see the module docstring).
        path: the module path of the layer list (``"encoder.layer"``, ``"layers"``), as written in messages.
        layers: the distinct layer modules in call order (ALBERT: its shared ones, called ``L`` times).
        sites: sub-layer site -> (path inside one layer module, read its ``"out"``put or first ``"in"``put).
        final: the module whose output is ``hidden_states[L]`` (applied after the last layer), or ``None``.
        final_path: its module path (for messages and ``describe()``).
        after_first: DeBERTa-v2's convolution after layer 1 (its output is ``hidden_states[1]``), or ``None``.
    """

    name: str
    source: Source
    path: str
    layers: list[nn.Module]
    sites: dict[str, tuple[str, Where]] = field(default_factory=dict)
    final: nn.Module | None = None
    final_path: str | None = None
    after_first: nn.Module | None = None

    def site_module(self, layer: nn.Module, site: str) -> tuple[nn.Module, Where]:
        """The sub-module realising ``site`` inside one layer module, and whether to read its output or input."""
        rel, where = self.sites[site]
        return resolve_path(layer, rel)[0], where


def map_from_family(family: Family, model: nn.Module) -> LayerMap:
    """The :class:`LayerMap` of a model whose architecture has a row in :data:`layerwise.model.families.FAMILIES`."""
    return LayerMap(
        name=family.name,
        source="table",
        path=family.layer_paths[0],
        layers=layer_modules(family, model),
        sites={site: (rel, "in" if where == "in" else "out") for site, (rel, where) in family.sites.items()},
        after_first=post_layer1_override(family, model),
    )


__all__ = ["LayerMap", "Source", "Where", "map_from_family"]
