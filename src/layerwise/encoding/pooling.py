"""Pool token states into one vector per sentence, or into one vector per word.

Sentence pooling: ``x [batch, tokens, *F]`` (``F`` = ``(D,)``, or ``(K, width)`` after ``stack``) and
``mask [batch, tokens]`` (1 = a token to pool) give ``[batch, *F]``:

=============  ==========================================================================
mode           result
=============  ==========================================================================
``cls``        the first token (``[CLS]`` / ``<s>``)
``pooler``     the model's pooler (dense + tanh) applied to the first token; on the last layer
               this is the model's ``pooler_output`` (BERT, RoBERTa, XLM-R, ALBERT only)
``mean``       mean over masked-in tokens (sentence-transformers' mean pooling)
``max``        element-wise max over masked-in tokens
``mean_max``   ``[mean; max]``, width ``2 D``
``last``       the last masked-in token (with special tokens: the final ``[SEP]``)
``attention``  a learned query (:class:`AttentionPool`): ``softmax(x q / sqrt(D))`` weighted sum
=============  ==========================================================================

Padding never enters a pool. With ``skip_special_tokens=True`` the special tokens are masked out too
(``cls``/``pooler`` then make no sense and are refused). A row with no token to pool (an empty string with
special tokens skipped) pools to zeros.

Word pooling (``word_ids`` from the tokenizer; special tokens have none) gives one vector per word:
``first`` / ``last`` sub-token, ``mean``, ``max``, or ``first_last`` (``[first; last]``, width ``2 D``).
A word that produced no token pools to zeros.

Pooling never writes into its input.

Example::

    >>> import torch
    >>> x, mask = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    >>> pool(x, mask, "mean_max").shape
    torch.Size([2, 16])
    >>> [w.shape for w in pool_words(x, [[None, 0, 0, 1, None], [None, 0, 1, 2, None]], [2, 3], "first")]
    [torch.Size([2, 8]), torch.Size([3, 8])]
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch import nn

from ..errors import SpecError
from .vocab import validate_pool, validate_word_pool


class AttentionPool(nn.Module):
    """Attention pooling with one learned query: ``a = softmax_masked(x q / sqrt(D))``, ``out = sum_t a_t x_t``.

    Args:
        dim: ``D``, the feature width it pools.

    Shapes: ``forward(x [batch, tokens, D], mask [batch, tokens]) -> [batch, D]``.
    """

    def __init__(self, dim: int):
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise SpecError(f"AttentionPool dim must be a positive int, got {dim!r}")
        self.dim = dim
        self.query = nn.Parameter(torch.randn(dim) / math.sqrt(dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise SpecError(f"AttentionPool was built for width {self.dim}, got features of width {x.shape[-1]}")
        keep = mask.bool()
        scores = (x @ self.query.to(x.dtype)) / math.sqrt(self.dim)  # [batch, tokens]
        scores = scores.masked_fill(~keep, float("-inf"))
        weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> zeros
        return torch.einsum("bt,btd->bd", weights, x)


def _expand(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape + (1,) * (x.dim() - 2)).to(x.dtype)


def _mean(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    m = _expand(keep, x)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


def _max(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    m = _expand(keep, x).bool()
    out = x.masked_fill(~m, float("-inf")).amax(1)
    return out.masked_fill(~keep.any(1).reshape((-1,) + (1,) * (x.dim() - 2)), 0.0)


def pool(
    x: torch.Tensor,
    mask: torch.Tensor,
    mode: str | nn.Module = "mean",
    *,
    special: torch.Tensor | None = None,
    skip_special_tokens: bool = False,
    pooler: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pool ``x [batch, tokens, *F]`` over tokens into ``[batch, *F]`` (``mean_max``: last dim doubled).

    Args:
        x: token features.
        mask: ``[batch, tokens]`` attention mask (1 = real token).
        mode: a :data:`~layerwise.encoding.vocab.POOL_MODES` name or a module called as ``module(x, keep_mask)``.
        special: ``[batch, tokens]`` special-token mask, needed with ``skip_special_tokens``.
        skip_special_tokens: leave special tokens out of the pool.
        pooler: the model's pooler function ``[batch, hidden] -> [batch, hidden]`` for ``mode="pooler"``.
    """
    validate_pool(mode, skip_special_tokens=skip_special_tokens, has_pooler=pooler is not None or mode != "pooler")
    if x.shape[1] == 0:  # rows without any token (an empty text, no special tokens): one masked-out zero token
        x = x.new_zeros((x.shape[0], 1) + tuple(x.shape[2:]))
        mask = mask.new_zeros((x.shape[0], 1))
        special = None if special is None else special.new_zeros((x.shape[0], 1))
    keep = mask.bool()
    if skip_special_tokens:
        if special is None:
            raise SpecError("skip_special_tokens=True needs the special-token mask")
        keep = keep & ~special.bool()
    if isinstance(mode, nn.Module):
        return mode(x, keep)
    if mode == "cls":
        return x[:, 0]
    if mode == "pooler" and pooler is not None:  # validate_pool above refuses "pooler" without a pooler
        return pooler(x[:, 0])
    if mode == "mean":
        return _mean(x, keep)
    if mode == "max":
        return _max(x, keep)
    if mode == "mean_max":
        return torch.cat([_mean(x, keep), _max(x, keep)], dim=-1)
    # last: highest position with keep == 1
    positions = torch.arange(x.shape[1], device=x.device).expand(keep.shape)
    idx = torch.where(keep, positions, -1).amax(1)
    out = x[torch.arange(x.shape[0], device=x.device), idx.clamp_min(0)]
    return out.masked_fill((idx < 0).reshape((-1,) + (1,) * (x.dim() - 2)), 0.0)


