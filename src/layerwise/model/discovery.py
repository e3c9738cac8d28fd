"""Find the layers of any model, and prove the mapping with one tiny forward pass before any real work.

For a model without a row in :mod:`layerwise.model.families`, :func:`discover` looks for the module list that produces
``hidden_states[1..L]``: every ``nn.ModuleList`` of length ``L`` (``L + 1`` = the number of ``hidden_states`` the
model returns), the one whose items are transformers' own recorded layer class first. It then runs the model once
on two short texts with ``output_hidden_states=True`` and once with hooks on the candidate, and accepts it only if

* each item runs exactly once, in order;
* the first item's input equals ``hidden_states[0]`` and item ``i``'s output equals ``hidden_states[i]``
  (masked-in tokens, within 1e-5 relative);
* the last item's output equals ``hidden_states[L]``, or one module run after the last item reads its output and
  writes ``hidden_states[L]`` (the final norm of decoders, T5 and ModernBERT: the ``final`` of the
  :class:`~layerwise.model.layermap.LayerMap`).

A wrong guess is therefore an error at load (:class:`MappingError`, naming what was tried and how to pass
``layer_modules=`` by hand), never wrong numbers later. Results are cached per model class and configuration, so loading
the same architecture again costs no forward pass.

Sub-layer sites of a discovered model are found by name inside the layer module (first match wins) and kept only
if the module runs once per layer and gives ``[batch, tokens, width]``; their widths are measured:

================  =================================================================================================
site              module (read)
================  =================================================================================================
``attention``     ``attention``, ``self_attn``, ``attn``, ``self_attention``, ``layer.0`` (T5) (its output)
``intermediate``  the feed-forward output projection's input: ``output.dense``, ``mlp.down_proj``, ``mlp.c_proj``,
                  ``mlp.fc2``, ``fc2``, ``mlp.dense_4h_to_h``, ``mlp.Wo``, ``mlp.fc_out``, ``mlp.w2``,
                  ``feed_forward.w2``, ``layer.1.DenseReluDense.wo`` (the activations after the activation function;
                  for gated MLPs the gated product)
``pre_ln``        the input of the output LayerNorm of post-LN layers: ``output.LayerNorm``, ``output_layer_norm``
================  =================================================================================================

A module that is not from transformers at all is mapped by :func:`verify_chain` from the list the caller names:
each item runs once, in order, and reads what the previous one wrote.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any, Callable, Sequence

import torch
from torch import nn

from ..errors import MappingError
from .families import resolve_path
from .layermap import LayerMap, Where

# (model, input_ids [b, T], attention_mask [b, T], **extra such as position_ids) -> whatever the model returns
ModelCall = Callable[..., Any]

SITE_RULES: dict[str, tuple[tuple[str, Where], ...]] = {
    "attention": (("attention", "out"), ("self_attn", "out"), ("attn", "out"), ("self_attention", "out"),
                  ("layer.0", "out")),
    "intermediate": (("output.dense", "in"), ("mlp.down_proj", "in"), ("mlp.c_proj", "in"), ("mlp.fc2", "in"),
                     ("fc2", "in"), ("mlp.dense_4h_to_h", "in"), ("mlp.Wo", "in"), ("mlp.fc_out", "in"),
                     ("mlp.w2", "in"), ("feed_forward.w2", "in"), ("layer.1.DenseReluDense.wo", "in")),
    "pre_ln": (("output.LayerNorm", "in"), ("output_layer_norm", "in")),
}
PROBE_TEXTS = ("layerwise checks the layer map of this model once", "hello world")
_TOLERANCE = 1e-5

_cache: dict[tuple[str, str], tuple[str, str | None, dict[str, tuple[str, Where]], dict[str, int]]] = {}
_cache_lock = threading.Lock()


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) and value else value


def _same(a: Any, b: torch.Tensor, keep: torch.Tensor) -> bool:
    """``a`` equals ``b`` on the masked-in tokens ``keep [b, T]`` (relative tolerance)."""
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    x, y = a[keep].float(), b[keep].float()
    scale = max(1.0, float(y.abs().max())) if y.numel() else 1.0
    return bool(torch.isfinite(x).all()) and float((x - y).abs().max()) <= _TOLERANCE * scale


def probe_batch(tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Two short texts, right-padded: ``(input_ids [2, T], attention_mask [2, T])``."""
    rows = [tokenizer(t, add_special_tokens=True)["input_ids"] for t in PROBE_TEXTS]
    longest = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (longest - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
    return ids, mask


def candidate_lists(model: nn.Module, n_layers: int) -> list[tuple[str, nn.ModuleList]]:
    """Module lists of length ``n_layers``; transformers' recorded layer class first, then the shallowest."""
    recorded = getattr(model, "_can_record_outputs", None) or {}
    target = recorded.get("hidden_states")
    target = getattr(target, "target_class", target)
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]

    def rank(item: tuple[str, nn.ModuleList]) -> tuple[int, int]:
        name, lst = item
        matches = isinstance(target, type) and all(isinstance(x, target) for x in lst)
        return (0 if matches else 1, name.count("."))

    return sorted(found, key=rank)


