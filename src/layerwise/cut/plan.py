"""What an export writes, decided before anything is written: :class:`ExportPlan` and the refusals.

:func:`plan_export` turns an :class:`~layerwise.EncodeSpec` (sentence level) and the facts of a loaded model into an
:class:`ExportPlan`, or refuses with a :class:`~layerwise.SpecError` that names what can be exported instead. It
imports no torch.

What a plain Hugging Face directory and sentence-transformers' own modules (no remote code) can express:

======================  ======================================================================================
spec field              exportable values
======================  ======================================================================================
``layers``              one layer ``K``, or several mixed by ``combine``; the directory holds layers ``1..K``
                        (``K`` is the deepest one; ``1..K+1`` for ``raw`` before a final norm, see ``site``) and
                        layer 0 (the embeddings)
``site``                ``block``: the cut model's own layer ``K``. An architecture with a final norm (GPT-2's
                        ``ln_f``, Llama's ``norm``, T5's ``final_layer_norm``, ModernBERT's ``final_norm``) runs
                        it after its last layer, so the cut keeps it after layer ``K`` (what any ``K``-layer model
                        of the architecture computes, and what a serving engine gives when its layer count is
                        lowered); ``raw`` (layerwise's layer ``K``: without that norm). Without a final norm the cut
                        computes it as it is (not DeBERTa-v2's layer 1: its convolution runs after it). With one,
                        ``K < L``: the directory keeps layer ``K + 1`` too and sentence-transformers reads
                        ``hidden_states[K]``, which transformers gives before any norm, through
                        ``WeightedLayerPooling`` (weight 0 on layer ``K + 1``; ``config.json`` says which state to
                        read); the last layer raw is refused (a directory runs the norm after its last layer)
``combine``             one layer: any fixed mode; several: ``mean``, ``sum`` or ``weighted`` (a positive weight
                        sum): sentence-transformers' ``WeightedLayerPooling``, which divides by the weights' sum, so
                        a ``sum`` or ``weighted`` mix gives ``scale = 1 / sum(weights)`` times layerwise's vectors
                        (``sum``: one over the number of layers; equal with ``normalize``, and with ``pooler``,
                        whose dense weights make up for it); ``concat``, ``stack`` and the learned modes are
                        refused
``pool``                ``mean | cls | max | last`` (sentence-transformers' ``Pooling`` modes ``mean``, ``cls``,
                        ``max``, ``lasttoken``), and ``pooler`` where the model has a BERT-style pooler
                        (``tanh(dense(cls))``: ``Pooling`` ``cls`` then a ``Dense`` module with its weights)
``normalize``           sentence-transformers' ``Normalize`` module
``prompt``              the directory's default prompt (``config_sentence_transformers.json``)
``truncate``            always: sentence-transformers cuts a text at ``max_seq_length`` (the model's window)
                        where layerwise windows it
others                  their defaults (``skip_special_tokens``, ``add_eos``, ``dimensions``, ``output_dtype``
                        other than ``float32``: refused, each naming why)
======================  ======================================================================================
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from ..encoding.spec import EncodeSpec
from ..errors import SpecError

EXPORT_POOLS: tuple[str, ...] = ("mean", "cls", "max", "last", "pooler")
EXPORT_MIXES: tuple[str, ...] = ("mean", "sum", "weighted")
EXPORT_SITES: tuple[str, ...] = ("block", "raw")
# layerwise pool -> sentence-transformers' Pooling flag (the keys every sentence-transformers version reads)
ST_POOLING_FLAGS: dict[str, str] = {
    "cls": "pooling_mode_cls_token",
    "mean": "pooling_mode_mean_tokens",
    "max": "pooling_mode_max_tokens",
    "last": "pooling_mode_lasttoken",
}


@dataclass(frozen=True)
class ModelFacts:
    """What the plan needs to know about the source model (read from a :class:`~layerwise.LoadedModel`).

    Attributes:
        architecture: the layer map's name (``"bert"``, ``"gpt2"``...).
        model_type: the config's ``model_type``.
        num_layers: ``L``.
        final_norm: the module path of the norm run after the last layer (``"ln_f"``), or ``None``.
        conv_after_first: DeBERTa-v2's convolution runs after layer 1.
        layer_path: the module path of the layer list (``"encoder.layer"``; ALBERT's has a ``*``).
        encoder_decoder: the checkpoint is an encoder-decoder (its encoder is what layerwise loaded).
        encoder_class: transformers' encoder-only class for it (``"T5EncoderModel"``), or ``None``.
        albert_groups: ALBERT's ``(num_hidden_groups, inner_group_num)``; ``(1, 1)`` elsewhere.
        window: the longest input in tokens, special tokens included (sentence-transformers' ``max_seq_length``).
        pooler: the module path of a BERT-style pooler's linear layer followed by tanh (``"pooler.dense"``), or
            ``None``.
    """

    architecture: str
    model_type: str
    num_layers: int
    final_norm: str | None
    conv_after_first: bool
    layer_path: str
    encoder_decoder: bool
    encoder_class: str | None
    albert_groups: tuple[int, int]
    window: int
    pooler: str | None = None


@dataclass(frozen=True)
class ExportPlan:
    """What one export writes (every field is also in ``layerwise-export.json``).

    Attributes:
        spec: the resolved spec whose vectors the directory gives (``truncate=True``, sentence level).
        depth: ``K``, the deepest layer of the vectors.
        kept: the layers the directory holds (``1..kept``): ``K``, or ``K + 1`` for site ``raw`` before a final
            norm (the directory's ``hidden_states[K]`` is then layer ``K`` without it).
        final_norm: the module path of the norm the cut runs after layer ``kept`` (``None``: none).
        norm_added: the final norm runs after layer ``kept`` where the source's ``hidden_states[kept]`` has none
            (``kept < L`` on an architecture with a final norm).
        mix_start: the first layer of sentence-transformers' ``WeightedLayerPooling`` (``None``: one layer read
            as the directory's last state, no mix).
        mix_weights: its weights over layers ``mix_start..kept`` (zero for a layer not in the spec).
        mix_scale: the mix sentence-transformers computes is ``mix_scale`` times layerwise's combination (1 for one
            layer or ``mean``; ``1 / sum(weights)`` for ``sum`` and ``weighted``).
        scale: the directory's vectors are ``scale`` times layerwise's (1 with ``normalize`` or ``pool="pooler"``,
            else ``mix_scale``).
        window: ``max_seq_length``: longer texts are cut there.
    """

    spec: EncodeSpec
    depth: int
    kept: int
    final_norm: str | None
    norm_added: bool
    mix_start: int | None
    mix_weights: tuple[float, ...] | None
    mix_scale: float
    scale: float
    window: int

    @property
    def vectors_normed(self) -> bool:
        """The vectors read layer ``K`` after the final norm the cut added (site ``block``, ``K < L``)."""
        return self.norm_added and self.kept == self.depth

    @property
    def read(self) -> str:
        """Which states of the directory the vectors read: its last state, one earlier state, or a mix of states."""
        if self.mix_start is None:
            return "last_hidden_state"
        if len(self.spec.layer_indices) == 1:
            return f"hidden_states[{self.depth}]"
        return f"hidden_states[{self.mix_start}..{self.kept}] mixed by WeightedLayerPooling"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready description (the spec as its JSON dict)."""
        return {
            "spec": json.loads(self.spec.to_json()),
            "layers": self.depth,
            "layers_kept": self.kept,
            "read": self.read,
            "final_norm": self.final_norm,
            "final_norm_after_layer": self.final_norm is not None,
            "final_norm_added": self.norm_added,
            "vectors_see_final_norm": self.vectors_normed,
            "mix": (None if self.mix_start is None
                    else {"start": self.mix_start, "weights": list(self.mix_weights or ())}),
            "mix_scale": self.mix_scale,
            "scale": self.scale,
            "max_seq_length": self.window,
        }


def serve_hint(fields: str) -> str:
    """How to get what cannot be exported from layerwise's own service instead (``fields``: ``"layers=3;site=raw"``)."""
    return (f"serve it with layerwise instead: layerwise serve --model MODEL --alias layer='{fields}' (or those "
            f"fields in each request)")


def serve_alias(plan: ExportPlan) -> str:
    """The ``layerwise serve --alias`` fields of the exported spec, for serving the exported directory with layerwise
    (its layers keep their numbers): layerwise's vectors, which the directory gives times ``plan.scale``."""
    spec = plan.spec
    layers = spec.layer_indices
    fields = [f"layers={','.join(map(str, layers))}" if len(layers) > 1 else f"layers={layers[0]}"]
    if len(layers) > 1:
        fields.append(f"combine={spec.combine}")
        if spec.combine == "weighted" and spec.weights:
            fields.append(f"weights={json.dumps([float(w) for w in spec.weights])}")
    fields += [f"pool={spec.pool}", f"normalize={'true' if spec.normalize else 'false'}"]
    if spec.prompt:
        fields.append(f"prompt={json.dumps(spec.prompt)}")
    return ";".join(fields)


def _alternatives(spec: EncodeSpec, layers: tuple[int, ...]) -> str:
    joined = ",".join(str(i) for i in layers)
    mode = spec.combine if isinstance(spec.combine, str) else "concat"
    return (f"export one layer (--layers {max(layers)}), or a mean or weighted mix of these layers (--layers {joined} "
            f"--combine mean, or --combine weighted --weights ...), which sentence-transformers' WeightedLayerPooling "
            f"expresses; for this mix itself, {serve_hint(f'layers={joined};combine={mode}')}, or extract it "
            f"(layerwise extract)")


def _check_mix(spec: EncodeSpec, layers: tuple[int, ...]) -> tuple[float, ...] | None:
    """The mix weights over ``layers`` (``None`` for one layer); a mix sentence-transformers cannot express is
    refused, naming what can be exported instead."""
    if len(layers) == 1:
        return None
    mode = spec.combine
    if not isinstance(mode, str):
        joined = ",".join(str(i) for i in layers)
        raise SpecError(f"a trained combine module ({type(mode).__name__}) cannot be exported: export one layer "
                        f"(--layers {max(layers)}), or a fixed mix (--layers {joined} --combine weighted --weights "
                        f"...): a trained ScalarMix's softmax weights, times its gamma, are such weights")
    if mode not in EXPORT_MIXES:
        why = {"concat": "sentence-transformers has no module that concatenates layers without remote code",
               "stack": "sentence-transformers' vectors have one axis; a stack keeps the layers as a second one",
               "scalar_mix": "a learned mix has no fixed weights until it is trained",
               "attention": "a learned attention over layers has no module in sentence-transformers"}.get(mode, "")
        raise SpecError(f"combine={mode!r} cannot be exported as a sentence-transformers model ({why}). Valid "
                        f"mixes for export are: {', '.join(EXPORT_MIXES)}. Instead: {_alternatives(spec, layers)}")
    weights = tuple(float(w) for w in spec.weights) if mode == "weighted" and spec.weights else (1.0,) * len(layers)
    if not sum(weights) > 0:
        raise SpecError(f"the weights {list(weights)} sum to {sum(weights)!r}; sentence-transformers' "
                        f"WeightedLayerPooling divides the mix by their sum, so it must be positive. Scale the "
                        f"weights to a positive sum (the mix's direction is then kept), or export one layer")
    return weights


def plan_export(spec: EncodeSpec, facts: ModelFacts) -> ExportPlan:
    """The :class:`ExportPlan` of ``spec`` (any layer spec; resolved against ``facts``) for one source model.

    Raises:
        SpecError: a field that a transformers directory with sentence-transformers' modules cannot express
            (the message names the field, the valid values and what to export or run instead).
    """
    if spec.level != "sentence":
        raise SpecError(f"level={spec.level!r} cannot be exported: the directory gives one vector per text "
                        f"(level 'sentence'); its token states are transformers' last_hidden_state of the exported "
                        f"model (AutoModel.from_pretrained(DIR))")
    pool = spec.pool
    if pool == "pooler" and facts.pooler is None:
        raise SpecError(f"pool 'pooler' cannot be exported: this {facts.architecture} has no BERT-style pooler "
                        f"(a linear layer and tanh) that sentence-transformers' Dense module expresses. Valid pools "
                        f"for export are: {', '.join(p for p in EXPORT_POOLS if p != 'pooler')}")
    if not isinstance(pool, str) or pool not in EXPORT_POOLS:
        shown = pool if isinstance(pool, str) else type(pool).__name__
        instead = f"; or {serve_hint(f'pool={shown}')}" if isinstance(pool, str) else ""
        raise SpecError(f"pool {shown!r} cannot be exported: sentence-transformers has no module for it. Valid "
                        f"pools for export are: {', '.join(EXPORT_POOLS)} (sentence-transformers' Pooling modes "
                        f"mean, cls, max, lasttoken; pooler: cls and a Dense module){instead}")
    refused = {
        "skip_special_tokens": (spec.skip_special_tokens, "sentence-transformers pools every token, special ones "
                                "included; export without it"),
        "add_eos": (spec.add_eos, "sentence-transformers adds only what the tokenizer adds; export without it"),
        "dimensions": (spec.dimensions is not None, "export without it and pass truncate_dim when loading: "
                       "SentenceTransformer(DIR, truncate_dim=N) (with encode(..., normalize_embeddings=True) where "
                       "layerwise normalised after cutting)"),
        "output_dtype": (spec.output_dtype != "float32", "sentence-transformers quantizes at encode time: "
                         "model.encode(texts, precision='int8' | 'binary' ...)"),
    }
    for name, (bad, fix) in refused.items():
        if bad:
            raise SpecError(f"{name}={getattr(spec, name)!r} cannot be exported: {fix}")
    if spec.site not in EXPORT_SITES:
        raise SpecError(f"site {spec.site!r} cannot be exported: a cut model gives its layers' outputs. Valid sites "
                        f"for export are: {', '.join(EXPORT_SITES)}")
    if facts.encoder_decoder and facts.encoder_class is None:
        raise SpecError(f"{facts.model_type!r} is an encoder-decoder and transformers has no encoder-only class "
                        f"for it that AutoModel or sentence-transformers loads, so a cut of its encoder cannot be "
                        f"written as a standard directory (T5, mT5 and UMT5 can: T5EncoderModel); "
                        f"{serve_hint('layers=K')}")
    groups, inner = facts.albert_groups
    layers = _layer_indices(spec, facts)
    depth = max(layers)
    if depth == 0:
        raise SpecError("layer 0 (the embeddings) alone cannot be exported as a model with layers; export layer 1 "
                        "or deeper, or mix layer 0 with a deeper one (--layers 0,1 --combine mean)")
    if facts.architecture == "albert" and (groups != 1 or depth % inner):
        raise SpecError(f"this ALBERT has {groups} layer groups of {inner} layers; a cut after layer {depth} changes "
                        f"which shared layer each call uses. Export a layer that is a multiple of {inner} from a "
                        f"one-group ALBERT (every released ALBERT has one group)")
    kept = _kept_layers(spec, facts, layers)
    mix_start, mix_weights, mix_scale = _mix_layout(spec, layers, kept)
    scale = 1.0 if spec.normalize or pool == "pooler" else mix_scale
    norm_added = facts.final_norm is not None and kept < facts.num_layers
    return ExportPlan(spec=spec, depth=depth, kept=kept, final_norm=facts.final_norm, norm_added=norm_added,
                      mix_start=mix_start, mix_weights=mix_weights, mix_scale=mix_scale, scale=scale,
                      window=facts.window)


def _kept_layers(spec: EncodeSpec, facts: ModelFacts, layers: tuple[int, ...]) -> int:
    """How many layers the directory holds for ``site``: ``K``, or ``K + 1`` for ``raw`` before a final norm (a
    site the directory cannot give is refused, naming what to export or serve instead)."""
    depth = max(layers)
    if spec.site != "raw":
        return depth
    if facts.final_norm is not None and depth == facts.num_layers:
        below = f" (--layers {depth - 1} --site raw)" if len(layers) == 1 and depth > 1 else ""
        raise SpecError(
            f"site 'raw' of the last layer ({depth}, without the final norm {facts.final_norm!r}) cannot be "
            f"written as a {facts.architecture} directory: the architecture always runs {facts.final_norm!r} "
            f"after its last layer. Export --site block (layer {depth} followed by {facts.final_norm!r}, the "
            f"model's own output), or raw of layers below {depth}{below} (the directory keeps one more layer "
            f"and reads the states before it); for the raw last layer, "
            f"{serve_hint(f'layers={depth};site=raw')}")
    if facts.conv_after_first and 1 in layers:
        raise SpecError("site 'raw' of layer 1 cannot be written as a deberta-v2 directory: its convolution runs "
                        "after layer 1 in every cut. Export --site block (hidden_states[1], after the "
                        "convolution); for the raw layer, " + serve_hint("layers=1;site=raw"))
    # hidden_states[K] of a deeper directory has no norm: read it, and drop layer K + 1's
    return depth + 1 if facts.final_norm is not None else depth


def _mix_layout(spec: EncodeSpec, layers: tuple[int, ...], kept: int
                ) -> tuple[int | None, tuple[float, ...] | None, float]:
    """``(mix_start, mix_weights, mix_scale)`` of sentence-transformers' ``WeightedLayerPooling`` over layers
    ``mix_start..kept``, or ``(None, None, 1.0)`` where the vectors read the directory's last state."""
    weights = _check_mix(spec, layers)
    if weights is None and kept > max(layers):
        weights = (1.0,)  # one layer, read below the directory's last state
    if weights is None:
        return None, None, 1.0
    mix_start = min(layers)
    per_layer = [0.0] * (kept - mix_start + 1)
    for layer, weight in zip(layers, weights):
        per_layer[layer - mix_start] += weight
    mix_scale = 1.0 if spec.combine == "mean" or len(layers) == 1 else 1.0 / math.fsum(weights)
    return mix_start, tuple(per_layer), mix_scale


def _layer_indices(spec: EncodeSpec, facts: ModelFacts) -> tuple[int, ...]:
    """The spec's layers resolved against the source model (its layer rule and range checks)."""
    from ..encoding.layers import resolve_layers

    return tuple(resolve_layers(spec.layers, facts.num_layers))


__all__ = ["EXPORT_MIXES", "EXPORT_POOLS", "EXPORT_SITES", "ExportPlan", "ModelFacts", "ST_POOLING_FLAGS",
           "plan_export", "serve_alias", "serve_hint"]
