"""How long an input one architecture takes: its kind of positions and its real maximum.

==============  =====================================================  ==========================================
kind            how positions enter the model                          longest window
==============  =====================================================  ==========================================
``absolute``    a learned position table (BERT, GPT-2, OPT, MPNet)     the table's size (minus RoBERTa-style
                                                                       reserved rows), capped by the tokenizer's
                                                                       ``model_max_length``
``rotary``      rotary embeddings (Llama, Mistral, Qwen, Gemma, Phi,   ``max_position_embeddings`` (the trained
                ModernBERT, GPT-NeoX)                                  context; usually far beyond any sentence)
``alibi``       linear attention biases (BLOOM, Falcon with alibi)     ``max_position_embeddings`` if set, else
                                                                       none
``relative``    relative attention buckets (T5, DeBERTa-v2)            none (:data:`UNLIMITED`)
==============  =====================================================  ==========================================

A text longer than the window is cut into overlapping windows (see :mod:`layerwise.encoding.tokenize`); "none" means no
window is ever needed (:data:`UNLIMITED` tokens). The maximum is a hard limit; the default window is shorter when
the model says so: the ``sentence_bert_config.json`` ``max_seq_length`` of a sentence-transformers directory, else
the tokenizer's ``model_max_length`` (512 for T5), see :mod:`layerwise.model.loading`. ``max_length=`` picks any
window up
to the maximum.

Example::

    >>> import layerwise as lw
    >>> positions_of(lw.Extractor().model, "bert")
    Positions(kind='absolute', max_length=512)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

PositionKind = Literal["absolute", "rotary", "alibi", "relative", "unknown"]
UNLIMITED = 1 << 20  # "no maximum": longer than any input layerwise will be given in one piece
_ROTARY_KEYS = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct", "partial_rotary_factor",
                "global_rope_theta")


@dataclass(frozen=True)
class Positions:
    """``kind`` of position information and ``max_length`` in tokens, special tokens included."""

    kind: PositionKind
    max_length: int

    def describe(self) -> str:
        """``"absolute, at most 512 tokens"`` / ``"relative, no maximum"``."""
        limit = "no maximum" if self.max_length >= UNLIMITED else f"at most {self.max_length} tokens"
        return f"{self.kind}, {limit}"


def _config_max(config: Any) -> int | None:
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"):
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _position_table(model: nn.Module) -> tuple[str, nn.Embedding] | None:
    """The learned absolute position table, if the model has one (``position_embeddings``, ``wpe``...)."""
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Embedding) and last in ("position_embeddings", "wpe", "embed_positions"):
            return name, module
    return None


def _reserved_rows(model: nn.Module, table_name: str) -> int:
    """Rows a RoBERTa-style table keeps before the first position (``padding_idx + 1``), else 0."""
    owner_name = table_name.rsplit(".", 1)[0] if "." in table_name else ""
    owner = model.get_submodule(owner_name) if owner_name else model
    pad = getattr(owner, "padding_idx", None)
    table = model.get_submodule(table_name)
    # RoBERTa/MPNet embeddings count positions from padding_idx + 1 (the table's own padding_idx says so too)
    return pad + 1 if isinstance(pad, int) and getattr(table, "padding_idx", None) == pad else 0


def positions_of(model: nn.Module, model_type: str, config: Any = None, tokenizer: Any = None) -> Positions:
    """The :class:`Positions` of a loaded model (any architecture); see the table above.

    Args:
        model: the loaded module (its position table is looked for by name).
        model_type: the config's ``model_type``.
        config: the transformers config (``None`` for a module that is not from transformers).
        tokenizer: its tokenizer (``model_max_length`` caps an absolute table; sentinel values are ignored).
    """
    config = config if config is not None else getattr(model, "config", None)
    cfg_max = _config_max(config) if config is not None else None
    tok_max = getattr(tokenizer, "model_max_length", None)
    tok_max = tok_max if isinstance(tok_max, int) and 0 < tok_max < UNLIMITED else None
    table = _position_table(model)
    if table is not None:
        name, module = table
        usable = module.num_embeddings - _reserved_rows(model, name)
        if cfg_max is not None and getattr(module, "offset", None) is not None:
            usable = cfg_max  # OPT: the table holds max_position_embeddings + offset rows
        return Positions("absolute", min(usable, tok_max) if tok_max else usable)
    rotary = config is not None and any(getattr(config, k, None) is not None for k in _ROTARY_KEYS)
    rotary = rotary or any("rotary" in type(m).__name__.lower() for m in model.modules())
    if rotary:
        return Positions("rotary", cfg_max or UNLIMITED)
    if model_type in ("bloom",) or bool(getattr(config, "alibi", False)):
        return Positions("alibi", cfg_max or UNLIMITED)
    if config is not None and (
        getattr(config, "relative_attention_num_buckets", None) or getattr(config, "relative_attention", False)
    ):
        return Positions("relative", UNLIMITED)
    return Positions("unknown", cfg_max or tok_max or UNLIMITED)


__all__ = ["PositionKind", "Positions", "UNLIMITED", "positions_of"]
