"""Scoped hooks that record only the requested sites and stop the forward pass after the deepest one.

:func:`record` is a context manager: it registers forward (pre-)hooks on the model, yields a
:class:`Recorder`, and removes exactly the handles it added in ``finally``, whatever happens inside.
:func:`capture` runs one forward pass under it and returns ``[layers, batch, tokens, width]``.

Early exit: once the deepest requested site has been recorded, the hook raises an internal exception that
unwinds the forward pass, so no later layer module (nor the pooler) runs. Nothing else is kept: each hook
stores a tensor only when its layer was asked for.

Rows that leave the batch at their own depth: with ``depths=`` (non-increasing, one per row), :class:`RowExits`
cuts each layer's batch-carrying inputs to the rows that still need it (which inputs carry the batch, and whether
cutting them is exact for a model, is :mod:`layerwise.model.ragged`'s).

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
import logging
import time
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from ..errors import ModelLoadError, SpecError
from ..notices import notice
from .families import resolve_path
from .loaded import LoadedModel

log = logging.getLogger("layerwise")
PROGRESS_S = 10.0  # a streamed chunk says where it is at most this often (a block of an 8B model takes seconds)


# ---- rows that leave the batch at their own depth (layerwise.model.ragged) -------------------------------------
Key = int | str  # a positional argument's index or a keyword argument's name


def keep_counts(depths: Sequence[int], n_layers: int) -> list[int]:
    """``keep[l]``: how many rows run layer ``l`` (``l`` in ``0..L``), for rows whose deepest layers are ``depths``.

    Args:
        depths: per row, the deepest layer it needs, non-increasing (deepest rows first).
        n_layers: ``L``.

    Returns:
        ``L + 1`` counts, ``keep[0] = len(depths)``.

    Raises:
        SpecError: ``depths`` increasing somewhere (the rows must be ordered deepest first).
    """
    if any(a < b for a, b in zip(depths, depths[1:])):
        raise SpecError(f"row depths must be ordered deepest first, got {list(depths)}")
    return [len(depths)] + [sum(1 for d in depths if d >= layer) for layer in range(1, n_layers + 1)]


def _rows(value: Any, n: int) -> Any:
    """``value`` cut to its first ``n`` rows: a tensor, or a tuple/list of tensors (rotary cos/sin)."""
    if isinstance(value, torch.Tensor):
        return value[:n] if value.dim() > 0 and value.shape[0] > n else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(v, n) for v in value)
    return value


class RowExits:
    """Forward pre-hooks that cut a layer's batch-carrying inputs to the rows that still need it.

    Args:
        keys: the layer modules' batch-carrying inputs (:func:`batch_keys`).
        keep: rows that run each layer (:func:`keep_counts`); ``keep[l]`` for layer ``l`` (1-based).

    Register :meth:`pre` on every layer module after the recorder's own pre-hook (it counts the layer).
    """

    def __init__(self, keys: frozenset[Key], keep: Sequence[int]):
        self.keys = keys
        self.keep = list(keep)
        self.layer = 0

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """Forward pre-hook (``with_kwargs=True``): the layer's inputs, batch cut to ``keep[layer]`` rows."""
        self.layer += 1
        n = self.keep[min(self.layer, len(self.keep) - 1)]
        if n >= self.keep[0]:
            return None
        args = tuple(_rows(a, n) if i in self.keys else a for i, a in enumerate(args))
        kwargs = {k: _rows(v, n) if k in self.keys else v for k, v in kwargs.items()}
        return args, kwargs


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
def record(loaded: LoadedModel, layers: Sequence[int], site: str = "block", exits: RowExits | None = None,
           ) -> Iterator[Recorder]:
    """Register the hooks for ``layers``/``site`` on ``loaded.model``; remove exactly them on exit.

    Args:
        loaded: the model to hook (its :class:`~layerwise.model.layermap.LayerMap` says where).
        layers: resolved indices in ``0..L`` (see :func:`layerwise.encoding.layers.resolve_layers`).
        site: one of the model's sites (validated by the caller).
        exits: rows leaving the batch at their depth (:class:`RowExits`), or ``None``.

    Yields:
        The :class:`Recorder` the hooks write into.
    """
    lmap = loaded.layer_map
    rec = Recorder(layers, site, _chunked(loaded), loaded.num_layers, final=lmap.final is not None,
                   after_first=lmap.after_first is not None)
    handles: list[Any] = []
    try:
        handles = _hooks(loaded, rec, lmap.layers, site)
        if exits is not None:  # after the recorder's pre-hook: layer 0 is recorded on the whole batch
            handles += [layer.register_forward_pre_hook(exits.pre, with_kwargs=True) for layer in lmap.layers]
        yield rec
    finally:
        for handle in handles:
            handle.remove()


def _chunked(loaded: LoadedModel) -> bool:
    """Whether the model chunks its feed-forward (the intermediate site fires several times per layer)."""
    config = getattr(loaded.model, "config", None)
    return int(getattr(config, "chunk_size_feed_forward", 0) or 0) > 0