def pool_words(
    x: torch.Tensor,
    word_ids: Sequence[Sequence[int | None]],
    n_words: Sequence[int],
    mode: str = "first",
) -> list[torch.Tensor]:
    """Pool sub-token states into word vectors for every row of a batch.

    Args:
        x: ``[batch, tokens, *F]`` token features.
        word_ids: per row, per token, the word index or ``None`` (special tokens, padding may be left out:
            rows shorter than ``tokens`` count as padded).
        n_words: per row, how many words it has (words with no token pool to zeros).
        mode: one of :data:`~layerwise.encoding.vocab.WORD_POOL_MODES`.

    Returns:
        A list of ``[n_words[i], *F]`` tensors (``first_last``: last dim doubled).
    """
    validate_word_pool(mode)
    b, t = x.shape[:2]
    feat = x.shape[2:]
    index = torch.full((b, t), -1, dtype=torch.long)
    offsets = [0]
    for row, ids in enumerate(word_ids):
        for pos, w in enumerate(ids[:t]):
            if w is not None:
                if not 0 <= w < n_words[row]:
                    raise SpecError(f"word id {w} in row {row} is outside 0..{n_words[row] - 1}")
                index[row, pos] = offsets[-1] + w
        offsets.append(offsets[-1] + n_words[row])
    total = offsets[-1]
    index = index.to(x.device)
    sel = index >= 0
    flat = x[sel]  # [N, *F]
    target = index[sel]  # [N]
    if mode in ("mean", "max"):
        shape = (total,) + tuple(feat)
        tgt = target.reshape((-1,) + (1,) * len(feat)).expand_as(flat)
        if mode == "mean":
            sums = torch.zeros(shape, dtype=x.dtype, device=x.device).scatter_add(0, tgt, flat)
            counts = torch.zeros(total, dtype=x.dtype, device=x.device).scatter_add(
                0, target, torch.ones_like(target, dtype=x.dtype)
            )
            out = sums / counts.clamp_min(1.0).reshape((-1,) + (1,) * len(feat))
        else:
            out = torch.zeros(shape, dtype=x.dtype, device=x.device).scatter_reduce(
                0, tgt, flat, reduce="amax", include_self=False
            )
    else:
        positions = torch.arange(flat.shape[0], device=x.device)
        first = torch.full((total,), flat.shape[0], dtype=torch.long, device=x.device).scatter_reduce(
            0, target, positions, reduce="amin", include_self=True
        )
        last = torch.full((total,), -1, dtype=torch.long, device=x.device).scatter_reduce(
            0, target, positions, reduce="amax", include_self=True
        )
        padded = torch.cat([flat, torch.zeros((1,) + tuple(feat), dtype=x.dtype, device=x.device)])
        first = torch.where(first >= flat.shape[0], flat.shape[0], first)
        last = torch.where(last < 0, flat.shape[0], last)
        if mode == "first":
            out = padded[first]
        elif mode == "last":
            out = padded[last]
        else:
            out = torch.cat([padded[first], padded[last]], dim=-1)
    return [out[offsets[i] : offsets[i + 1]] for i in range(b)]
