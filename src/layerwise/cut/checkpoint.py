"""A loaded model cut after layer ``K`` and written as a standard Hugging Face directory.

The cut changes the config's layer count (``num_hidden_layers``, which transformers maps to each architecture's own
name: GPT-2's ``n_layer``, T5's ``num_layers``, DistilBERT's ``n_layers``) and any per-layer list in it
(``layer_types``), and keeps the first ``K`` modules of the layer list (ALBERT's one shared layer is kept as it is:
it is called ``K`` times). Everything around the layers stays: embeddings, relative-position tables, DeBERTa-v2's
convolution and the final norm. The weights are written in safetensors in the narrowest of float32, bfloat16 and
float16 that holds every one of them exactly (a checkpoint stored in bfloat16 stays bfloat16; nothing is rounded).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import LayerwiseError
from ..model.depth import ENCODER_CLASSES, PER_LAYER_CONFIG_LISTS
from ..model.families import resolve_path
from ..model.loaded import LoadedModel
from ..model.loading import quiet_transformers
from ..model.memory import available_memory
from .plan import ModelFacts


def model_facts(loaded: LoadedModel, window: int | None = None) -> ModelFacts:
    """What :func:`~layerwise.cut.plan.plan_export` needs to know about ``loaded`` (``window``: the longest input in
    tokens, default the model's)."""
    config = loaded.model.config
    model_type = str(getattr(config, "model_type", "") or "")
    groups = (int(getattr(config, "num_hidden_groups", 1)), int(getattr(config, "inner_group_num", 1)))
    return ModelFacts(
        architecture=loaded.architecture,
        model_type=model_type,
        num_layers=loaded.num_layers,
        final_norm=loaded.layer_map.final_path if loaded.layer_map.final is not None else None,
        conv_after_first=loaded.layer_map.after_first is not None,
        layer_path=loaded.layer_map.path,
        encoder_decoder=bool(getattr(config, "is_encoder_decoder", False)),
        encoder_class=ENCODER_CLASSES.get(model_type),
        albert_groups=groups if loaded.architecture == "albert" else (1, 1),
        window=window or loaded.window,
        pooler=pooler_linear(loaded.model),
    )


def pooler_linear(model: nn.Module) -> str | None:
    """The module path of a BERT-style pooler's linear layer when tanh follows it (BERT, RoBERTa, XLM-R, MPNet:
    ``pooler.dense`` with ``pooler.activation``; ALBERT: ``pooler`` with ``pooler_activation``), else ``None``."""
    pooler = getattr(model, "pooler", None)
    candidates = [("pooler.dense", getattr(pooler, "dense", None), getattr(pooler, "activation", None)),
                  ("pooler", pooler, getattr(model, "pooler_activation", None))]
    for path, linear, activation in candidates:
        if isinstance(linear, nn.Linear) and isinstance(activation, nn.Tanh):
            return path
    return None


def cut_model(loaded: LoadedModel, depth: int) -> None:
    """Cut ``loaded.model`` after layer ``depth`` in place: the config's layer count and the layer list.

    Raises:
        LayerwiseError: the layer list is not a list of modules that can be cut (a module path that names
            something else).
    """
    if loaded.streams(depth):
        raise LayerwiseError(f"layers 0..{depth} exceed max_memory; an export writes them from memory: raise "
                             f"max_memory (CLI --max-memory) or drop it")
    loaded.ensure_depth(min(depth, loaded.num_layers))  # blocks not in memory yet are read now (loaded by depth)
    model: Any = loaded.model  # a transformers PreTrainedModel (config)
    config = model.config
    total = loaded.num_layers
    if loaded.architecture != "albert":  # ALBERT's shared layer is called num_hidden_layers times: keep it
        path = loaded.layer_map.path
        parent_path, _, name = path.rpartition(".")
        parent = resolve_path(model, parent_path)[0] if parent_path else model
        layers = getattr(parent, name, None)
        if not isinstance(layers, (nn.ModuleList, nn.Sequential)) or len(layers) != total:
            raise LayerwiseError(
                f"the layer list {path!r} of this model is not a list of {total} modules, so it cannot be cut "
                f"after layer {depth}; pass layer_modules= (CLI --layer-modules) naming the model's layer list")
        kept: Any = list(layers)[:depth]
        setattr(parent, name, nn.ModuleList(kept) if isinstance(layers, nn.ModuleList) else nn.Sequential(*kept))
    config.num_hidden_layers = depth
    for key in PER_LAYER_CONFIG_LISTS:
        value = getattr(config, key, None)
        if isinstance(value, (list, tuple)) and len(value) == total:
            setattr(config, key, list(value)[:depth])


def exact_dtype(model: nn.Module) -> torch.dtype:
    """The narrowest of float32, bfloat16 and float16 that holds every floating weight of ``model`` exactly."""
    tensors = [t for t in model.state_dict().values() if t.is_floating_point()]
    for dtype in (torch.bfloat16, torch.float16):
        if tensors and all(torch.equal(t.to(dtype).to(t.dtype), t) for t in tensors):
            return dtype
    return torch.float32


def write_checkpoint(loaded: LoadedModel, directory: Path, record: dict[str, Any]) -> torch.dtype:
    """Write the (cut) model, its config and its tokenizer to ``directory`` (safetensors); return the weights' dtype.

    Args:
        loaded: the model, already cut (:func:`cut_model`).
        directory: an empty directory.
        record: what the config keeps under ``"layerwise"`` (the source, the layers, the site, the final norm).
    """
    model: Any = loaded.model  # a transformers PreTrainedModel (save_pretrained)
    dtype = exact_dtype(model)
    model.config.layerwise = record
    if dtype != torch.float32:
        model.to(dtype)
    try:
        with quiet_transformers():
            model.save_pretrained(directory, safe_serialization=True)
    finally:
        if dtype != torch.float32:
            model.to(torch.float32)
    tokenizer = loaded.tokenizer
    side = tokenizer.padding_side
    tokenizer.padding_side = "right"  # as layerwise pads: a left-padding tokenizer would put pads where cls reads
    try:
        tokenizer.save_pretrained(directory)
    finally:
        tokenizer.padding_side = side
    return dtype


def weights_bytes(model: nn.Module) -> int:
    """Bytes of the model's weights (each tensor once), to check the free disk space before writing."""
    seen: set[int] = set()
    total = 0
    for tensor in model.state_dict().values():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


def check_memory(needed: int) -> None:
    """Refuse to start the check when less than ``needed`` bytes (plus 20%) of memory are available: it loads the
    written model once with transformers and once with sentence-transformers, one after the other."""
    free = available_memory()
    if free is not None and free < needed * 1.2:
        raise LayerwiseError(
            f"checking the export loads it again (about {needed / 2**20:,.0f} MiB) and {free / 2**20:,.0f} MiB of "
            f"memory is available; close other programs or export on a machine with more memory")


def check_free_space(directory: Path, needed: int) -> None:
    """Refuse to start when the disk holding ``directory`` has less than ``needed`` bytes (plus 10%) free."""
    free = shutil.disk_usage(directory).free
    if free < needed * 1.1:
        raise LayerwiseError(
            f"the export needs about {needed / 2**20:,.0f} MiB and {directory} has {free / 2**20:,.0f} MiB free; free "
            f"some space or write the export elsewhere (-o)")


__all__ = ["check_free_space", "check_memory", "cut_model",
           "exact_dtype", "model_facts", "pooler_linear", "weights_bytes", "write_checkpoint"]
