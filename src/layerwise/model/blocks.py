"""Which blocks of a model are in memory: loaded by depth, grown on demand, streamed one at a time.

A model loaded from a local safetensors checkpoint keeps its full module tree, but only the first blocks (the layer
modules, ``layer_map.layers``) that a question needs hold weights; the others are on PyTorch's ``meta`` device (no
memory) until a deeper layer is asked for. :class:`Blocks` owns that state:

* :meth:`Blocks.ensure` loads the missing blocks ``resident..k-1`` from the checkpoint (each tensor copied out of the
  memory-mapped file; the memory they need is checked first, :func:`layerwise.model.memory.check_fits`);
* :meth:`Blocks.streamed` gives block ``m`` for one step of a layer-by-layer run (its tensors are views of the file's
  pages, released after the step): how a model larger than ``max_memory`` runs
  (:func:`layerwise.model.capture.capture_chunk`);
* the weights stay in the checkpoint's dtype (a bf16 checkpoint is held in bf16); when the model computes in float32,
  each module of a block that owns weights (a linear layer, a norm) is cast to float32 for the length of its own
  forward call (a pre-hook casts, a post-hook puts the held weights back: at most one matrix is cast at a time), the
  input embedding matrix's output is cast after the lookup, and the small rest (position embeddings, norms, the
  pooler) is held in float32. The cast is exact, so the states equal a float32 load.

Checkpoint names: the name of a block's tensor in the file is the model's name with the prefix the checkpoint uses
(``model.`` for a ``*ForCausalLM`` checkpoint, ``bert.`` for a ``BertForMaskedLM`` one...) and the old
``LayerNorm.gamma``/``beta`` names where the file has them. The prefix is learnt from block 0, which transformers
loads itself, and proven there: every tensor of block 0 must equal the file's, else the model is loaded whole.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import ModelLoadError
from .memory import check_fits, human
from .transfer import GpuFeed, Source
from .weights import Checkpoint

log = logging.getLogger("layerwise")
CAST_SCOPES = ("module", "block")  # how held weights are cast for compute (Blocks.set_cast)
_LEGACY = ((".weight", ".gamma"), (".bias", ".beta"))  # LayerNorm names of old (TF-converted) checkpoints


def _tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, torch.Tensor, bool]]:
    """Every parameter and buffer of ``module``: ``(relative name, owner, attribute, tensor, is_parameter)``."""
    for mod_name, mod in module.named_modules():
        for attr, p in list(mod.named_parameters(recurse=False)):
            yield (f"{mod_name}.{attr}" if mod_name else attr), mod, attr, p, True
        for attr, b in list(mod.named_buffers(recurse=False)):
            yield (f"{mod_name}.{attr}" if mod_name else attr), mod, attr, b, False


def _set(owner: nn.Module, attr: str, value: torch.Tensor, is_param: bool, trainable: bool = False) -> None:
    if is_param:
        owner.register_parameter(attr, nn.Parameter(value, requires_grad=trainable and value.is_floating_point()))
    else:
        setattr(owner, attr, value)  # a registered buffer stays one (and keeps its persistence)


class _Upcast:
    """Forward hooks that run a module in ``dtype`` while its weights are held in a narrower one: each module that
    owns weights (a linear layer, a norm) is cast on entry and put back on exit, so the cast copy of a block is never
    more than its largest matrix at a time."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.recurse = False  # True: a hooked module's submodules' weights are cast with its own (whole blocks)
        self.held: dict[int, list[tuple[torch.nn.Parameter, torch.Tensor]]] = {}

    def pre(self, module: nn.Module, args: Any) -> None:
        self.put_back(module)
        stash = self.held[id(module)] = []
        for p in module.parameters(recurse=self.recurse):
            if p.is_floating_point() and p.dtype != self.dtype:
                stash.append((p, p.data))
                p.data = p.data.to(self.dtype)

    def post(self, module: nn.Module, args: Any, output: Any) -> None:
        self.put_back(module)

    def put_back(self, module: nn.Module) -> None:
        """Give ``module`` its held weights back."""
        for p, data in self.held.pop(id(module), ()):
            p.data = data

    def restore(self) -> None:
        """Put every held weight back (also after a forward pass stopped inside a block)."""
        for stash in self.held.values():
            for p, data in stash:
                p.data = data
        self.held.clear()


