"""One result per record: the step after combining layers (a sentence pool, the token vectors, or word vectors
pooled from sub-tokens), and the :class:`Encoded` result that :meth:`Extractor.stream <layerwise.Extractor.stream>`
yields.

:func:`make_reducer` turns a resolved :class:`~layerwise.EncodeSpec` into that step:
``reduce(x [b, T, *D], mask [b, T], special [b, T], rows) -> one tensor per row`` (``[*D]``, ``[n_tokens, *D]`` or
``[n_words, *D]``; sentences come as one ``[b, *D]`` tensor, whose rows are theirs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .combine import combine as combine_layers
from .pooling import pool as pool_tokens
from .pooling import pool_words
from .precision import finisher
from .spec import EncodeSpec
from .tokenize import Tokenized

# (combined token states [b, T, *D], mask [b, T], special [b, T], tokenised rows) -> one result per row
# (sentences: one [b, *D] tensor)
Rows = Sequence[torch.Tensor] | torch.Tensor
Reducer = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Tokenized]], Rows]


@dataclass
class Encoded:
    """One record's result from :meth:`Extractor.stream <layerwise.Extractor.stream>`.

    Attributes:
        index: the record's position in the input (results come in input order).
        features: on the CPU in the spec's dtype: ``[*D]`` (sentence), ``[n_tokens, *D]`` (token, special tokens
            included) or ``[n_words, *D]`` (word).
        tokens: the tokenised record (ids, offsets, word ids; longer than the model maximum when windowed).
    """

    index: int
    features: torch.Tensor
    tokens: Tokenized


def make_reducer(spec: EncodeSpec, pooler: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Reducer:
    """The per-record step of a resolved ``spec``: a sentence pool, the token vectors, or word vectors.

    Args:
        spec: the spec (its level, pool, subword and skip_special_tokens are used).
        pooler: the model's pooler, for ``pool="pooler"``.
    """
    if spec.level == "word":
        subword = str(spec.subword)

        def words(x, mask, special, rows):
            return pool_words(x, [t.word_ids for t in rows], [t.n_words for t in rows], subword)

        return words
    if spec.level == "token":

        def tokens(x, mask, special, rows):
            return [x[r, : len(t.ids)] for r, t in enumerate(rows)]

        return tokens
    mode = spec.pool if spec.pool is not None else "mean"  # a sentence-level spec always has one
    skip = spec.skip_special_tokens

    def sentences(
        x: torch.Tensor, mask: torch.Tensor, special: torch.Tensor, rows: Sequence[Tokenized]
    ) -> torch.Tensor:
        out = pool_tokens(x, mask, mode, special=special, skip_special_tokens=skip, pooler=pooler)
        return out  # [b, *D]: one row per record, kept batched for the finishing step

    return sentences


# (states [K, b, T, W] of the spec's layers in spec order, mask [b, T], special [b, T], rows) -> one result per row
RowMaker = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[Tokenized]], list[torch.Tensor]]


def make_rows(spec: EncodeSpec, width: int, pooler: Callable[[torch.Tensor], torch.Tensor] | None = None) -> RowMaker:
    """Everything a resolved ``spec`` does after the forward pass, for layers of ``width`` features: combine the
    layers, reduce (pool, token vectors or word vectors), finish (dimensions, normalisation, ``output_dtype``), and
    move each row's result to the CPU.

    ``rows(states [K, b, T, W], mask [b, T], special [b, T], tokenised rows) -> [result_r]`` with ``result_r``
    shaped ``[*D]``, ``[n_tokens, *D]`` or ``[n_words, *D]``; ``states`` holds the spec's layers in spec order.
    """
    reduce = make_reducer(spec, pooler)
    finish = finisher(spec, width)

    def rows(states: torch.Tensor, mask: torch.Tensor, special: torch.Tensor,
             toks: Sequence[Tokenized]) -> list[torch.Tensor]:
        with torch.inference_mode():
            x = combine_layers(states, spec.combine, weights=spec.weights, mask=mask)
            vecs = reduce(x, mask, special, toks)
            # dimensions, normalize and output_dtype: one call per batch of sentences ([b, *D]), one per row otherwise
            out = finish(vecs) if isinstance(vecs, torch.Tensor) else [finish(v) for v in vecs]
        return [out[r].to("cpu") for r in range(len(toks))]

    return rows
