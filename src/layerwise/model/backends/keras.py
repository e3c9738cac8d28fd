"""The Keras backend: keras-hub text backbones (Keras 3), with early exit by graph construction.

A keras-hub backbone is a functional Keras model whose blocks are layers named ``transformer_layer_{i}``
(``BertBackbone``, ``RobertaBackbone``, ``DistilBertBackbone``, ``ElectraBackbone``, ``GPT2Backbone``...). For a set of
requested layers this backend builds a functional sub-model from the backbone's inputs to exactly those outputs:
layer 0 is the first block's input (the embeddings output), layer ``i`` the output of ``transformer_layer_{i-1}``.
A functional model holds only the layers its outputs depend on, so asking for layer ``k`` computes no block after
``k``. Sub-models are built once per set of layers and kept.

Where the backbone comes from:

* a keras-hub preset directory (``config.json`` naming a keras-hub class, ``model.weights.h5``), as saved by
  ``backbone.save_to_preset(dir)``;
* a local Hugging Face directory (safetensors), converted by keras-hub on load (``Backbone.from_preset(dir)``):
  the embedded default model works this way. keras-hub builds BERT-style blocks with the tanh approximation of GELU;
  when the checkpoint's own ``config.json`` says ``hidden_act: "gelu"`` (the exact one, as transformers computes it)
  the converted blocks are given the exact GELU back, so the layers agree with the PyTorch backend to ~1e-5 instead
  of drifting by ~1e-3 per layer (``exact_gelu=False`` keeps keras-hub's approximation).

The tokenizer is the directory's Hugging Face fast tokenizer (offsets and word ids are needed); a keras-hub preset
without one gets a WordPiece tokenizer built from its ``assets/tokenizer/vocabulary.txt``. Needs the optional extra:
``pip install 'layerwise[tf]'`` (Keras 3, keras-hub, TensorFlow). CPU, float32, site ``block``.

Example::

    >>> ex = lw.Extractor(backend="keras")                    # the embedded model, converted to keras-hub
    >>> ex.encode(["I love Paris"], layers="-4:", combine="concat").shape
    (1, 1536)
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ...errors import ModelLoadError
from ...extras import require
from ..layermap import LayerMap
from ..loaded import LoadedModel
from ..loading import (
    DEFAULT_MODEL_NAME,
    TOKENIZER_FILES,
    default_model_path,
    ensure_pad_token,
    is_default_alias,
    sentence_transformers_length,
)
from ..options import ModelOptions
from ..positions import UNLIMITED, Positions
from .base import Backend, refuse_options

BLOCK = re.compile(r"^transformer_layer_(\d+)$")


def require_keras() -> tuple[Any, Any]:
    """``(keras, keras_hub)``; :class:`~layerwise.MissingExtraError` naming the ``[tf]`` extra when missing."""
    what, packages = "backend='keras'", "TensorFlow, Keras 3 and keras-hub"
    return require("keras", what=what, extra="tf", packages=packages), require("keras_hub", what=what, extra="tf",
                                                                               packages=packages)


def is_keras_preset(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a keras-hub preset directory (its ``config.json`` names a keras-hub class)."""
    cfg = Path(path) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and str(data.get("module", "")).startswith(("keras_hub", "keras_nlp"))


