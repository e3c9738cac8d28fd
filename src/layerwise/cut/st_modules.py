"""The sentence-transformers files of an export: the same directory loads as ``SentenceTransformer(DIR)``.

The files use the keys and module names sentence-transformers reads from version 3.1 (module weights in
safetensors; version 6 reads them without warnings): ``modules.json`` naming
``sentence_transformers.models.Transformer`` (the directory itself), ``WeightedLayerPooling`` for a mix of layers,
``Pooling``, ``Dense`` (the model's pooler: its linear layer and tanh) and ``Normalize``;
``sentence_bert_config.json`` with the window (``max_seq_length``) and, for a mix (or a raw layer read below the
directory's last state, a "mix" of weights ``[1, 0]``),
``config_args: {"output_hidden_states": true}`` (so the Transformer module hands every layer to the mix while
``config.json`` stays as transformers writes it); and ``config_sentence_transformers.json`` with the prompt. Nothing
here imports sentence-transformers.

Example: a normalised mean of layers 2 and 3 of a 6-layer model is written as a 3-layer model and::

    modules.json: Transformer (""), WeightedLayerPooling ("1_WeightedLayerPooling": layer_start 2, weights
    [1, 1]), Pooling ("2_Pooling": mean), Normalize ("3_Normalize")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..errors import ExportError
from .plan import ST_POOLING_FLAGS, ExportPlan

FORMAT_VERSION = "3.1.0"  # the sentence-transformers release whose file format these files follow
PROMPT_NAME = "layerwise"


def _json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def write_st_files(plan: ExportPlan, width: int, directory: Path, pooler: torch.nn.Linear | None = None) -> list[str]:
    """Write the sentence-transformers files of ``plan`` into ``directory`` (which holds the cut model).

    Args:
        plan: the export.
        width: the model's hidden size (the vectors' length).
        directory: the export directory.
        pooler: for ``pool="pooler"``, the model's pooler linear layer ``[hidden] -> [hidden]`` (tanh follows it).

    Returns:
        The module types in ``modules.json`` order (``["Transformer", "Pooling", "Normalize"]``...).
    """
    modules: list[tuple[str, str]] = [("Transformer", "")]
    bert_config: dict[str, Any] = {"max_seq_length": plan.window, "do_lower_case": False}
    if plan.mix_start is not None:
        folder = f"{len(modules)}_WeightedLayerPooling"
        modules.append(("WeightedLayerPooling", folder))
        _json(directory / folder / "config.json", {"word_embedding_dimension": width, "layer_start": plan.mix_start,
                                                   "num_hidden_layers": plan.kept})
        weights = torch.tensor(plan.mix_weights, dtype=torch.float32)
        save_file({"layer_weights": weights}, str(directory / folder / "model.safetensors"))
        bert_config["config_args"] = {"output_hidden_states": True}
    folder = f"{len(modules)}_Pooling"
    modules.append(("Pooling", folder))
    pool = "cls" if plan.spec.pool == "pooler" else str(plan.spec.pool)
    pooling = {"word_embedding_dimension": width,
               **{flag: mode == pool for mode, flag in ST_POOLING_FLAGS.items()},
               "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
               "include_prompt": True}
    _json(directory / folder / "config.json", pooling)
    if plan.spec.pool == "pooler":
        if pooler is None:
            raise ExportError("pool='pooler' needs the model's pooler layer (pass it as pooler=)")
        folder = f"{len(modules)}_Dense"
        modules.append(("Dense", folder))
        _json(directory / folder / "config.json", {"in_features": pooler.in_features, "out_features":
                                                   pooler.out_features, "bias": pooler.bias is not None,
                                                   "activation_function": "torch.nn.modules.activation.Tanh"})
        # the mix reaches the pooler as mix_scale times layerwise's: the dense weights make up for it exactly
        tensors = {"linear.weight": (pooler.weight.detach().float() / plan.mix_scale).contiguous()}
        if pooler.bias is not None:
            tensors["linear.bias"] = pooler.bias.detach().float().contiguous()
        save_file(tensors, str(directory / folder / "model.safetensors"))
    if plan.spec.normalize:
        folder = f"{len(modules)}_Normalize"
        modules.append(("Normalize", folder))
        (directory / folder).mkdir(exist_ok=True)
    _json(directory / "modules.json", [{"idx": i, "name": str(i), "path": path,
                                        "type": f"sentence_transformers.models.{kind}"}
                                       for i, (kind, path) in enumerate(modules)])
    _json(directory / "sentence_bert_config.json", bert_config)
    config: dict[str, Any] = {"__version__": {"sentence_transformers": FORMAT_VERSION},
                              "prompts": {PROMPT_NAME: plan.spec.prompt} if plan.spec.prompt else {},
                              "default_prompt_name": PROMPT_NAME if plan.spec.prompt else None,
                              "similarity_fn_name": "cosine"}
    _json(directory / "config_sentence_transformers.json", config)
    return [kind for kind, _ in modules]


__all__ = ["FORMAT_VERSION", "PROMPT_NAME", "write_st_files"]
