"""Rows that leave the batch at their own depth: one forward pass where each row runs only the layers it needs.

A service batches requests for different layers. Run together to the deepest one, a request for layer 1 pays for
every layer of the deepest; run apart, the batches are small and a CPU computes small batches at a fraction of its
speed. Here the rows of one batch are ordered deepest first (``depths`` non-increasing) and, before layer ``l``
runs, every batch-carrying input of the layer module (its hidden states, attention mask, positions, rotary tables)
is cut to the rows that still need layer ``l``: the batch shrinks as it goes deeper, and each row computes exactly
its own layers while the shallow layers still run on the whole batch.

The hooks that cut the batch are :class:`~layerwise.model.capture.RowExits` (``capture(..., depths=)``). Which
inputs of a layer carry the batch is not guessed from the architecture: :func:`batch_keys` runs two probe
batches of different sizes and keeps the positional arguments and keyword arguments whose first dimension is the
batch in both. :func:`verify` then compares a ragged pass with a full one on a probe batch; a model whose states
differ (a module outside the layers that reads the whole batch, such as DeBERTa-v2's convolution after layer 1)
is not run ragged: its callers fall back to running each depth's rows in batches of their own.

Example::

    >>> keys = batch_keys(loaded)            # e.g. frozenset({0, 1}): BERT's hidden states and attention mask
    >>> verify(loaded, 6, keys)              # True: capture(..., depths=[6, 3, 1], keys=keys) is exact here
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch
from torch import nn

from .capture import Key, capture, keep_counts, run_forward
from .discovery import probe_batch

log = logging.getLogger("layerwise")

_AGREE = 1e-4  # ragged against full states, relative to their scale (float32 reductions reorder with the batch)


def _dim0(value: Any) -> int | None:
    """The first dimension ``value`` carries: a tensor's, or the common one of a tuple/list of tensors."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() >= 2 else None
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
        dims = {int(v.shape[0]) if v.dim() >= 2 else None for v in value}
        return dims.pop() if len(dims) == 1 else None
    return None


def batch_keys(loaded: Any) -> frozenset[Key]:
    """The inputs of ``loaded``'s first layer module whose first dimension is the batch: the positional indices and
    keyword names whose first dimension equals the batch size for two probe batches of different sizes (2 and 3
    rows). Empty when the first layer takes no hidden states that way (a model that is then never run ragged)."""
    ids, mask = probe_batch(loaded.tokenizer)
    found: list[frozenset[Key]] = []
    first = loaded.layer_map.layers[0]
    for rows in (2, 3):
        seen: dict[Key, int | None] = {}

        def look(module: nn.Module, args: tuple, kwargs: dict, seen: dict[Key, int | None] = seen) -> None:
            seen.update({i: _dim0(a) for i, a in enumerate(args)})
            seen.update({k: _dim0(v) for k, v in kwargs.items()})
            raise _Stop

        pick = torch.arange(rows) % ids.shape[0]
        handle = first.register_forward_pre_hook(look, with_kwargs=True)
        try:
            with loaded.lock, torch.inference_mode():
                loaded.ensure_depth(1)
                try:
                    run_forward(loaded, ids[pick], mask[pick], None)
                except _Stop:
                    pass
        finally:
            handle.remove()
        found.append(frozenset(k for k, d in seen.items() if d == rows))
    return found[0] & found[1]


class _Stop(Exception):
    """Ends a probe pass once the first layer's inputs are seen."""


def verify(loaded: Any, depth: int, keys: frozenset[Key], site: str = "block") -> bool:
    """Whether a ragged pass gives the states of a full one on ``loaded``: a probe batch of three rows with depths
    ``(depth, depth - 1, 1)`` (``depth >= 2``: the batch shrinks after layer 1 and before the last layer, so what
    one layer hands the next is cut too), every layer ``1..depth`` compared on the rows that ran it.
    An exception inside the ragged pass (a module outside the layers that reads the whole batch) counts as a
    difference."""
    if depth < 2 or 0 not in keys:
        return False
    ids, mask, depths = probe_rows(loaded.tokenizer, depth)
    layers = tuple(range(1, depth + 1))
    full = capture(loaded, ids, mask, layers, site)
    try:
        ragged = capture(loaded, ids, mask, layers, site, depths=depths, keys=keys)
    except Exception as exc:  # noqa: BLE001 - any failure means "not ragged", said in the log
        log.info("%s is not run ragged (rows leaving at their depth): %s: %s", loaded.architecture,
                 type(exc).__name__, exc)
        return False
    layer = first_difference(ragged, full, mask, depths, layers, loaded.num_layers)
    if layer is not None:
        log.info("%s is not run ragged: layer %d differs from a full pass", loaded.architecture, layer)
    return layer is None


def probe_rows(tokenizer: Any, depth: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """The probe batch a ragged pass is checked on: three rows ``(input_ids, attention_mask)`` ``[3, T]`` and their
    depths ``(depth, depth - 1, 1)`` (``depth >= 2``: the batch shrinks after layer 1 and before the last layer, so
    what one layer hands the next is cut too)."""
    ids, mask = probe_batch(tokenizer)
    pick = torch.tensor([0, 1, 0])
    return ids[pick], mask[pick], [depth, depth - 1, 1]


def first_difference(ragged: torch.Tensor, full: torch.Tensor, mask: torch.Tensor, depths: Sequence[int],
                     layers: Sequence[int], n_layers: int) -> int | None:
    """The first of ``layers`` where a ragged pass's states ``[K, batch, tokens, W]`` differ from a full pass's on the
    real tokens of the rows that ran it (beyond ``1e-4`` of the states' scale), or ``None`` where they agree."""
    keep = keep_counts(depths, n_layers)
    scale = max(1.0, float(full.abs().max()))
    for k, layer in enumerate(layers):
        n = keep[layer]
        real = mask[:n].bool()
        if float((ragged[k, :n][real] - full[k, :n][real]).abs().max()) > _AGREE * scale:
            return layer
    return None