class _Watch:
    """Hooks of one verifying forward pass over a candidate layer list (and its would-be sites)."""

    def __init__(self, layers: Sequence[nn.Module]):
        self.layers = list(layers)
        self.index = {id(m): i for i, m in enumerate(self.layers)}
        self.calls: list[int] = []  # layer positions in call order
        self.first_input: Any = None
        self.outputs: dict[int, Any] = {}
        self.inputs: dict[int, Any] = {}
        self.after_last: list[tuple[str, Any, Any]] = []  # (name, first input, output) of modules run after
        self.site_shapes: dict[str, list[tuple[int, ...] | None]] = {}

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        i = self.index[id(module)]
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("src"))
        self.inputs.setdefault(i, hidden)
        if not self.calls:
            self.first_input = hidden
        self.calls.append(i)

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self.outputs.setdefault(self.index[id(module)], _first(output))

    def other(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            if len(self.calls) == len(self.layers) and len(self.outputs) == len(self.layers) and args:
                self.after_last.append((name, args[0], _first(output)))

        return hook

    def site(self, site: str, where: Where) -> Callable[..., None]:
        shapes = self.site_shapes.setdefault(site, [])

        def note(value: Any) -> None:
            shapes.append(tuple(value.shape) if isinstance(value, torch.Tensor) else None)

        def out_hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
            note(_first(output))

        def in_hook(module: nn.Module, args: tuple[Any, ...]) -> None:
            note(args[0] if args else None)

        return out_hook if where == "out" else in_hook


def _site_candidates(layer: nn.Module) -> dict[str, tuple[str, Where]]:
    out: dict[str, tuple[str, Where]] = {}
    for site, rules in SITE_RULES.items():
        for rel, where in rules:
            try:
                resolve_path(layer, rel)
            except (ValueError, AttributeError, TypeError):
                continue
            out[site] = (rel, where)
            break
    return out


def _watch_forward(
    model: nn.Module, call: ModelCall, ids: torch.Tensor, mask: torch.Tensor, path: str, layers: Sequence[nn.Module],
    sites: dict[str, tuple[str, Where]],
) -> _Watch:
    watch = _Watch(layers)
    inside = {id(m) for layer in layers for m in layer.modules()}
    handles = []
    try:
        for layer in layers:
            handles.append(layer.register_forward_pre_hook(watch.pre, with_kwargs=True))
            handles.append(layer.register_forward_hook(watch.post))
            for site, (rel, where) in sites.items():
                sub = resolve_path(layer, rel)[0]
                hook = watch.site(site, where)
                register = sub.register_forward_hook if where == "out" else sub.register_forward_pre_hook
                handles.append(register(hook))
        for name, module in model.named_modules():
            if id(module) not in inside and module is not model and not name.startswith(f"{path}."):
                handles.append(module.register_forward_hook(watch.other(name)))
        with torch.inference_mode():
            call(model, ids, mask)
    finally:
        for h in handles:
            h.remove()
    return watch


def _measure_sites(watch: _Watch, sites: dict[str, tuple[str, Where]], batch: tuple[int, int]) -> dict[str, int]:
    """Widths of the sites that ran once per layer call and gave ``[batch, tokens, width]``."""
    widths: dict[str, int] = {}
    for site in sites:
        shapes = watch.site_shapes.get(site, [])
        if len(shapes) != len(watch.calls) or not shapes:
            continue
        if all(s is not None and len(s) == 3 and s[:2] == batch and s == shapes[0] for s in shapes):
            widths[site] = int(shapes[0][2])  # type: ignore[index]
    return widths


def _config_key(model: nn.Module, given: str | None) -> tuple[str, str]:
    config: Any = getattr(model, "config", None)
    text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else repr(config)
    cls = f"{type(model).__module__}.{type(model).__qualname__}|{given or ''}"
    return cls, hashlib.sha256(text.encode()).hexdigest()


def transformers_call(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, **extra: Any) -> Any:
    """How layerwise calls a transformers model: ``model(input_ids=..., attention_mask=..., **extra)``."""
    return model(input_ids=ids, attention_mask=mask, **extra)


def discover(
    model: nn.Module, tokenizer: Any, *, name: str, layers: str | None = None, device: torch.device | None = None
) -> tuple[LayerMap, dict[str, int]]:
    """Find and verify the layer list of a transformers model; returns its map and the width of every site.

    Args:
        model: a transformers base model (``AutoModel``, or the encoder of an encoder-decoder) in eval mode.
        tokenizer: its tokenizer (two short texts are encoded for the check).
        name: the architecture (``config.model_type``), used in messages and the map.
        layers: the module path of the layer list, to skip the search (still verified).
        device: where the model lives (default: its first parameter's device).

    Returns:
        ``(LayerMap with source "discovered" or "given", {site: width})``; ``block`` and ``raw`` are always there.

    Raises:
        MappingError: no list (or the given one) reproduces ``hidden_states``; the message names every list tried.
    """
    key = _config_key(model, layers)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        path, final_path, sites, widths = hit
        mods = list(resolve_path(model, path)[0].children())
        final = resolve_path(model, final_path)[0] if final_path else None
        return LayerMap(name, "given" if layers else "discovered", path, mods, dict(sites), final,
                        final_path), dict(widths)
    dev = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    ids, mask = (t.to(dev) for t in probe_batch(tokenizer))
    keep = mask.bool()
    with torch.inference_mode():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    hs = getattr(ref, "hidden_states", None)
    if not hs:
        raise MappingError(
            f"{name}: the model returns no hidden_states with output_hidden_states=True, so its layers cannot be "
            f"checked; use Extractor.from_module(model, tokenizer, layer_modules='path.to.layer_list')"
        )
    n_layers = len(hs) - 1
    if layers is not None:
        try:
            given = resolve_path(model, layers)[0]
        except ValueError as exc:
            raise MappingError(f"{name}: layer_modules={layers!r}: {exc}") from exc
        if not isinstance(given, nn.ModuleList):
            raise MappingError(f"{name}: layer_modules={layers!r} is a {type(given).__name__}, not a list "
                               f"of layer modules")
        candidates: list[tuple[str, nn.ModuleList]] = [(layers, given)]
    else:
        candidates = candidate_lists(model, n_layers)
    tried: list[str] = []
    for path, lst in candidates:
        sites = _site_candidates(lst[0])
        watch = _watch_forward(model, transformers_call, ids, mask, path, list(lst), sites)
        problem, final_path = _check_against(watch, hs, keep, n_layers)
        if problem:
            tried.append(f"{path or '(root)'} ({len(lst)} x {type(lst[0]).__name__}): {problem}")
            continue
        widths = {"block": int(hs[0].shape[-1]), "raw": int(hs[0].shape[-1])}
        widths.update(_measure_sites(watch, sites, (int(ids.shape[0]), int(ids.shape[1]))))
        kept = {s: sites[s] for s in widths if s in sites}
        final = resolve_path(model, final_path)[0] if final_path else None
        with _cache_lock:
            _cache[key] = (path, final_path, kept, widths)
        return LayerMap(name, "given" if layers else "discovered", path, list(lst), kept, final, final_path), widths
    what = "; ".join(tried) if tried else f"no nn.ModuleList of length {n_layers} in {type(model).__name__}"
    raise MappingError(
        f"{name}: could not map the layers of {type(model).__name__} to its {n_layers + 1} hidden_states. Tried: "
        f"{what}. If you know the list of layer modules, pass its path by hand: Extractor(model, "
        f"layer_modules='path.to.layers'), or wrap any module with Extractor.from_module(model, tokenizer, "
        f"layer_modules=...)"
    )


def _check_against(watch: _Watch, hs: Sequence[torch.Tensor], keep: torch.Tensor, n: int) -> tuple[str, str | None]:
    """``("", final_path)`` when the watched list reproduces ``hs``; else a one-line reason."""
    if watch.calls != list(range(n)):
        return f"its items ran in the order {watch.calls[:8]}, not once each in order", None
    if not _same(watch.first_input, hs[0], keep):
        return "the first item's input is not hidden_states[0]", None
    for i in range(1, n):
        if not _same(watch.outputs.get(i - 1), hs[i], keep):
            return f"item {i - 1}'s output is not hidden_states[{i}]", None
    last = watch.outputs.get(n - 1)
    if _same(last, hs[n], keep):
        return "", None
    for name, arg, out in watch.after_last:
        if isinstance(last, torch.Tensor) and _same(arg, last, keep) and _same(out, hs[n], keep):
            return "", name
    return f"the last item's output is not hidden_states[{n}], and no module run after it turns it into that", None


def verify_chain(
    model: nn.Module, call: ModelCall, layers: Sequence[nn.Module], ids: torch.Tensor, mask: torch.Tensor,
    path: str,
) -> int:
    """Check that ``layers`` form the model's chain of layers; returns the hidden width.

    Each item must run exactly once, in order, give ``[batch, tokens, width]``, and read what the previous one wrote.

    Raises:
        MappingError: naming the first item that breaks the chain.
    """
    watch = _watch_forward(model, call, ids, mask, path, layers, {})
    keep = mask.bool().to(ids.device)
    n = len(layers)
    if watch.calls != list(range(n)):
        raise MappingError(
            f"layer_modules={path!r}: in one forward pass the {n} modules ran in the order "
            f"{watch.calls[:12]}, not once each "
            f"in order; pass the list of the model's layer modules in the order they run"
        )
    for i in range(n):
        out = watch.outputs.get(i)
        if not isinstance(out, torch.Tensor) or out.dim() != 3 or tuple(out.shape[:2]) != tuple(ids.shape):
            shape = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
            raise MappingError(
                f"layer_modules={path!r}: item {i} returns {shape}, not [batch, tokens, width] = [{ids.shape[0]}, "
                f"{ids.shape[1]}, ...]; layerwise reads batch-first token states (nn.TransformerEncoderLayer: "
                f"batch_first=True)"
            )
        if i + 1 < n and not _same(watch.inputs.get(i + 1), out, keep):
            raise MappingError(
                f"layer_modules={path!r}: item {i + 1} does not read what item {i} wrote, so these modules "
                f"are not one chain "
                f"of layers; name the list whose items pass the hidden states on"
            )
    return int(watch.outputs[0].shape[-1])


__all__ = ["MappingError", "ModelCall", "candidate_lists",
           "PROBE_TEXTS", "SITE_RULES", "discover", "probe_batch", "transformers_call",
           "verify_chain"]
