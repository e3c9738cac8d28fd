"""Scoped hooks that record only the requested sites and stop the forward pass after the deepest one.

:func:`record` is a context manager: it registers forward (pre-)hooks on the model, yields a
:class:`Recorder`, and removes exactly the handles it added in ``finally``, whatever happens inside.
:func:`capture` runs one forward pass under it and returns ``[layers, batch, tokens, width]``.

Early exit: once the deepest requested site has been recorded, the hook raises an internal exception that
unwinds the forward pass, so no later layer module (nor the pooler) runs. Nothing else is kept: each hook
stores a tensor only when its layer was asked for.

Hooks are per call, not per model; a lock on the model makes concurrent captures from several threads wait
for each other instead of mixing.

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor()
    >>> batch = ex.tokenizer(["I love Paris"], return_tensors="pt")
    >>> capture(ex.loaded, batch["input_ids"], batch["attention_mask"], layers=(0, 2)).shape
    torch.Size([2, 1, 5, 384])
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .loaded import LoadedModel


class _StopForward(Exception):
    """Raised by a hook once the deepest requested site is recorded."""


def _first(output):
    return output[0] if isinstance(output, (tuple, list)) else output


class Recorder:
    """What the hooks of one forward pass recorded: ``tensors[layer_index] -> [batch, tokens, width]``.

    Args:
        layers: the wanted indices ``0..L``.
        site: the site (``block`` and ``raw`` read the layer modules themselves).
        chunked: feed-forward chunking: the intermediate site fires several times per layer.
        n_layers: ``L``.
        final: the map has a module whose output is ``hidden_states[L]`` (read at site ``block``).
        after_first: the map has DeBERTa-v2's convolution, whose output is ``hidden_states[1]`` (site ``block``).
    """

    def __init__(
        self, layers: Sequence[int], site: str, chunked: bool, n_layers: int = 0, *, final: bool = False,
        after_first: bool = False,
    ):
        self.wanted = set(layers)
        self.site = site
        self.deepest = max(layers)
        self.chunked = chunked
        self.n_layers = n_layers
        self.final = final and site == "block"
        self.after_first = after_first and site == "block"
        self.current = 0  # index of the layer being run (number of layer calls so far)
        self.tensors: dict[int, torch.Tensor] = {}
        self._chunks: dict[int, list[torch.Tensor]] = {}

    def _deferred(self, i: int) -> bool:
        """Layer ``i``'s ``hidden_states`` entry comes from a module run after the layer (final norm, conv)."""
        return (self.after_first and i == 1) or (self.final and i == self.n_layers)

    # ---- hooks -------------------------------------------------------------------------------------
    def layer_pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Forward pre-hook of a layer module: count the call; record layer 0 (the first layer's input)."""
        self.current += 1
        if self.current == 1 and 0 in self.wanted:
            hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("src"))
            if isinstance(hidden, torch.Tensor):
                self.tensors[0] = hidden
            if self.deepest == 0:
                raise _StopForward

    def layer_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of a layer module: record its output (``block``, ``raw``); stop after the deepest layer."""
        i = self.current
        if self.site in ("block", "raw") and i in self.wanted and not self._deferred(i):
            self.tensors[i] = _first(output)
        if self.site == "intermediate" and self.chunked and i in self._chunks:
            self.tensors[i] = torch.cat(self._chunks.pop(i), dim=1)
        if i == self.deepest and not self._deferred(i):
            raise _StopForward

    def after_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of a module run after a layer whose output is that layer's ``hidden_states`` entry."""
        i = self.current
        if self._deferred(i) and i in self.wanted:
            self.tensors[i] = _first(output)
            if i == self.deepest:
                raise _StopForward

    def site_post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Forward hook of a site module whose output is the site (``attention``, ``intermediate``)."""
        self._site_value(_first(output))

    def site_pre(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        """Forward pre-hook of a site module whose first input is the site (``pre_ln``)."""
        self._site_value(args[0])

    def _site_value(self, value: torch.Tensor) -> None:
        i = self.current
        if i not in self.wanted:
            return
        if self.chunked and self.site == "intermediate":
            self._chunks.setdefault(i, []).append(value)
            return
        self.tensors[i] = value
        if i == self.deepest:
            raise _StopForward


@contextlib.contextmanager
def record(loaded: LoadedModel, layers: Sequence[int], site: str = "block") -> Iterator[Recorder]:
    """Register the hooks for ``layers``/``site`` on ``loaded.model``; remove exactly them on exit.

    Args:
        loaded: the model to hook (its :class:`~layerwise.model.layermap.LayerMap` says where).
        layers: resolved indices in ``0..L`` (see :func:`layerwise.encoding.layers.resolve_layers`).
        site: one of the model's sites (validated by the caller).

    Yields:
        The :class:`Recorder` the hooks write into.
    """
    lmap = loaded.layer_map
    config = getattr(loaded.model, "config", None)
    chunked = int(getattr(config, "chunk_size_feed_forward", 0) or 0) > 0
    rec = Recorder(layers, site, chunked, loaded.num_layers, final=lmap.final is not None,
                   after_first=lmap.after_first is not None)
    handles = []
    try:
        for layer in lmap.layers:
            handles.append(layer.register_forward_pre_hook(rec.layer_pre, with_kwargs=True))
            if site in ("block", "raw") or chunked:
                handles.append(layer.register_forward_hook(rec.layer_post))
            if site not in ("block", "raw"):
                sub, where = lmap.site_module(layer, site)
                if where == "in":
                    handles.append(sub.register_forward_pre_hook(rec.site_pre))
                else:
                    handles.append(sub.register_forward_hook(rec.site_post))
        for after in (lmap.after_first, lmap.final):
            if after is not None and site == "block":
                handles.append(after.register_forward_hook(rec.after_post))
        yield rec
    finally:
        for handle in handles:
            handle.remove()


def _forward(
    loaded: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None
) -> None:
    dev = loaded.device
    extra = {} if position_ids is None else {"position_ids": position_ids.to(dev)}
    try:
        loaded.call(loaded.model, input_ids.to(dev), attention_mask.to(dev), **extra)
    except _StopForward:
        pass


def capture(
    loaded: LoadedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    layers: Sequence[int],
    site: str = "block",
    *,
    grad: bool = False,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """One forward pass that records ``layers`` at ``site`` and stops after the deepest.

    Args:
        loaded: the model.
        input_ids: ``[batch, tokens]`` token ids (on any device; moved to the model's).
        attention_mask: ``[batch, tokens]``, 1 for real tokens, 0 for padding.
        layers: resolved indices in ``0..L``, in the order wanted in the output.
        site: the site inside each layer (``block`` = ``hidden_states``).
        grad: keep the autograd graph (fine-tuning); default runs under ``torch.inference_mode``.
        position_ids: ``[batch, tokens]`` positions to pass to the model (left padding), or ``None``.

    Returns:
        ``[len(layers), batch, tokens, width]`` on the model's device, in the model's dtype.
    """
    # hooks live on the shared modules: one capture per model at a time (threads queue here)
    with (
        loaded.lock,
        contextlib.nullcontext() if grad else torch.inference_mode(),
        record(loaded, layers, site) as rec,
    ):
        _forward(loaded, input_ids, attention_mask, position_ids)
    missing = [i for i in layers if i not in rec.tensors]
    if missing:  # pragma: no cover - a layer map error, not a user error
        raise RuntimeError(f"layers {missing} at site {site!r} were not recorded; please report this model")
    return torch.stack([rec.tensors[i] for i in layers])


def count_layer_calls(loaded: LoadedModel, input_ids, attention_mask, layers, site="block") -> int:
    """How many encoder layer modules ran (entered their forward) while capturing ``layers``.

    The counting hooks are registered after the capture hooks, so a layer stopped by the early exit before
    its forward body starts is not counted. Used to prove the early exit.
    """
    counter = {"n": 0}

    def bump(module, args):
        counter["n"] += 1

    with torch.inference_mode(), record(loaded, layers, site):
        handles = [m.register_forward_pre_hook(bump) for m in loaded.layer_map.layers]
        try:
            _forward(loaded, input_ids, attention_mask, None)
        finally:
            for handle in handles:
                handle.remove()
    return counter["n"]