def _local_dir(model: str | os.PathLike | None) -> Path:
    if model is None or is_default_alias(model):  # the default model's hub ids: the embedded copy
        return Path(default_model_path())
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a local directory path, got {type(model).__name__}")
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ModelLoadError(
            f"backend='keras' loads a local directory (a keras-hub preset, or a Hugging Face checkpoint that keras-hub "
            f"converts); {os.fspath(model)!r} is not one"
        )
    return path


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer, BertTokenizer

    if not is_keras_preset(path) and any((path / name).exists() for name in TOKENIZER_FILES):
        tok = AutoTokenizer.from_pretrained(str(path))
    else:
        vocab = path / "assets" / "tokenizer" / "vocabulary.txt"
        if not vocab.is_file():
            raise ModelLoadError(
                f"{path} has no tokenizer layerwise can use (no {', '.join(TOKENIZER_FILES)}, no "
                f"assets/tokenizer/vocabulary.txt); save the model's Hugging Face tokenizer into the directory"
            )
        settings = _json(path / "tokenizer.json").get("config", {}) if (path / "tokenizer.json").exists() else {}
        tok = BertTokenizer(vocab=str(vocab), do_lower_case=bool(settings.get("lowercase", True)))
    if not getattr(tok, "is_fast", False):
        raise ModelLoadError(f"the tokenizer in {path} is not a fast tokenizer (offsets and word ids are needed)")
    ensure_pad_token(tok)
    return tok


def _json(path: Path) -> dict:
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