def _hooks(loaded: LoadedModel, rec: Recorder, layers: Sequence[nn.Module], site: str) -> list[Any]:
    """Register ``rec``'s hooks on ``layers`` (and the map's final/after-first modules); return the handles."""
    lmap = loaded.layer_map
    handles = []
    try:
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(rec.layer_pre, with_kwargs=True))
            if site in ("block", "raw") or rec.chunked:
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
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    return handles


def run_forward(
    loaded: LoadedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None
) -> None:
    """Run ``loaded``'s model on one batch (``[batch, tokens]`` ids and mask, optional positions) for the hooks
    registered on it; the early exit of a :class:`Recorder` ends it quietly. Returns nothing: hooks keep what they
    need."""
    dev = loaded.device
    extra = {} if position_ids is None else {"position_ids": position_ids.to(dev)}
    running = loaded.blocks.running() if loaded.blocks is not None else contextlib.nullcontext()
    try:
        with running:
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
    depths: Sequence[int] | None = None,
    keys: frozenset[Key] = frozenset(),
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
        depths: per row, the deepest layer it needs, non-increasing: each row runs only its own layers (see
            :mod:`layerwise.model.ragged`; ``keys`` are the layers' batch-carrying inputs, :func:`batch_keys`).
            ``None``: every row runs to ``max(layers)``.

    Returns:
        ``[len(layers), batch, tokens, width]`` on the model's device, in the model's dtype; with ``depths``, the
        rows that did not run a layer hold zeros there.
    """
    if loaded.streams(max(layers)):
        if grad:
            raise ModelLoadError(
                f"layers up to {max(layers)} run block by block under max_memory, which computes no gradients; "
                f"fine-tuning needs the blocks in memory: raise max_memory (CLI --max-memory) or drop it")
        return capture_chunk(loaded, [(input_ids, attention_mask, position_ids)], layers, site)[0]
    exits, ran = None, list(layers)
    if depths is not None:
        if len(depths) != input_ids.shape[0] or max(depths) > max(layers):
            raise SpecError(f"depths {list(depths)} must give one depth per row of the batch "
                             f"({input_ids.shape[0]}), none deeper than max(layers) = {max(layers)}")
        exits = RowExits(keys, keep_counts(depths, loaded.num_layers))
        ran = [i for i in layers if i <= max(depths)]  # the layers past every row's depth stay zeros
    # hooks live on the shared modules: one capture per model at a time (threads queue here)
    with loaded.lock:
        loaded.ensure_depth(max(ran))
        with (
            contextlib.nullcontext() if grad else torch.inference_mode(),
            record(loaded, ran, site, exits) as rec,
        ):
            try:
                run_forward(loaded, input_ids, attention_mask, position_ids)
            finally:
                if loaded.blocks is not None:
                    loaded.blocks.settle()
    missing = [i for i in ran if i not in rec.tensors]
    if missing:  # pragma: no cover - a layer map error, not a user error
        raise RuntimeError(f"layers {missing} at site {site!r} were not recorded; please report this model")
    if exits is None:
        return torch.stack([rec.tensors[i] for i in layers])
    first = rec.tensors[ran[0]]
    out = torch.empty((len(layers), int(input_ids.shape[0]), *first.shape[1:]), dtype=first.dtype,
                      device=first.device)
    for k, i in enumerate(layers):
        n = int(rec.tensors[i].shape[0]) if i in rec.tensors else 0
        if n:
            out[k, :n] = rec.tensors[i]
        out[k, n:] = 0
    return out


class _Replay(nn.Module):
    """Stands in for a block before the one being run in a layer-by-layer pass: returns what that block's
    predecessor returned for this batch (so the model's own loop hands it the right input, and carries what the
    blocks pass along, e.g. T5's position bias). Other attributes the loop reads from a block (ModernBERT's
    ``attention_type``) are the original block's."""

    def __init__(self, original: nn.Module, shared: dict[str, Any]) -> None:
        super().__init__()
        self.__dict__["stands_for"] = original  # not a submodule: its weights are not part of the replay
        self.__dict__["shared"] = shared  # {"output": the kept output of this batch}

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["stands_for"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["shared"]["output"]


def _block_step(loaded: LoadedModel, block: nn.Module, m: int, ids: torch.Tensor, mask: torch.Tensor,
                pos: torch.Tensor | None, wanted: list[int], site: str) -> tuple[Any, dict[int, torch.Tensor]]:
    """One batch through the model up to block ``m`` (the blocks before it replayed): ``(block m's output, the
    states of ``wanted`` layers recorded on the way [b, T, width])``."""
    lmap = loaded.layer_map
    last = m == loaded.num_layers - 1
    # the state after block m is read by a module run after it (final norm, DeBERTa's conv): stop there instead
    deferred = site == "block" and ((last and lmap.final is not None) or (m == 0 and lmap.after_first is not None))
    out: dict[str, Any] = {}

    def keep_output(mod: nn.Module, args: Any, output: Any) -> None:
        out["o"] = output  # the next block's input (through the model's own loop)
        if not deferred:
            raise _StopForward

    rec = Recorder(wanted, site, _chunked(loaded), loaded.num_layers, final=lmap.final is not None and last,
                   after_first=lmap.after_first is not None and m == 0)
    rec.current = m
    rec.deepest = m + 1 if deferred else loaded.num_layers + 1  # else keep_output stops the pass
    handles: list[Any] = []
    try:
        handles += _hooks(loaded, rec, [block], site)
        handles.append(block.register_forward_hook(keep_output))
        run_forward(loaded, ids, mask, pos)
    finally:
        for handle in handles:
            handle.remove()
        if loaded.blocks is not None:
            loaded.blocks.settle()
    return out.get("o"), {i: rec.tensors[i] for i in wanted if i in rec.tensors}


def capture_chunk(
    loaded: LoadedModel,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]],
    layers: Sequence[int],
    site: str = "block",
) -> list[torch.Tensor]:
    """Run a chunk of batches through the model block by block: each block's weights are taken from the checkpoint
    once for the whole chunk (:meth:`~layerwise.model.blocks.Blocks.streamed`), every batch goes through it, and only
    the requested states and each batch's output of the last block run are kept.

    The model's own forward runs for every (block, batch), with the blocks before the current one replaced by
    :class:`_Replay` (they hand over the kept output) and an early exit after the current one, so embeddings, masks,
    positions and everything between blocks are computed exactly as in a whole forward pass.

    Args:
        loaded: a model loaded by depth (``loaded.blocks``).
        batches: ``(input_ids [b, T], attention_mask [b, T], position_ids [b, T] | None)`` per batch.
        layers: resolved indices in ``0..L``, in output order.
        site: the site inside each layer.

    Returns:
        One ``[len(layers), b, T, width]`` per batch, as :func:`capture` would give it.
    """
    blocks = loaded.blocks
    if blocks is None:
        return [capture(loaded, ids, mask, layers, site, position_ids=pos) for ids, mask, pos in batches]
    deepest = max(layers)
    parent_path, _, name = loaded.layer_map.path.rpartition(".")
    container = getattr(resolve_path(loaded.model, parent_path)[0] if parent_path else loaded.model, name)
    # each batch's states are written into one tensor as they come (no second copy to stack them at the end)
    width = loaded.site_width(site)
    kept = [torch.empty((len(layers), *ids.shape, width), dtype=loaded.dtype, device=loaded.device)
            for ids, _, _ in batches]
    slots = {i: [k for k, j in enumerate(layers) if j == i] for i in set(layers)}
    done: list[set[int]] = [set() for _ in batches]
    carried: list[Any] = [None] * len(batches)
    shared: dict[str, Any] = {"output": None}
    before = blocks.reads
    texts = sum(int(ids.shape[0]) for ids, _, _ in batches)
    started = said = time.monotonic()
    with loaded.lock, torch.inference_mode():
        for m in range(deepest):
            if time.monotonic() - said >= PROGRESS_S:  # a long chunk is never silent
                said = time.monotonic()
                notice(f"streaming {loaded.name} block by block: block {m + 1} of {deepest} for a chunk of "
                       f"{len(batches)} batches ({texts} texts), {said - started:.0f} s so far, "
                       f"{(blocks.reads - before) / 1e9:.2f} GB of weights read")
            wanted = [0, m + 1] if m == 0 else [m + 1]
            with blocks.streamed(m, ahead=m + 1 if m + 1 < deepest else None) as block:
                originals = [container[j] for j in range(m)]
                try:
                    for j in range(m):
                        container[j] = _Replay(originals[j], shared)
                    for b, (ids, mask, pos) in enumerate(batches):
                        shared["output"] = carried[b]
                        carried[b], states = _block_step(loaded, block, m, ids, mask, pos, wanted, site)
                        for i, state in states.items():
                            if i in slots:
                                for k in slots[i]:
                                    kept[b][k].copy_(state)
                                done[b].add(i)
                finally:
                    for j, original in enumerate(originals):
                        container[j] = original
                    shared["output"] = None
    log.info("streamed %d blocks for a chunk of %d batches (%d texts): read %.2f GB of weights once for the chunk",
             deepest, len(batches), texts, (blocks.reads - before) / 1e9)
    missing = [i for i in layers if any(i not in d for d in done)]
    if missing:  # pragma: no cover - a layer map error, not a user error
        raise RuntimeError(f"layers {missing} at site {site!r} were not recorded; please report this model")
    return kept


def count_layer_calls(loaded: LoadedModel, input_ids, attention_mask, layers, site="block") -> int:
    """How many encoder layer modules ran (entered their forward) while capturing ``layers``.

    The counting hooks are registered after the capture hooks, so a layer stopped by the early exit before
    its forward body starts is not counted. Used to prove the early exit.
    """
    counter = {"n": 0}
    loaded.ensure_depth(max(layers))

    def bump(module, args):
        counter["n"] += 1

    with torch.inference_mode(), record(loaded, layers, site):
        handles = [m.register_forward_pre_hook(bump) for m in loaded.layer_map.layers]
        try:
            run_forward(loaded, input_ids, attention_mask, None)
        finally:
            for handle in handles:
                handle.remove()
    return counter["n"]

