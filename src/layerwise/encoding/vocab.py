"""The vocabularies of an encoding, said once, and their checks. Imports no torch.

=====================  =================================================================================
vocabulary             values
=====================  =================================================================================
:data:`LEVELS`         ``sentence`` (one vector a record) ``| token`` ``| word``
:data:`SITES`          ``block | raw | attention | intermediate | pre_ln`` (see :mod:`layerwise.encoding.layers`)
:data:`COMBINE_MODES`  ``concat | sum | mean | weighted | stack`` (fixed) ``| scalar_mix | attention`` (learned)
:data:`POOL_MODES`     ``cls | pooler | mean | max | mean_max | last`` (fixed) ``| attention`` (learned)
:data:`WORD_POOL_MODES` ``first | last | mean | max | first_last`` (sub-tokens to a word)
:data:`OUTPUT_DTYPES`  ``float32 | float16 | int8 | uint8 | binary | ubinary``: how features are returned and
                       stored (see :mod:`layerwise.encoding.precision`)
:data:`PADDING_SIDES`  ``right | left``: where a batch is padded (the states are the same)
=====================  =================================================================================

The service, the CLI, heads and probes read their choices from here; a check names the bad value and lists the
valid ones (:class:`~layerwise.errors.SpecError`). Where a module may stand in for a mode (a trained
``ScalarMix`` or ``AttentionPool``), :func:`is_module` tells without importing torch: no object can be a torch
module before torch is imported.
"""

from __future__ import annotations

import math
import sys
from typing import Literal, Sequence, get_args

from ..errors import SpecError

Level = Literal["sentence", "token", "word"]
LEVELS: tuple[str, ...] = get_args(Level)

OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary", "ubinary"]
OUTPUT_DTYPES: tuple[str, ...] = get_args(OutputDtype)
FLOAT_DTYPES: tuple[str, ...] = ("float32", "float16")
CALIBRATED_DTYPES: tuple[str, ...] = ("int8", "uint8")  # need per-value ranges from a calibration set
PACKED_DTYPES: tuple[str, ...] = ("binary", "ubinary")  # sign bits, 8 to a byte
# the numpy dtype that holds each output dtype (returned, stored, sent): packed bits are bytes
VALUE_DTYPES: dict[str, str] = {"float32": "float32", "float16": "float16", "int8": "int8", "uint8": "uint8",
                                "binary": "int8", "ubinary": "uint8"}

Site = Literal["block", "raw", "attention", "intermediate", "pre_ln"]
SITES: tuple[str, ...] = get_args(Site)

CombineMode = Literal["concat", "sum", "mean", "weighted", "stack", "scalar_mix", "attention"]
COMBINE_MODES: tuple[str, ...] = get_args(CombineMode)
LEARNED_COMBINES: tuple[str, ...] = ("scalar_mix", "attention")
FIXED_COMBINES: tuple[str, ...] = tuple(m for m in COMBINE_MODES if m not in LEARNED_COMBINES)

PoolMode = Literal["cls", "pooler", "mean", "max", "mean_max", "last", "attention"]
POOL_MODES: tuple[str, ...] = get_args(PoolMode)
LEARNED_POOLS: tuple[str, ...] = ("attention",)
FIXED_POOLS: tuple[str, ...] = tuple(p for p in POOL_MODES if p not in LEARNED_POOLS)

WordPoolMode = Literal["first", "last", "mean", "max", "first_last"]
WORD_POOL_MODES: tuple[str, ...] = get_args(WordPoolMode)

PaddingSide = Literal["right", "left"]
PADDING_SIDES: tuple[str, ...] = get_args(PaddingSide)


