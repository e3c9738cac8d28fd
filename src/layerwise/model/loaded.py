"""``LoadedModel``: a loaded model, its tokenizer, and the facts layerwise needs about it (layer map, widths,
positions, window, how to call it). Every backend holds one; loaders (:mod:`layerwise.model.loading`,
:mod:`layerwise.model.custom`, the TensorFlow backends) fill it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..encoding.vocab import SITES
from ..errors import ModelLoadError
from .blocks import Blocks
from .discovery import ModelCall, transformers_call
from .layermap import LayerMap
from .positions import Positions


@dataclass
class LoadedModel:
    """A loaded model with its tokenizer and the facts layerwise needs about it.

    Attributes:
        model: the PyTorch model (a transformers base model, the encoder of an encoder-decoder, or any module), in
            eval mode on ``device``.
        tokenizer: its fast tokenizer (offsets and word ids are needed).
        layer_map: where its layers and sites are (:class:`~layerwise.model.layermap.LayerMap`).
        name: the path or hub id it was loaded from.
        num_layers: ``L``; ``hidden_states`` has ``L + 1`` entries (0 = embeddings).
        site_widths: feature width of every site the model has (``block`` and ``raw`` always).
        positions: the kind of positions and the architecture's real maximum
            (:class:`~layerwise.model.positions.Positions`).
        max_length: longest window in tokens, special tokens included (``positions.max_length``).
        window: the default window: ``max_seq_length`` of the model's ``sentence_bert_config.json`` when the
            directory has one (sentence-transformers models are trained and used at that length, e.g. 256 for
            all-MiniLM-L6-v2), else ``max_length``.
        call: how to run the model: ``call(model, input_ids, attention_mask, **extra)``.
        pooler: the model's pooler ``[batch, hidden] -> [batch, hidden]`` (BERT-style), or ``None``.
        accepts_position_ids: the model's forward takes ``position_ids`` (needed for left padding).
        blocks: which layer modules hold weights (:class:`~layerwise.model.blocks.Blocks`) when the model was loaded
            by depth from a local safetensors checkpoint; ``None``: every weight is in memory.
    """

    model: nn.Module
    tokenizer: Any
    layer_map: LayerMap
    name: str
    num_layers: int
    site_widths: dict[str, int]
    positions: Positions
    device: torch.device
    dtype: torch.dtype
    window: int = 0  # 0: max_length
    call: ModelCall = transformers_call
    pooler: Callable[[torch.Tensor], torch.Tensor] | None = None
    accepts_position_ids: bool = False
    blocks: Blocks | None = field(default=None, repr=False)
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)  # one capture at a time

    def __post_init__(self) -> None:
        if not 0 < self.window <= self.max_length:
            self.window = self.max_length

    @property
    def max_length(self) -> int:
        """Longest window in tokens, special tokens included."""
        return self.positions.max_length

    @property
    def architecture(self) -> str:
        """``"bert"``, ``"llama"``, ``"t5"``, ``"module"``...: the layer map's name."""
        return self.layer_map.name

    @property
    def hidden_size(self) -> int:
        """Width of the ``block`` site."""
        return self.site_widths["block"]

    @property
    def intermediate_size(self) -> int:
        """Width of the ``intermediate`` site (0 when the model has none)."""
        return self.site_widths.get("intermediate", 0)

    @property
    def sites(self) -> tuple[str, ...]:
        """The sites this model has, in the order of :data:`layerwise.encoding.vocab.SITES`."""
        return tuple(s for s in SITES if s in self.site_widths)

    @property
    def causal(self) -> bool:
        """Whether this is a decoder-only model (:func:`decoder_only` of its transformers config): each token attends
        only to the tokens before it, so its first token is no summary of a text (``pool="cls"`` is refused)."""
        return decoder_only(getattr(self.model, "config", None))

    @property
    def resident_depth(self) -> int:
        """The deepest layer whose weights are all in memory now (``num_layers`` when the whole model is)."""
        return self.num_layers if self.blocks is None else min(self.num_layers, self.blocks.resident)

    def ensure_depth(self, depth: int) -> None:
        """Load the blocks layers ``0..depth`` need that are not in memory yet (nothing when the whole model is).

        Raises:
            ModelLoadError: past ``max_layer``, or the blocks do not fit in memory (with the numbers).
        """
        if self.blocks is not None:
            with self.lock:
                self.blocks.ensure(depth)

    def streams(self, depth: int) -> bool:
        """Whether layers ``0..depth`` run block by block over chunks of batches (their weights exceed
        ``max_memory``; see :func:`layerwise.model.capture.capture_chunk`)."""
        return self.blocks is not None and self.blocks.streams(depth)

    def fingerprint(self) -> str:
        """sha256 over every weight's name, shape and float32 value: the blocks not in memory are read from the
        checkpoint (:meth:`~layerwise.model.blocks.Blocks.state_items`), so the value is the whole model's."""
        from ..provenance import tensors_fingerprint

        with self.lock:  # never while a streamed chunk has blocks replaced
            state = self.model.state_dict()
        if self.blocks is None:
            return tensors_fingerprint(state)
        return tensors_fingerprint(self.blocks.state_items(state, self.layer_map.path))

    def site_width(self, site: str) -> int:
        """Feature width of one site (``ValueError`` naming the model's sites for one it lacks)."""
        if site not in self.site_widths:
            raise ModelLoadError(
                f"this {self.architecture} model has no site {site!r}; its sites are: {', '.join(self.sites)}"
            )
        return self.site_widths[site]


def decoder_only(config: Any) -> bool:
    """Whether a transformers ``config`` describes a decoder-only model (GPT-2, Llama, Mistral, Qwen, Gemma, OPT,
    BLOOM...): its model type has a causal language-model class in transformers and no masked one (BERT-likes have
    both; an encoder-decoder loads its encoder, which is not causal). ``False`` for anything else (a module that is
    not from transformers, a config without ``model_type``)."""
    model_type = getattr(config, "model_type", None)
    if not isinstance(model_type, str) or getattr(config, "is_encoder_decoder", False):
        return False
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_MASKED_LM_MAPPING_NAMES,
    )

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and model_type not in MODEL_FOR_MASKED_LM_MAPPING_NAMES


__all__ = ["LoadedModel", "decoder_only"]
