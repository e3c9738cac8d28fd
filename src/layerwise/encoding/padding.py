"""Ragged rows to a padded batch and its mask: the one pad-and-mask helper of layerwise.

Every place that turns rows of different lengths into a rectangular batch (token ids for the forward pass,
per-token features for attention pooling, word features of sentences for sequence probes) goes through
:func:`pad_ids` or :func:`pad_rows`, so the mask always marks exactly the real positions (1) and padding (0).

Example::

    >>> import torch
    >>> x, mask = pad_rows([torch.ones(3, 4), torch.ones(1, 4)])
    >>> x.shape, mask.tolist()
    (torch.Size([2, 3, 4]), [[1, 1, 1], [1, 0, 0]])
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..errors import SpecError


def length_mask(lengths: Sequence[int], longest: int | None = None, device: torch.device | None = None) -> torch.Tensor:
    """``[len(lengths), longest]`` long mask: row ``r`` has ``lengths[r]`` leading ones, zeros after."""
    n = torch.as_tensor(list(lengths), dtype=torch.long)
    width = int(n.max()) if longest is None and len(n) else int(longest or 0)
    return (torch.arange(width).unsqueeze(0) < n.unsqueeze(1)).long().to(device or "cpu")


def pad_ids(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [batch, longest], attention_mask [batch, longest])``, right-padded with ``pad_id``."""
    longest = max(len(r) for r in rows)
    ids = torch.full((len(rows), longest), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, length_mask([len(r) for r in rows], longest)


def pad_rows(
    rows: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None, longest: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack ``rows`` (``[n_i, *F]`` each) into ``(x [batch, longest, *F], mask [batch, longest])``, zero-padded.

    Args:
        rows: at least one tensor; all share the trailing shape ``F``.
        dtype: dtype of ``x`` (default: the first row's).
        longest: pad to this many positions (default: the longest row).
    """
    if not rows:
        raise SpecError("pad_rows needs at least one row")
    lengths = [int(r.shape[0]) for r in rows]
    width = max(lengths) if longest is None else longest
    x = torch.zeros((len(rows), width) + tuple(rows[0].shape[1:]), dtype=dtype or rows[0].dtype)
    for i, r in enumerate(rows):
        x[i, : lengths[i]] = r
    return x, length_mask(lengths, width)




def move_padding_left(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``ids``/``mask [batch, T]`` as left-padded ones, and the index that undoes it.

    Returns:
        ``(ids, mask, back)``; ``back [batch, T]`` gathers a left-padded row's positions into right-padded order:
        ``right[:, r] = left[:, r].gather(0, back[r])`` (see :func:`gather_tokens`).
    """
    T = ids.shape[1]
    shift = T - mask.sum(dim=1, keepdim=True)  # [batch, 1] pads per row
    t = torch.arange(T, device=ids.device).unsqueeze(0)
    src = (t - shift) % T  # left[:, t] = right[:, (t - shift) % T]
    back = (t + shift) % T  # right[:, t] = left[:, (t + shift) % T]
    return ids.gather(1, src), mask.gather(1, src), back


def gather_tokens(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``states [K, batch, T, W]`` with each row's tokens reordered by ``index [batch, T]``."""
    K, b, T, W = states.shape
    idx = index.to(states.device).view(1, b, T, 1).expand(K, b, T, W)
    return states.gather(2, idx)


def positions_from_mask(mask: torch.Tensor, offset: int = 0) -> torch.Tensor:
    """``[batch, T]`` position ids counting real tokens from ``offset`` (padding gets ``offset``)."""
    return (mask.long().cumsum(dim=1) - 1).clamp_min(0) + offset