def is_module(value: object) -> bool:
    """Whether ``value`` is a ``torch.nn.Module`` (a trained combine or pool), without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.nn.Module)


def check_choice(name: str, value: object, valid: Sequence[str]) -> str:
    """``value`` when it is one of ``valid``, else :class:`SpecError` naming it and listing the valid values."""
    if not isinstance(value, str) or value not in valid:
        raise SpecError(f"unknown {name} {value!r}. Valid {name} values are: {', '.join(valid)}")
    return value


def validate_combine(
    mode: object, num_layers: int, weights: Sequence[float] | None = None, *, learned: bool = False
) -> None:
    """Check a combine mode (a name or a module) against the number of selected layers.

    Args:
        mode: one of :data:`COMBINE_MODES`, or a module taking ``(h [K, *lead, W], mask)``.
        num_layers: ``K``, how many layers are selected.
        weights: the fixed weights of ``weighted``.
        learned: whether the caller trains learned modes (heads, probes); elsewhere their names are refused.

    Raises:
        SpecError: unknown mode (the valid ones are listed), a learned mode where nothing is trained, weights
            missing, of the wrong length, or given to another mode; a ScalarMix built for another layer count.
    """
    if is_module(mode):
        size = getattr(mode, "mixture_size", None)  # a ScalarMix knows how many layers it mixes
        if size is not None and size != num_layers:
            raise SpecError(
                f"ScalarMix was built for {size} layers but {num_layers} are selected; "
                f"build ScalarMix({num_layers}) or change the layer spec"
            )
        return  # any user module taking (h, mask) -> [*lead, D]
    if not isinstance(mode, str) or mode not in COMBINE_MODES:
        raise SpecError(
            f"unknown combine mode {mode!r}. Valid combine modes are: {', '.join(COMBINE_MODES)} "
            f"(or a module such as layerwise.ScalarMix)"
        )
    if mode in LEARNED_COMBINES and not learned:
        raise SpecError(
            f"combine={mode!r} has learned weights and nothing is trained here; use it where a model is trained "
            f"(a classifier head: HeadConfig(combine={mode!r}) or `layerwise train --combine {mode}`; a probe), or "
            f"pass a trained module (layerwise.ScalarMix, layerwise.LayerAttention). Fixed modes: "
            f"{', '.join(FIXED_COMBINES)}"
        )
    if mode == "weighted":
        if weights is None:
            raise SpecError("combine='weighted' needs weights=[w_1, ..., w_K], one per selected layer")
        if len(weights) != num_layers:
            raise SpecError(
                f"combine='weighted' got {len(weights)} weights for {num_layers} selected layers; give one per layer"
            )
    elif weights is not None:
        raise SpecError(f"weights are only used with combine='weighted', not {mode!r}")


def check_weights(weights: object) -> tuple[float, ...] | None:
    """Fixed layer weights as a tuple of finite floats (``None`` stays ``None``); :class:`SpecError` names a bad
    one."""
    if weights is None:
        return None
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise SpecError(f"weights must be a list of numbers, one per selected layer, got {weights!r}")
    out = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)):
            raise SpecError(f"weight {i} ({w!r}) is not a number; give e.g. weights=[0.25, 0.25, 0.5]")
        if not math.isfinite(w):
            raise SpecError(f"weight {i} is {w!r}; layer weights must be finite numbers, e.g. [0.25, 0.25, 0.5]")
        out.append(float(w))
    return tuple(out)


def combined_shape(mode: object, num_layers: int, width: int) -> tuple[int, ...]:
    """The feature shape after combining ``num_layers`` layers of ``width``: ``(K * width,)`` for ``concat``,
    ``(K, width)`` for ``stack``, ``(width,)`` for every other mode (a module mixes to one layer's width)."""
    if mode == "concat":
        return (num_layers * width,)
    if mode == "stack":
        return (num_layers, width)
    return (width,)


def validate_pool(
    mode: object, *, skip_special_tokens: bool = False, has_pooler: bool = True, causal: bool = False
) -> None:
    """Check a sentence pooling mode (a name or a module); :class:`SpecError` lists the valid ones.

    ``causal``: the model is a decoder (each token sees only the tokens before it), where ``cls`` is refused: its
    first token has seen nothing of the text after it (and where the tokenizer adds a start token, that token's
    state is the same for every text); the message names ``last``.
    """
    if is_module(mode):
        return
    if mode not in POOL_MODES:
        raise SpecError(
            f"unknown pool mode {mode!r}. Valid pool modes are: {', '.join(POOL_MODES)} "
            f"(or None for token-level output)"
        )
    if mode == "attention":
        raise SpecError(
            "pool='attention' needs learned weights: pass a module, e.g. pool=layerwise.AttentionPool(dim), "
            "and train it (layerwise heads do)"
        )
    if mode in ("cls", "pooler") and skip_special_tokens:
        raise SpecError(
            f"pool={mode!r} reads the first special token; it cannot be used with skip_special_tokens=True"
        )
    if mode == "cls" and causal:
        raise SpecError(
            "pool='cls' reads the first token, but this model is a decoder (causal attention): its first token sees "
            "no other token, so the vector would describe that token alone (with a start token such as <s>: the same "
            "vector for every text). Use pool='last' (the last token has seen the whole text; add_eos=True appends "
            "the end-of-sequence token decoder embedding models pool) or pool='mean'"
        )
    if mode == "pooler" and not has_pooler:
        raise SpecError(
            "pool='pooler' needs a model with a pooler (BERT, RoBERTa, XLM-R, ALBERT); use 'cls' or 'mean'"
        )


def validate_word_pool(mode: object) -> None:
    """Check a word (sub-token) pooling mode; :class:`SpecError` lists the valid ones."""
    if mode not in WORD_POOL_MODES:
        raise SpecError(f"unknown subword pooling {mode!r}. Valid subword modes are: {', '.join(WORD_POOL_MODES)}")


__all__ = [
    "COMBINE_MODES", "CombineMode", "FIXED_COMBINES", "FIXED_POOLS", "LEARNED_COMBINES", "LEARNED_POOLS", "LEVELS",
    "CALIBRATED_DTYPES", "FLOAT_DTYPES", "Level", "OUTPUT_DTYPES", "PACKED_DTYPES", "OutputDtype", "PADDING_SIDES",
    "POOL_MODES", "PaddingSide", "PoolMode", "SITES", "Site", "VALUE_DTYPES",
    "WORD_POOL_MODES",
    "WordPoolMode", "check_choice", "check_weights", "combined_shape", "is_module", "validate_combine", "validate_pool",
    "validate_word_pool",
]
