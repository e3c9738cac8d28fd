"""Any PyTorch module as a layerwise model: the framework-agnostic wrapper behind ``Extractor.from_module``.

A model that is not from transformers at all (a hand-written encoder, a research model) works when you name its
list of layer modules: a module path (``"encoder.layers"``) or the modules themselves. The list is verified as a
chain with one tiny forward pass (each module runs once, in order, returns ``[batch, tokens, width]`` and reads what
the previous one wrote), then the same hooks as for any model record the ``block`` site (and ``raw``, identical
here) with early exit after the deepest requested layer. Layer 0 is the input of the first layer module.

The model is called as ``model(input_ids=ids, attention_mask=mask)`` unless you pass ``call=``, a function
``call(model, input_ids [b, T], attention_mask [b, T]) -> anything``. Windows need the maximum length the model
takes (``max_length=``); without it a learned position table named ``position_embeddings``/``wpe`` is read, else
inputs are never cut.

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Encoder(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = nn.Embedding(30522, 32)
    ...         self.layers = nn.ModuleList(nn.TransformerEncoderLayer(32, 2, 64, batch_first=True) for _ in range(3))
    ...     def forward(self, input_ids, attention_mask):
    ...         x = self.embed(input_ids)
    ...         for layer in self.layers:
    ...             x = layer(x, src_key_padding_mask=attention_mask == 0)
    ...         return x
    >>> lm = wrap_module(Encoder().eval(), lw.Extractor().tokenizer, layer_modules="layers")
    >>> lm.num_layers, lm.hidden_size
    (3, 32)
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from ..errors import MappingError, ModelLoadError
from .discovery import ModelCall, probe_batch, transformers_call, verify_chain
from .families import resolve_path
from .layermap import LayerMap
from .loaded import LoadedModel
from .loading import ensure_pad_token, resolve_device, resolve_dtype, takes_position_ids
from .positions import Positions, positions_of


def _layer_list(module: nn.Module, layer_modules: str | Sequence[nn.Module]) -> tuple[str, list[nn.Module]]:
    if isinstance(layer_modules, str):
        try:
            found = resolve_path(module, layer_modules)
        except ValueError as exc:
            raise ModelLoadError(f"layer_modules={layer_modules!r}: {exc}") from exc
        mods = list(found[0].children()) if len(found) == 1 and isinstance(found[0], nn.ModuleList) else found
        return layer_modules, mods
    if isinstance(layer_modules, nn.Module) and not isinstance(layer_modules, nn.ModuleList):
        raise TypeError("layer_modules must be a module path, an nn.ModuleList or a list of modules, not one module")
    mods = list(layer_modules)
    if not mods or not all(isinstance(m, nn.Module) for m in mods):
        raise TypeError("layer_modules must be a module path string or a non-empty list of the model's layer modules")
    inside = {id(m) for m in module.modules()}
    for i, m in enumerate(mods):
        if id(m) not in inside:
            raise ModelLoadError(f"layer_modules[{i}] ({type(m).__name__}) is not a sub-module of the model")
    names = {id(m): n for n, m in module.named_modules()}
    return ", ".join(names[id(m)] for m in mods[:3]) + (", ..." if len(mods) > 3 else ""), mods


def _fast_tokenizer(tokenizer: Any) -> Any:
    from tokenizers import Tokenizer

    if isinstance(tokenizer, Tokenizer):
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    if not getattr(tokenizer, "is_fast", False):
        raise TypeError(
            f"tokenizer must be a fast tokenizer (transformers PreTrainedTokenizerFast or a tokenizers.Tokenizer); "
            f"got {type(tokenizer).__name__}. layerwise needs offsets and word ids, which only fast tokenizers give"
        )
    ensure_pad_token(tokenizer)
    return tokenizer


def wrap_module(
    module: nn.Module,
    tokenizer: Any,
    layer_modules: str | Sequence[nn.Module],
    *,
    call: ModelCall | None = None,
    max_length: int | None = None,
    device: str | torch.device | None = None,
    compute_dtype: str | torch.dtype | None = None,
    name: str | None = None,
) -> LoadedModel:
    """A :class:`~layerwise.model.loaded.LoadedModel` over any PyTorch module whose layers you name.

    Args:
        module: the model (put in eval mode and moved to ``device``).
        tokenizer: a fast tokenizer (transformers ``PreTrainedTokenizerFast`` or a ``tokenizers.Tokenizer``).
        layer_modules: the layer list: a module path (``"encoder.layers"``) or the modules, in the order they run.
        call: ``call(model, input_ids [b, T], attention_mask [b, T], **extra)``; default
            ``model(input_ids=..., attention_mask=...)``.
        max_length: the longest input the model takes, special tokens included (windows beyond it).
        device: ``"cpu"``, ``"cuda"``...; default: where the module's parameters are.
        compute_dtype: ``"float32"`` (default), ``"float16"``, ``"bfloat16"``.
        name: what to call the model in messages and provenance (default: the module's class name).

    Raises:
        ModelLoadError: the layers are not a chain (each running once, in order, reading the previous output).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_module needs a torch.nn.Module, got {type(module).__name__}")
    tokenizer = _fast_tokenizer(tokenizer)
    first = next(module.parameters(), None)
    dev = resolve_device(device) if device is not None else (first.device if first is not None else torch.device("cpu"))
    torch_dtype = resolve_dtype(compute_dtype, dev)
    module.eval().to(dev, torch_dtype)
    path, mods = _layer_list(module, layer_modules)
    runner = call or transformers_call
    ids, mask = (t.to(dev) for t in probe_batch(tokenizer))
    try:
        width = verify_chain(module, runner, mods, ids, mask, path)
    except MappingError as exc:
        raise ModelLoadError(str(exc)) from exc
    except Exception as exc:  # the module could not even run on a tokenised batch
        raise ModelLoadError(
            f"calling {type(module).__name__} as call(model, input_ids, attention_mask) failed: "
            f"{type(exc).__name__}: {exc}. Pass call=lambda model, ids, mask: ... to say how to run it"
        ) from exc
    label = name or type(module).__name__
    if max_length is not None:
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
            raise ModelLoadError(f"max_length must be an int >= 2, got {max_length!r}")
        positions = Positions("absolute", max_length)
    else:
        positions = positions_of(module, "module", None, tokenizer)
    return LoadedModel(
        model=module,
        tokenizer=tokenizer,
        layer_map=LayerMap("module", "given", path, mods),
        name=label,
        num_layers=len(mods),
        site_widths={"block": width, "raw": width},
        positions=positions,
        device=dev,
        dtype=torch_dtype,
        call=runner,
        accepts_position_ids=call is None and takes_position_ids(module),
    )


__all__ = ["wrap_module"]