class Blocks:
    """The blocks of one model, which of them hold weights, and how the missing ones are read.

    Args:
        layers: the layer modules in call order; those from ``resident`` on are on the ``meta`` device.
        checkpoint: the model's safetensors files.
        prefix: the checkpoint's name of ``layers[m]`` is ``f"{prefix}{m}."`` + the module's own tensor name.
        held: the dtype the weights are held in; ``compute``: the dtype the blocks run in.
        device: where resident blocks live.
        resident: how many blocks (from the first) hold weights.
        bound: the deepest layer this model may run (``ModelOptions.max_layer``), or ``None``.
        budget: ``ModelOptions.max_memory`` in bytes: above it, blocks are streamed; ``None``: no budget.
        trunk_bytes: bytes of the weights outside the blocks (always resident).
    """

    def __init__(self, layers: list[nn.Module], checkpoint: Checkpoint, prefix: str, *, held: torch.dtype,
                 compute: torch.dtype, device: torch.device, resident: int, bound: int | None, budget: int | None,
                 trunk_bytes: int):
        self.layers = layers
        self.checkpoint = checkpoint
        self.prefix = prefix
        self.held, self.compute, self.device = held, compute, device
        self.resident = resident
        self.bound = bound
        self.budget = budget
        self.trunk_bytes = trunk_bytes
        self.upcast = _Upcast(compute) if held != compute else None
        self.cast = "module"  # "module": each weight-owning module cast for its own call; "block": whole blocks
        self._handles: list[Any] = []
        self.reads = 0  # bytes read from the checkpoint by streamed steps (for the log and tests)
        self.inside = 0  # > 0 while layerwise runs the model (a capture: it loads what it needs itself)
        self.feed: GpuFeed | None = None  # how streamed blocks reach a GPU (made at the first streamed step there)
        self._template = {name: t for name, _, _, t, param in _tensors(layers[0]) if not param} if layers else {}
        self.block_bytes = [self._bytes(m) for m in range(len(layers))]
        for m in range(len(layers)):
            self._hook(m)

    # ---- facts ---------------------------------------------------------------------------------------------
    def _bytes(self, m: int) -> int:
        size = torch.tensor([], dtype=self.held).element_size()
        return sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                   for _, _, _, t, _ in _tensors(self.layers[m]))

    def needed(self, depth: int) -> int:
        """Bytes of the blocks layers ``0..depth`` need (blocks ``0..depth-1``) in the held dtype."""
        return sum(self.block_bytes[:depth])

    def streams(self, depth: int) -> bool:
        """Whether layers ``0..depth`` run block by block: their blocks do not fit ``max_memory`` beside the trunk
        (blocks already resident count as fitting)."""
        if self.budget is None or depth <= self.resident or (self.bound is not None and depth > self.bound):
            return False  # (past max_layer: ensure() refuses it)
        return self.trunk_bytes + self.needed(depth) > self.budget

    def room(self) -> int:
        """Bytes ``max_memory`` leaves for a streamed chunk's states: the budget less the trunk, the resident blocks
        and the widest block (held, and its float32 copy while it runs: one matrix at a time, or the whole block
        where it is cast per block; on a GPU twice, the next block moving in beside it); 0 without a budget or when
        it is spent."""
        if self.budget is None:
            return 0
        widest = max(self.block_bytes, default=0)
        slots = 2 if self.device.type == "cuda" else 1  # on a GPU the next block moves in beside the running one
        ratio = torch.tensor([], dtype=self.compute).element_size() / torch.tensor([], dtype=self.held).element_size()
        cast = 0 if self.upcast is None else int(widest * ratio) if self.cast == "block" else int(widest * ratio / 2)
        return max(0, self.budget - self.trunk_bytes - self.needed(self.resident) - slots * widest - cast)

    def chunk_batches(self, batch_bytes: int) -> int:
        """How many batches of ``batch_bytes`` each (their kept states and working activations) a streamed chunk
        holds within ``max_memory``, beside the trunk, the resident blocks and the block being run (held, and its
        float32 copy while it runs: one matrix at a time, or the whole block where it is cast per block): at least 1
        (a warning in the log says when the budget is already spent on weights)."""
        if self.budget is None:
            return 1
        room = self.room()
        if room < batch_bytes:
            log.warning("max_memory=%s leaves %s for a streamed chunk after the weights; running one batch at a "
                        "time (each block is then read once per batch)", human(self.budget), human(max(0, room)))
        return int(max(1, min(4096, room // max(1, batch_bytes))))

    def describe(self) -> dict[str, Any]:
        """What is in memory: ``{"resident_blocks", "blocks", "held_dtype", "cast" (``"per module"``, ``"per
        block"`` or ``None`` when nothing is cast), "weights_bytes", "checkpoint_bytes", "max_layer", "max_memory",
        "streamed"}``, and ``"transfer"`` (:meth:`~layerwise.model.transfer.GpuFeed.describe`) once blocks have
        streamed to a GPU."""
        return {
            "resident_blocks": self.resident, "blocks": len(self.layers),
            "held_dtype": str(self.held).replace("torch.", ""),
            "cast": None if self.upcast is None else f"per {self.cast}",
            "weights_bytes": self.trunk_bytes + self.needed(self.resident),
            "checkpoint_bytes": self.checkpoint.total_bytes, "max_layer": self.bound, "max_memory": self.budget,
            "streamed": self.streams(len(self.layers)),
            **({"transfer": self.feed.describe()} if self.feed is not None else {}),
        }

    # ---- hooks ---------------------------------------------------------------------------------------------
    def guard(self, model: nn.Module) -> None:
        """Make a direct call of ``model`` (``ex.model(**batch, output_hidden_states=True)``, outside layerwise's
        captures) load every block first, so the module behaves as the whole transformers model."""

        def whole(module: nn.Module, args: Any, kwargs: Any) -> None:
            if module is model and not self.inside:
                self.ensure(len(self.layers))

        model.register_forward_pre_hook(whole, with_kwargs=True)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """Mark a forward pass run by layerwise (which loads or streams the blocks it needs)."""
        self.inside += 1
        try:
            yield
        finally:
            self.inside -= 1

    def _hook(self, m: int) -> None:
        if self.upcast is None:
            return
        owners = [self.layers[m]] if self.cast == "block" else \
            [mod for mod in self.layers[m].modules() if any(True for _ in mod.parameters(recurse=False))]
        for module in owners:
            self._handles.append(module.register_forward_pre_hook(self.upcast.pre))
            self._handles.append(module.register_forward_hook(self.upcast.post))

    def set_cast(self, scope: str) -> None:
        """Cast ``"module"`` by module (each module that owns weights, for its own call: at most one matrix at a
        time) or whole ``"block"`` by block (one block's float32 copy while it runs). Per block is for models whose
        modules read each other's weights directly (T5's feed-forward casts its input to ``wo.weight``'s dtype,
        DeBERTa v1's attention reads ``in_proj.weight``); :class:`layerwise.model.depth.DepthPlan` tells at load."""
        if scope not in CAST_SCOPES:
            raise ModelLoadError(f"unknown cast scope {scope!r}. Valid scopes are: {', '.join(CAST_SCOPES)}")
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.settle()
        self.cast = scope
        if self.upcast is not None:
            self.upcast.recurse = scope == "block"
        for m in range(len(self.layers)):
            self._hook(m)

    def hold_in_compute(self) -> None:
        """Hold the resident blocks' weights in the compute dtype for good: for fine-tuning (it updates them in place;
        the per-call casts would hand the optimiser a copy), and for a model whose narrowed weights could not be
        proven at load. Later blocks load in the compute dtype too."""
        if self.upcast is None:
            return
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.settle()
        with torch.no_grad():
            for m in range(self.resident):
                for p in self.layers[m].parameters():
                    if p.is_floating_point() and p.dtype != self.compute:
                        p.data = p.data.to(self.compute)
        self.held, self.upcast = self.compute, None

    def settle(self) -> None:
        """Put every block's held weights back (after a forward pass that stopped inside a block)."""
        if self.upcast is not None:
            self.upcast.restore()

    # ---- reading -------------------------------------------------------------------------------------------
    def key(self, m: int, name: str) -> str:
        """The checkpoint's name of tensor ``name`` of block ``m`` (``KeyError`` when the file lacks it)."""
        base = f"{self.prefix}{m}."
        forms = [name] + [name[: -len(old)] + new for old, new in _LEGACY if name.endswith(old)]
        for form in forms:
            if base + form in self.checkpoint.entries:
                return base + form
        raise KeyError(base + name)

    def sources(self, m: int) -> list[Source]:
        """What block ``m``'s tensors that hold no weights yet are to be given: each one's checkpoint key and view of
        the file (or, for a buffer the file lacks, such as a causal mask, block 0's) and the dtype it is held in.

        Raises:
            ModelLoadError: the checkpoint lacks one of its parameters, or holds it in another shape than the config's.
        """
        found = []
        for name, owner, attr, t, is_param in _tensors(self.layers[m]):
            if not t.is_meta:
                continue
            key: str | None
            try:
                key = self.key(m, name)
                source = self.checkpoint.tensor(key)
            except KeyError as exc:
                if is_param:
                    raise ModelLoadError(f"the checkpoint has no tensor {exc.args[0]!r} for block {m}; it is "
                                         f"incomplete: download or save the model again") from exc
                key, source = None, self._template[name]  # a buffer the file lacks (causal masks...): block 0's
            if tuple(source.shape) != tuple(t.shape):
                raise ModelLoadError(f"tensor {name!r} of block {m} is {tuple(source.shape)} in the checkpoint and "
                                     f"{tuple(t.shape)} in the model's config; the config does not match the weights")
            # held == compute: the compute dtype, as asked; else (a narrower checkpoint under float32 compute) the
            # file's own dtype, which is exact (a tensor the file keeps in float32 stays float32)
            dtype = (self.held if self.held == self.compute else source.dtype) if t.is_floating_point() else t.dtype
            found.append(Source(name, owner, attr, is_param, key, source, dtype))
        return found

    def _fill(self, m: int, copy: bool) -> int:
        """Give block ``m`` its weights from the checkpoint (copies, or views of the file); returns bytes read."""
        read = 0
        for s in self.sources(m):
            if s.key is not None and s.is_param:
                read += s.source.numel() * s.source.element_size()
            value = s.source.to(self.device, s.dtype, copy=copy) if copy or s.source.dtype != s.dtype or \
                self.device.type != "cpu" else s.source
            _set(s.owner, s.attr, value, s.is_param, trainable=copy)  # a resident block trains like transformers'
            if value is not s.source and s.key is not None:  # the copy is used: the file's pages need not stay mapped
                self.checkpoint.release(s.key)
        return read

    def _feed(self) -> GpuFeed:
        """The GPU feed of streamed blocks (made at the first streamed step on a GPU)."""
        if self.feed is None:
            self.feed = GpuFeed(self.device, sum(self.block_bytes[self.resident:]), self.checkpoint.release)
        return self.feed

    def _placed(self, m: int, ahead: int | None) -> int:
        """Give block ``m`` its weights on the GPU through the feed, and start moving block ``ahead``; bytes read."""
        feed = self._feed()
        sources = self.sources(m)
        tensors, read = feed.take(m, sources)
        for s in sources:
            _set(s.owner, s.attr, tensors[s.name], s.is_param)
        if ahead is not None and self.resident <= ahead < len(self.layers):
            feed.fetch(ahead, self.sources(ahead))
        return read

    def _empty(self, m: int) -> None:
        for _, owner, attr, t, is_param in _tensors(self.layers[m]):
            _set(owner, attr, torch.empty_like(t, device="meta"), is_param)

    def ensure(self, depth: int) -> None:
        """Load the blocks layers ``0..depth`` need that are not in memory yet.

        Raises:
            ModelLoadError: ``depth`` is past ``max_layer``; or the blocks do not fit in the memory this process may
                take (the numbers, and what to do).
        """
        depth = min(depth, len(self.layers))
        if depth <= self.resident:
            return
        if self.bound is not None and depth > self.bound:
            raise ModelLoadError(
                f"layer {depth} is deeper than max_layer={self.bound}, the depth this model was loaded with; load "
                f"it with a larger max_layer (or none), or ask for layers 0..{self.bound}")
        more = self.needed(depth) - self.needed(self.resident)
        bf16 = "" if self.held in (torch.bfloat16, torch.float16) else "load with compute_dtype='bfloat16', "
        check_fits(more, f"blocks {self.resident}..{depth - 1} (for layer {depth}, {str(self.held)[6:]})",
                   f"Ask for a shallower layer, {bf16}or set max_memory (CLI --max-memory) to run the model block by "
                   f"block.", str(self.device))
        for m in range(self.resident, depth):
            self._fill(m, copy=True)
            self.resident = m + 1
        log.info("loaded blocks up to %d of %d (%s in memory)", depth, len(self.layers),
                 human(self.trunk_bytes + self.needed(depth)))

    @contextlib.contextmanager
    def streamed(self, m: int, ahead: int | None = None) -> Iterator[nn.Module]:
        """Block ``m`` with weights for one step of a layer-by-layer run: a resident block as it is; any other read
        from the checkpoint's pages (copied only into another dtype) and released on exit. On a GPU the block comes
        through :class:`~layerwise.model.transfer.GpuFeed` (pinned, copied on its own stream) and block ``ahead``,
        the next one the run takes, starts moving now, overlapping this block's compute."""
        if m < self.resident:
            yield self.layers[m]
            return
        try:
            self.reads += self._placed(m, ahead) if self.device.type == "cuda" else self._fill(m, copy=False)
            yield self.layers[m]
        finally:
            self.settle()
            if self.feed is not None:
                self.feed.done(m)
            names = [name for name, *_ in _tensors(self.layers[m])]
            self._empty(m)
            for name in names:  # the views are gone: their pages need not stay mapped in
                with contextlib.suppress(KeyError):
                    self.checkpoint.release(self.key(m, name))

    def state_items(self, state: dict[str, torch.Tensor], path: str) -> Iterator[tuple[str, torch.Tensor]]:
        """``state`` (a model's ``state_dict``, whose non-resident block tensors are on ``meta``) in name order, with
        those tensors read from the checkpoint one at a time, in the dtype a load would give them (their pages are
        dropped again once the caller has moved on): the values a whole-model load holds, for fingerprints."""
        start = path + "."
        for name in sorted(state):
            t = state[name]
            if not (t.is_meta and name.startswith(start)):
                yield name, t
                continue
            m_text, _, rest = name[len(start):].partition(".")
            try:
                key = self.key(int(m_text), rest)
            except KeyError:
                yield name, self._template.get(rest, t)
                continue
            source = self.checkpoint.tensor(key)
            dtype = (self.held if self.held == self.compute else source.dtype) if t.is_floating_point() else t.dtype
            yield name, source.to(dtype)
            self.checkpoint.release(key)


__all__ = ["CAST_SCOPES", "Blocks"]
