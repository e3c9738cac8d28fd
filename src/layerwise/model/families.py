"""The table of BERT-family encoders: where each site lives in their modules (the fast path).

Any other architecture is discovered and verified at load time (:mod:`layerwise.model.discovery`); this table stays
the fast path (no check at load) and the place for the sub-layer sites of these seven families. One table maps
the site names of :mod:`layerwise.encoding.layers` to each family's modules (paths are relative to the module that
implements one encoder layer). The ``attention`` and ``intermediate`` sites read the module's
output, or its first element when the module returns a tuple; ``pre_ln`` reads the first input of the module,
with a forward pre-hook:

============  ======================================  =================  ==================  =========================
family        layer module (``hidden_states`` class)  ``attention``      ``intermediate``    ``pre_ln``
============  ======================================  =================  ==================  =========================
bert          ``encoder.layer[i]`` (BertLayer)        ``attention``      ``intermediate``    ``output.LayerNorm``
roberta       ``encoder.layer[i]`` (RobertaLayer)     ``attention``      ``intermediate``    ``output.LayerNorm``
xlm-roberta   ``encoder.layer[i]`` (XLMRobertaLayer)  ``attention``      ``intermediate``    ``output.LayerNorm``
electra       ``encoder.layer[i]`` (ElectraLayer)     ``attention``      ``intermediate``    ``output.LayerNorm``
deberta-v2    ``encoder.layer[i]`` (DebertaV2Layer)   ``attention``      ``intermediate``    ``output.LayerNorm``
distilbert    ``transformer.layer[i]``                ``sa_layer_norm``  ``ffn.activation``  ``output_layer_norm``
              (TransformerBlock)
albert        ``encoder.albert_layer_groups[g]``      ``attention``      ``activation``      ``full_layer_layer_norm``
              ``.albert_layers[j]`` (AlbertLayer,
              shared: called once per layer)
============  ======================================  =================  ==================  =========================

Layer ``0`` (``block`` site only) is the input of the first layer call, and layer ``i`` is the output of the
``i``-th call of a layer module, exactly as transformers records ``hidden_states``. This also covers ALBERT,
whose single shared layer module runs ``L`` times. DeBERTa-v2 checkpoints with a convolution after the first
layer (``conv_kernel_size > 0``) record ``encoder.conv``'s output as layer 1, as transformers does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..errors import ModelLoadError


@dataclass(frozen=True)
class Family:
    """How to find layers, sites and the pooler in one model family."""

    name: str
    model_types: tuple[str, ...]
    layer_paths: tuple[str, ...]  # module paths (may contain '*') holding the layer modules
    sites: dict[str, tuple[str, str]] = field(default_factory=dict)  # site -> (relative path, "out"|"in")
    position_offset: int = 0  # positions reserved before the first token (RoBERTa: padding_idx + 1)
    pooler: Callable[[nn.Module], Callable[[torch.Tensor], torch.Tensor] | None] | None = None

    def num_layers(self, config) -> int:
        """``L``: the number of layer calls (``hidden_states`` has ``L + 1`` entries)."""
        if self.name == "albert":
            return int(config.num_hidden_layers) * int(getattr(config, "inner_group_num", 1))
        return int(getattr(config, "num_hidden_layers", getattr(config, "n_layers", 0)))

    def max_positions(self, config) -> int:
        """Longest input (special tokens included) the position embeddings allow."""
        return int(config.max_position_embeddings) - self.position_offset


def _bert_pooler(model: nn.Module):
    pooler = getattr(model, "pooler", None)
    if pooler is None:
        return None
    return lambda cls: pooler.activation(pooler.dense(cls))


def _albert_pooler(model: nn.Module):
    pooler = getattr(model, "pooler", None)
    if pooler is None:
        return None
    # pooler_activation is a transformers submodule that mypy sees through nn.Module.__getattr__ (Tensor | Module)
    return lambda cls: model.pooler_activation(pooler(cls))  # type: ignore[operator]


_BERT_SITES = {
    "attention": ("attention", "out"),
    "intermediate": ("intermediate", "out"),
    "pre_ln": ("output.LayerNorm", "in"),
}

FAMILIES: tuple[Family, ...] = (
    Family("bert", ("bert",), ("encoder.layer",), _BERT_SITES, 0, _bert_pooler),
    Family("roberta", ("roberta", "camembert"), ("encoder.layer",), _BERT_SITES, 2, _bert_pooler),
    Family("xlm-roberta", ("xlm-roberta",), ("encoder.layer",), _BERT_SITES, 2, _bert_pooler),
    Family("electra", ("electra",), ("encoder.layer",), _BERT_SITES, 0, None),
    Family("deberta-v2", ("deberta-v2",), ("encoder.layer",), _BERT_SITES, 0, None),
    Family(
        "distilbert",
        ("distilbert",),
        ("transformer.layer",),
        {
            "attention": ("sa_layer_norm", "out"),
            "intermediate": ("ffn.activation", "out"),
            "pre_ln": ("output_layer_norm", "in"),
        },
        0,
        None,
    ),
    Family(
        "albert",
        ("albert",),
        ("encoder.albert_layer_groups.*.albert_layers",),
        {
            "attention": ("attention", "out"),
            "intermediate": ("activation", "out"),
            "pre_ln": ("full_layer_layer_norm", "in"),
        },
        0,
        _albert_pooler,
    ),
)

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)


def table_family(model_type: str) -> Family | None:
    """The table row of a config's ``model_type``, or ``None`` (the model's layers are then discovered)."""
    for fam in FAMILIES:
        if model_type in fam.model_types:
            return fam
    return None


def resolve_path(root: nn.Module, path: str) -> list[nn.Module]:
    """The modules at a dotted ``path`` under ``root`` (``*`` = every child, digits index a list).

    Raises:
        ValueError: a part of the path is missing, naming it.
    """
    mods = [root]
    for part in path.split("."):
        nxt: list[nn.Module] = []
        for m in mods:
            if part == "*":
                nxt.extend(m.children())
            elif part.isdigit():
                if not isinstance(m, (nn.ModuleList, nn.Sequential)) or int(part) >= len(m):
                    raise ModelLoadError(f"module path {path!r} not found in {type(root).__name__} (no item {part})")
                nxt.append(m[int(part)])
            else:
                child = getattr(m, part, None)
                if child is None:
                    raise ModelLoadError(f"module path {path!r} not found in {type(root).__name__} (missing {part!r})")
                nxt.append(child)
        mods = nxt
    return mods


def layer_modules(family: Family, model: nn.Module) -> list[nn.Module]:
    """Distinct modules that implement one encoder layer, in order (ALBERT: the shared ones)."""
    out: list[nn.Module] = []
    for path in family.layer_paths:
        for container in resolve_path(model, path):
            out.extend(container.children() if isinstance(container, nn.ModuleList) else [container])
    seen: set[int] = set()
    distinct: list[nn.Module] = []
    for m in out:
        if id(m) not in seen:
            seen.add(id(m))
            distinct.append(m)
    return distinct


def site_module(family: Family, layer: nn.Module, site: str) -> tuple[nn.Module, str]:
    """The sub-module realising ``site`` inside one layer module, and whether to read its output or input."""
    path, where = family.sites[site]
    return resolve_path(layer, path)[0], where


def post_layer1_override(family: Family, model: nn.Module) -> nn.Module | None:
    """DeBERTa-v2's convolution applied after layer 1: its output is ``hidden_states[1]``."""
    if family.name != "deberta-v2":
        return None
    return getattr(getattr(model, "encoder", None), "conv", None)
