"""Load by depth: which blocks the first question needs, whether they fit, and how the rest of the tree is made.

:func:`plan_depth` decides, from the config and the checkpoint's headers alone (:mod:`layerwise.model.weights`),
before a weight is read:

* the dtype the weights are held in: the checkpoint's own (bf16 stays bf16) when the model computes in float32,
  else the compute dtype;
* the blocks loaded now: ``0..max_layer-1`` when ``max_layer`` bounds the model, else only block 0 (a deeper question
  loads more: :meth:`layerwise.model.blocks.Blocks.ensure`);
* that they fit: the bytes of the weights outside the blocks (the trunk: embeddings, norms, pooler) and of those
  blocks, against what the process may take (:func:`layerwise.model.memory.check_fits`) and against
  ``max_memory``.

:meth:`DepthPlan.load` then has transformers load the model cut after those blocks (its own loader reads only
the tensors a module of the cut model holds), and :meth:`DepthPlan.graft` puts the other blocks back into the layer
list as modules without memory (built on PyTorch's ``meta`` device from the same config), restores the config's
layer count and returns the :class:`~layerwise.model.blocks.Blocks` that loads them later.

Not loaded by depth (loaded whole, as transformers does): hub ids (the files are not local), pickle checkpoints,
``trust_remote_code`` models, ALBERT (one shared block) and models of fewer than two layers.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..errors import ModelLoadError
from .blocks import Blocks
from .discovery import candidate_lists, probe_batch
from .families import resolve_path, table_family
from .layermap import LayerMap
from .memory import check_fits, human, parse_size
from .options import ModelOptions
from .weights import Checkpoint

PER_LAYER_CONFIG_LISTS: tuple[str, ...] = ("layer_types",)  # config lists with one entry per layer
ENCODER_CLASSES = {"t5": "T5EncoderModel", "mt5": "MT5EncoderModel", "umt5": "UMT5EncoderModel"}


def set_depth(config: Any, depth: int, full: Any = None) -> None:
    """Give ``config`` ``depth`` layers: ``num_hidden_layers`` (transformers maps ``n_layer``, ``num_layers``...) and
    the per-layer lists (:data:`PER_LAYER_CONFIG_LISTS`), cut from those of ``full`` (default: ``config``)."""
    full = config if full is None else full
    for key in PER_LAYER_CONFIG_LISTS:
        value = getattr(full, key, None)
        if isinstance(value, (list, tuple)) and len(value) >= depth:
            setattr(config, key, list(value)[:depth])
    config.num_hidden_layers = depth


@contextlib.contextmanager
def quiet_load() -> Iterator[None]:
    """transformers' load report (the cut model does not use the deeper blocks' tensors, by design) silenced, and
    its progress bar off, for one load."""
    from transformers.utils import logging as hf_logging

    level, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bar:
            hf_logging.enable_progress_bar()


def model_class(config: Any) -> Any:
    """The transformers class layerwise loads for ``config``: the encoder class of T5-likes, else ``AutoModel``."""
    import transformers

    name = ENCODER_CLASSES.get(getattr(config, "model_type", ""))
    return getattr(transformers, name) if name else transformers.AutoModel


def _nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    size = torch.tensor([], dtype=dtype).element_size() if t.is_floating_point() else t.element_size()
    return t.numel() * size


class _Primed(Exception):
    """Stops the priming call of :meth:`DepthPlan.graft` at block 0."""


class _Probe:
    """Block 0's output on two short texts (the model's own call, stopped after block 0)."""

    def __init__(self, net: nn.Module, block: nn.Module, call: Callable[..., Any], tokenizer: Any):
        self.net, self.block, self.call = net, block, call
        self.ids, self.mask = probe_batch(tokenizer)

    def run(self, before: bool = False, **extra: Any) -> torch.Tensor | None:
        """Block 0's output ``[2, tokens, hidden]`` (``None`` when the call failed: a mixed-dtype operation); with
        ``before``, the call stops as block 0 starts (nothing is returned: the call's own side effects are wanted,
        e.g. transformers installing its output-recording hooks)."""
        out: dict[str, Any] = {}

        def stop(module: nn.Module, args: Any, output: Any = None) -> None:
            if not before:
                out["o"] = output[0] if isinstance(output, (tuple, list)) else output
            raise _Primed

        handle = (self.block.register_forward_pre_hook(stop) if before else self.block.register_forward_hook(stop))
        device = next(iter(self.net.parameters())).device
        try:
            with torch.inference_mode():
                self.call(self.net, self.ids.to(device), self.mask.to(device), **extra)
        except _Primed:
            pass
        except RuntimeError:  # a module got another's weights in the held dtype and refused the mixed operation
            return None
        finally:
            handle.remove()
        value = out.get("o")
        return value if isinstance(value, torch.Tensor) else None

    def equals(self, reference: torch.Tensor, blocks: Blocks) -> bool:
        """Whether block 0 now gives ``reference`` bit for bit."""
        try:
            got = self.run()
        finally:
            blocks.settle()
        return got is not None and got.dtype == reference.dtype and torch.equal(got, reference)


@dataclass
class DepthPlan:
    """What :func:`plan_depth` decided (see the module docstring)."""

    checkpoint: Checkpoint
    config: Any
    num_layers: int
    path: str
    skeleton: list[nn.Module]
    held: torch.dtype
    compute: torch.dtype
    device: torch.device
    first: int
    bound: int | None
    budget: int | None
    trunk_bytes: int

    def load(self, read: Callable[[Any, torch.dtype], nn.Module]) -> nn.Module:
        """``read(config, dtype)`` (transformers' loader) on the config cut after the first :attr:`first` blocks."""
        cut = copy.deepcopy(self.config)
        # only the count: the per-layer lists stay whole, since modules outside the blocks are built from them
        # (ModernBERT's rotary embedding makes one table per attention kind the model will ever use)
        cut.num_hidden_layers = self.first
        with quiet_load():  # in the compute dtype: buffers made at init (Gemma's embedding scale) are not rounded
            return read(cut, self.compute)

    def container(self, net: nn.Module) -> nn.ModuleList | None:
        """The layer list of ``net`` at :attr:`path` (``None`` when it is not a list of :attr:`first` blocks)."""
        try:
            found = resolve_path(net, self.path)[0]
        except ModelLoadError:
            return None
        return found if isinstance(found, nn.ModuleList) and len(found) in (self.first, self.num_layers) else None

    def graft(self, net: nn.Module, call: Callable[..., Any], tokenizer: Any) -> bool:
        """Put the blocks not loaded into ``net``'s layer list (on ``meta``: no memory) and restore the config's
        layer count; then run ``net`` once into block 0 (``call(net, ids, mask, output_hidden_states=True)``), so
        that transformers installs its output-recording hooks on every block, as at a whole model's first call.
        ``False`` when the layer list is not where the plan found it (the caller then loads the model whole)."""
        container = self.container(net)
        if container is None or len(container) != self.first:
            return False
        for block in self.skeleton[self.first:]:
            container.append(block.eval())
        set_depth(net.config, self.num_layers, self.config)

        _Probe(net, container[0], call, tokenizer).run(before=True, output_hidden_states=True)
        return True

    @contextlib.contextmanager
    def resident_view(self, net: nn.Module) -> Iterator[None]:
        """``net`` seen with only its resident blocks (the layer list and the config's count cut to them), for the
        checks made at load (discovery's verifying forward pass, positions); restored on exit."""
        container = self.container(net)
        parent_path, _, name = self.path.rpartition(".")
        parent = resolve_path(net, parent_path)[0] if parent_path else net
        config: Any = net.config
        if container is None:
            yield
            return
        setattr(parent, name, nn.ModuleList(list(container)[: self.first]))
        config.num_hidden_layers = self.first
        try:
            yield
        finally:
            setattr(parent, name, container)
            config.num_hidden_layers = self.num_layers

    def blocks(self, net: nn.Module, call: Callable[..., Any], tokenizer: Any) -> Blocks | None:
        """The :class:`Blocks` of a grafted ``net``, with the casts of held weights in place (so the checks made at
        load run as every later call does); ``None`` when the checkpoint's names cannot be proven on block 0 (the
        caller then loads the model whole).

        Holding weights narrower than the compute dtype is proven too: block 0's output on two short texts must
        equal, bit for bit, the output of the model as transformers loaded it (in the compute dtype). Casting module
        by module is tried first (at most one matrix cast at a time), then block by block (for models whose modules
        read each other's weights directly: T5's feed-forward, DeBERTa v1's attention); when neither is equal, the
        weights are held in the compute dtype (``describe()["weights"]["held_dtype"]`` says so)."""
        container = self.container(net)
        if container is None:
            return None
        prefix = self._prefix(container[0])
        if prefix is None:
            return None
        probe = _Probe(net, container[0], call, tokenizer)
        reference = probe.run() if self.held != self.compute else None
        undo = self._hold(net, container) if self.held != self.compute else None
        blocks = Blocks(list(container), self.checkpoint, prefix, held=self.held, compute=self.compute,
                        device=self.device, resident=self.first, bound=self.bound, budget=self.budget,
                        trunk_bytes=self.trunk_bytes)
        if not self._proven(blocks, container[0]):
            return None
        if blocks.upcast is not None and reference is not None and undo is not None:
            for scope in ("module", "block"):
                blocks.set_cast(scope)
                if probe.equals(reference, blocks):
                    break
            else:
                blocks.hold_in_compute()  # held in the compute dtype from now on
                undo()
                self.held = self.compute
        blocks.guard(net)
        return blocks

    def attach(self, blocks: Blocks, layer_map: LayerMap) -> bool:
        """Give ``layer_map`` (found on the resident blocks) every block; ``False`` when it found another list."""
        if layer_map.path != self.path:
            return False
        layer_map.layers = list(blocks.layers)
        return True

    def _prefix(self, block: nn.Module) -> str | None:
        """The checkpoint's name of the layer list (``"model.layers."``), learnt from block 0's first tensor."""
        names = [n for n, _ in block.named_parameters()]
        if not names:
            return None
        first = names[0]
        forms = [first] + [first[: -len(a)] + b for a, b in ((".weight", ".gamma"), (".bias", ".beta"))
                           if first.endswith(a)]
        for form in forms:
            suffix = f"{self.path}.0.{form}"
            hits = [k for k in self.checkpoint.entries if k == suffix or k.endswith("." + suffix)]
            if hits:
                key = min(hits, key=len)
                return key[: -len(f"0.{form}")]
        return None

    def _proven(self, blocks: Blocks, block: nn.Module) -> bool:
        """Every tensor of block 0 (loaded by transformers) equals the checkpoint's under the learnt names."""
        buffers = dict(block.named_buffers())
        for name, t in block.state_dict().items():
            try:
                source = self.checkpoint.tensor(blocks.key(0, name))
            except KeyError:
                if name in buffers:
                    continue  # a buffer transformers computes (not in the file)
                return False
            if tuple(source.shape) != tuple(t.shape) or not torch.equal(source.to(t.dtype), t.cpu()):
                return False
        return True

    def _hold(self, net: nn.Module, container: nn.ModuleList) -> Callable[[], None]:
        """Hold the loaded blocks' weights, and a plain input embedding matrix (whose lookups are then cast), in the
        held dtype where that is exact (they came from a checkpoint in that dtype); the rest of the trunk stays in
        the compute dtype. Returns what puts the embedding matrix back in the compute dtype."""
        embeddings: Any = net.get_input_embeddings() if hasattr(net, "get_input_embeddings") else None  # type: ignore[operator]
        # a plain lookup is exact whatever dtype it reads; a subclass may compute in its forward (Gemma scales)
        plain = type(embeddings) is nn.Embedding
        owners = [container[m] for m in range(self.first)] + ([embeddings] if plain else [])
        with torch.no_grad():
            for owner in owners:
                for p in owner.parameters():
                    if p.is_floating_point() and p.dtype != self.held:
                        narrow = p.data.to(self.held)
                        if torch.equal(narrow.to(p.dtype), p.data):
                            p.data = narrow
        if not plain:
            return lambda: None
        compute = self.compute
        handle = embeddings.register_forward_hook(lambda module, args, out: out.to(compute))

        def undo() -> None:
            handle.remove()
            for p in embeddings.parameters():
                p.data = p.data.to(compute)

        return undo


def _skeleton(cls: Any, config: Any, dtype: torch.dtype) -> nn.Module | None:
    """The model of ``config`` built on the ``meta`` device (no memory; the encoder of an encoder-decoder), or
    ``None`` when its construction cannot run there."""
    try:
        with torch.device("meta"), quiet_load():
            net = (cls.from_config(copy.deepcopy(config), dtype=dtype) if hasattr(cls, "from_config")
                   else cls(copy.deepcopy(config)).to(dtype))
    except Exception:  # noqa: BLE001 - an architecture whose init cannot run on meta: the caller loads it whole
        return None
    return net


def _layer_path(skeleton: nn.Module, family_path: str | None, given: str | None, n_layers: int) -> str | None:
    if family_path is not None:
        return family_path
    if given is not None:
        return given
    found = candidate_lists(skeleton, n_layers)
    return found[0][0] if found else None


def plan_depth(source: str, config: Any, opts: ModelOptions, compute: torch.dtype,
               device: torch.device) -> DepthPlan | str:
    """The :class:`DepthPlan` for a local model directory, or why it is loaded whole (a phrase: see the module
    docstring).

    Raises:
        ModelLoadError: ``max_layer`` out of range; the weights outside the blocks exceed ``max_memory``; the first
            blocks do not fit in the memory this process may take (the numbers and the fixes).
    """
    model_type = str(getattr(config, "model_type", ""))
    family = table_family(model_type)
    if opts.trust_remote_code:
        return "its modelling code is the repository's own (trust_remote_code)"
    if family is not None and family.name == "albert":
        return "ALBERT runs one shared block for every layer"
    cls = model_class(config)
    if getattr(config, "is_encoder_decoder", False) and cls.__name__ == "AutoModel":
        return "an encoder-decoder other than T5 loads its decoder too"
    try:
        checkpoint = Checkpoint.open(source)
    except ModelLoadError:
        if not any(Path(source).glob("*.safetensors")):
            return "its weights are a pickle checkpoint, not safetensors"
        raise
    n_layers = family.num_layers(config) if family is not None else int(getattr(config, "num_hidden_layers", 0) or 0)
    if n_layers < 2:
        return f"it has {n_layers} layer"
    held = checkpoint.dtype if compute == torch.float32 and checkpoint.dtype in (torch.bfloat16, torch.float16) \
        else compute
    skeleton = _skeleton(cls, config, held)
    cut = copy.deepcopy(config)
    cut.num_hidden_layers = 1
    short = _skeleton(cls, cut, held)
    if skeleton is None or short is None:
        return "its module tree cannot be built without memory (on the meta device)"
    path = _layer_path(skeleton, family.layer_paths[0] if family is not None else None, opts.layer_modules, n_layers)
    if path is None:
        return f"no list of {n_layers} layer modules was found in it"
    try:
        container = resolve_path(skeleton, path)[0]
    except ModelLoadError:
        return f"its layer list {path!r} was not found"
    if not isinstance(container, nn.ModuleList) or len(container) != n_layers:
        return f"{path!r} is not a list of {n_layers} modules"
    outside = {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if not k.startswith(path + ".")}
    if outside != {k: tuple(v.shape) for k, v in short.state_dict().items() if not k.startswith(path + ".")}:
        return "its modules outside the layer list depend on the number of layers"
    blocks = list(container)
    block_ids = {id(t) for b in blocks for t in (*b.parameters(), *b.buffers())}
    embeddings: Any = skeleton.get_input_embeddings() if hasattr(skeleton, "get_input_embeddings") else None  # type: ignore[operator]
    emb_ids = {id(p) for p in embeddings.parameters()} if type(embeddings) is nn.Embedding else set()
    trunk = sum(_nbytes(t, held if id(t) in emb_ids else compute)
                for t in (*skeleton.parameters(), *skeleton.buffers()) if id(t) not in block_ids)
    per_block = [sum(_nbytes(t, held) for t in (*b.parameters(), *b.buffers())) for b in blocks]
    bound = resolve_max_layer(opts.max_layer, n_layers)
    first = max(1, bound if bound is not None else 1)
    budget = parse_size(opts.max_memory) if opts.max_memory is not None else None
    # transformers reads the trunk and the first blocks in the compute dtype; the blocks are then narrowed
    loading = sum(_nbytes(t, compute) for t in (*skeleton.parameters(), *skeleton.buffers()) if id(t) not in block_ids)
    loading += sum(sum(_nbytes(t, compute) for t in (*b.parameters(), *b.buffers())) for b in blocks[:first])
    needed = trunk + sum(per_block[:first])
    what = f"the weights of layers 0..{first} of this {model_type or 'model'} ({str(held)[6:]})"
    if budget is not None and needed > budget:
        raise ModelLoadError(
            f"{what} need {human(needed)}, more than max_memory={opts.max_memory!r} ({human(budget)}); the weights "
            f"outside the blocks alone take {human(trunk)}. Raise max_memory, or lower max_layer")
    bf16 = "" if held in (torch.bfloat16, torch.float16) else "load with compute_dtype='bfloat16', "
    check_fits(max(needed, loading), what, f"Ask for a shallower max_layer, {bf16}or set max_memory (CLI --max-memory) "
                                           f"to run the model block by block.", str(device))
    return DepthPlan(checkpoint, config, n_layers, path, blocks, held, compute, device, first, bound, budget, trunk)


def resolve_max_layer(value: int | None, n_layers: int) -> int | None:
    """``max_layer`` as a layer index ``0..L`` (negative counts from the end, -1 is ``L``), or ``None``.

    Raises:
        ModelLoadError: out of range, naming the valid range.
    """
    if value is None:
        return None
    index = value + n_layers + 1 if value < 0 else value
    if not 0 <= index <= n_layers:
        raise ModelLoadError(f"max_layer={value} is out of range for this model of {n_layers} layers; valid: "
                             f"0..{n_layers} or -{n_layers + 1}..-1 (-1 is the last layer)")
    return index


__all__ = ["DepthPlan", "ENCODER_CLASSES", "PER_LAYER_CONFIG_LISTS", "model_class", "plan_depth", "quiet_load",
           "resolve_max_layer", "set_depth"]