class KerasBackend(Backend):
    """A keras-hub backbone behind the seam; see the module docstring.

    Args:
        loaded: the facts (tokenizer, layers, width, positions) with ``loaded.model`` the Keras backbone.
    """

    name = "keras"
    sites = ("block",)
    runs = "runs float32 on the CPU (a local directory)"

    def __init__(self, loaded: LoadedModel):
        model: Any = loaded.model  # a Keras model, held where torch backends hold their module
        if isinstance(model, torch.nn.Module):
            raise ModelLoadError("backend='keras' loads its own model: pass the model directory (a keras-hub "
                                 "preset or a Hugging Face directory), not an already loaded PyTorch model")
        super().__init__(loaded)
        self.keras, _ = require_keras()
        self.backbone = model
        self.blocks = block_layers(self.backbone)
        self.input_names = [t.name for t in self.backbone.inputs]
        self._subs: dict[tuple[int, ...], Any] = {}
        self._runners: dict[tuple[int, ...], Any] = {}

    @classmethod
    def load(cls, options: ModelOptions, *, exact_gelu: bool = True) -> "KerasBackend":
        """Load a keras-hub preset or convert a local Hugging Face directory (``options.model``; ``None``: the
        embedded model). Options other than ``model``, ``max_length`` and ``stride`` are refused.

        ``exact_gelu``: give converted blocks the checkpoint's exact GELU back (see the module docstring).
        """
        refuse_options(cls, options)
        model = options.model
        _, keras_hub = require_keras()
        path = _local_dir(model)
        try:
            backbone = keras_hub.models.Backbone.from_preset(str(path))
        except Exception as exc:  # keras-hub's converters raise many kinds (SafetensorError, KeyError, ValueError...)
            reason = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise ModelLoadError(
                f"keras-hub cannot load {str(path)!r} as a backbone ({type(exc).__name__}: {reason}). Its converters "
                f"read Hugging Face checkpoints of the architectures keras-hub implements, as saved by their full "
                f"model classes; use backend='torch' for this one"
            ) from exc
        blocks = block_layers(backbone)
        if not blocks:
            raise ModelLoadError(
                f"{type(backbone).__name__} has no blocks named transformer_layer_0..; backend='keras' reads keras-hub "
                f"text backbones with per-layer blocks (BertBackbone, RobertaBackbone, GPT2Backbone...)"
            )
        if exact_gelu and _hf_activation(path) == "gelu":
            use_exact_gelu(blocks)
        config = backbone.get_config()
        max_len = int(config.get("max_sequence_length") or UNLIMITED)
        tokenizer = _tokenizer(path)
        tok_max = getattr(tokenizer, "model_max_length", None)
        if isinstance(tok_max, int) and 0 < tok_max < max_len:
            max_len = tok_max
        hidden = int(blocks[0].output.shape[-1])
        loaded = LoadedModel(
            model=backbone,
            tokenizer=tokenizer,
            layer_map=LayerMap(type(backbone).__name__, "given", "transformer_layer_*", []),
            name=DEFAULT_MODEL_NAME if model is None else os.fspath(model),
            num_layers=len(blocks),
            site_widths={"block": hidden},
            positions=Positions("absolute", max_len),
            device=torch.device("cpu"),
            dtype=torch.float32,
            window=sentence_transformers_length(path) or 0,
        )
        return cls(loaded)

    def fingerprint(self) -> str:
        """sha256 over the backbone's weights (paths, shapes, float32 values)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for w in sorted(self.backbone.weights, key=lambda w: w.path):
                value = np.asarray(_numpy(self.keras, w), dtype=np.float32)
                h.update(w.path.encode())
                h.update(str(value.shape).encode())
                h.update(value.tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def submodel(self, layers: Sequence[int]) -> Any:
        """The functional model from the backbone's inputs to ``layers`` (sorted, distinct), built once."""
        key = tuple(sorted(set(layers)))
        if key not in self._subs:
            outputs = [_block_input(self.blocks[0]) if i == 0 else self.blocks[i - 1].output for i in key]
            self._subs[key] = self.keras.Model(self.backbone.inputs, outputs, name=f"layerwise_layers_{max(key)}")
        return self._subs[key]

    def runner(self, layers: Sequence[int]) -> Any:
        """The sub-model as one traced graph on the TensorFlow backend (``tf.function`` with shape relaxation, so
        batches of new shapes do not retrace each time); the sub-model itself on other Keras backends."""
        key = tuple(sorted(set(layers)))
        if key not in self._runners:
            sub = self.submodel(key)
            if self.keras.backend.backend() == "tensorflow":
                import tensorflow as tf

                self._runners[key] = tf.function(lambda feed: sub(feed, training=False), reduce_retracing=True)
            else:
                self._runners[key] = lambda feed: sub(feed, training=False)
        return self._runners[key]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, hidden]`` from the backbone cut after the deepest requested layer."""
        key = tuple(sorted(set(layers)))
        ids = input_ids.cpu().numpy().astype(np.int32)
        feed = {"token_ids": ids, "padding_mask": attention_mask.cpu().numpy().astype(np.int32),
                "segment_ids": np.zeros_like(ids)}
        outs = self.runner(key)({k: v for k, v in feed.items() if k in self.input_names})
        outs = outs if isinstance(outs, (list, tuple)) else [outs]
        by_layer = {i: torch.from_numpy(np.asarray(_numpy(self.keras, o), dtype=np.float32)) for i, o in zip(key, outs)}
        return torch.stack([by_layer[i] for i in layers])


def _hf_activation(path: Path) -> str | None:
    """``hidden_act`` of a Hugging Face ``config.json`` in ``path`` (``None`` for a keras-hub preset)."""
    if is_keras_preset(path) or not (path / "config.json").is_file():
        return None
    value = _json(path / "config.json").get("hidden_act")
    return value if isinstance(value, str) else None


def use_exact_gelu(blocks: Sequence[Any]) -> None:
    """Set the feed-forward activation of keras-hub encoder blocks to the exact (erf) GELU."""
    import keras

    def gelu(x: Any) -> Any:
        return keras.activations.gelu(x, approximate=False)

    for block in blocks:
        dense = getattr(block, "_feedforward_intermediate_dense", None)
        if dense is not None:
            dense.activation = gelu
            block.activation = gelu


def block_layers(backbone: Any) -> list[Any]:
    """The backbone's ``transformer_layer_{i}`` layers in order."""
    found = {int(m.group(1)): layer for layer in backbone.layers if (m := BLOCK.match(layer.name))}
    return [found[i] for i in sorted(found)] if sorted(found) == list(range(len(found))) else []


def _numpy(keras: Any, value: Any) -> np.ndarray:
    """A Keras variable or backend tensor as numpy (``.numpy()`` where the backend has it)."""
    return value.numpy() if hasattr(value, "numpy") else keras.ops.convert_to_numpy(value)


def _block_input(block: Any) -> Any:
    value = block.input
    return value[0] if isinstance(value, (list, tuple)) else value


__all__ = ["KerasBackend", "block_layers", "is_keras_preset", "require_keras"]
