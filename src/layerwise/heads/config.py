"""``HeadConfig``: everything that defines a classifier on hidden layers, as a dataclass that round-trips JSON.

Data flow of a head (pool each layer, then combine the layers, then classify)::

    encoder layers [K, batch, tokens, W] --pool per layer--> [batch, K, W] --combine--> [batch, D] --classifier-> logits
                                     \\--(pool="attention")--combine per token--> [batch, tokens, D] --AttentionPool-/

================  ===========================================================================================
field             valid values
================  ===========================================================================================
``encode``        an :class:`~layerwise.EncodeSpec` (level ``sentence``) naming ``layers``, ``site``, ``pool``,
                  ``combine`` and ``weights``; ``HeadConfig(layers=..., pool=..., combine=...)`` builds it for you
``pool``          ``cls | mean | max | mean_max | last`` (per layer, padding excluded) or ``attention`` (a learned
                  query over the tokens of the combined layers)
``combine``       ``concat | sum | mean | weighted`` (fixed ``weights``) ``| scalar_mix`` (learned softmax weights)
                  ``| attention`` (a learned query over the layers): the one vocabulary of
                  :data:`layerwise.encoding.vocab.COMBINE_MODES`
                  (``stack`` keeps the layer axis, which a classifier cannot read: use ``classifier="per_layer"``)
``classifier``    ``linear | mlp`` (``hidden`` sizes, ``activation``, ``dropout``) ``| per_layer`` (one classifier per
                  layer, logits mixed by learned softmax weights; ``combine`` is not used)
``mode``          ``frozen`` (encoder fixed; trains on cached features) ``| finetune`` (encoder updated too)
``model``         the encoder: a :class:`~layerwise.ModelOptions` (a path or hub id is read as its ``model``)
================  ===========================================================================================

Because mean, cls and last are linear in the token states, pooling each layer first gives the same vector as
combining first; for ``max`` with a summing combine the order matters, and layerwise pools first (per layer).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..config_json import dump_json, fields_from, read_json_arg
from ..encoding.layers import LayerSpec
from ..encoding.spec import EncodeSpec
from ..encoding.vocab import COMBINE_MODES, POOL_MODES, check_choice
from ..errors import SpecError
from ..model.options import ModelOptions

POOLS = tuple(p for p in POOL_MODES if p != "pooler")  # per layer, then combined: the model's pooler does not apply
COMBINES = tuple(m for m in COMBINE_MODES if m != "stack")  # a classifier reads one vector
CLASSIFIERS = ("linear", "mlp", "per_layer")
ACTIVATIONS = ("relu", "gelu", "tanh")
MODES = ("frozen", "finetune")
_SHORTCUTS = ("layers", "site", "pool", "combine", "weights")
# fields of configs written by layerwise 0.x: the window was a field of its own, the model a path
_LEGACY = ("max_length",)


def _check_combine(combine: object) -> None:
    if combine == "stack":
        raise SpecError("combine='stack' keeps the layer axis, which a classifier cannot read; use concat, sum, "
                        "mean, weighted, scalar_mix or attention, or classifier='per_layer' for one per layer")
    check_choice("combine", combine, COMBINES)


@dataclass(frozen=True)
class HeadConfig:
    """A sequence classifier on hidden layers (see the module docstring for the valid values).

    Attributes:
        labels: the class names, in the order of the logits (a tuple; empty until read from training data).
        model: the encoder's :class:`~layerwise.ModelOptions` (a path, a hub id or ``None`` for the embedded
            all-MiniLM-L6-v2 is read as its ``model``); its ``max_length`` is the encoder window.
        encode: what the head reads: an :class:`~layerwise.EncodeSpec` at level ``sentence`` (layers resolved
            against the encoder when the head is built).
        classifier, mode: see the module docstring.
        hidden: hidden layer sizes of the ``mlp`` classifier (e.g. ``(256,)``).
        activation: ``relu | gelu | tanh``.
        dropout: dropout before every linear layer of the classifier (0.1-0.3 is usual).
        layers, site, pool, combine, weights: shortcuts for ``encode``: give them instead of ``encode=`` (not a
            different value of both); afterwards they hold ``encode``'s values.
    """

    labels: Sequence[str] = ()
    model: ModelOptions | str | None = None
    encode: EncodeSpec = None  # type: ignore[assignment]  # built from the shortcuts when not given
    classifier: str = "linear"
    hidden: Sequence[int] = (256,)
    activation: str = "relu"
    dropout: float = 0.1
    mode: str = "frozen"
    # shortcuts: None = not given; after __post_init__ they hold the spec's values (never None but weights)
    layers: LayerSpec = field(default=None, compare=False)  # type: ignore[assignment]
    site: str = field(default=None, compare=False)  # type: ignore[assignment]
    pool: str = field(default=None, compare=False)  # type: ignore[assignment]
    combine: str = field(default=None, compare=False)  # type: ignore[assignment]
    weights: Sequence[float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        if self.pool is not None:
            check_choice("pool", self.pool, POOLS)  # the head's own vocabulary first: it lists what heads accept
        if self.combine is not None:
            _check_combine(self.combine)
        given = {k: getattr(self, k) for k in _SHORTCUTS if getattr(self, k) is not None}
        if self.encode is None:
            set_("encode", EncodeSpec(**given))
        elif not isinstance(self.encode, EncodeSpec):
            raise SpecError(f"encode must be a layerwise.EncodeSpec, got {type(self.encode).__name__}")
        elif given and EncodeSpec(**{**self.encode.to_dict(), **given}) != self.encode:
            raise SpecError(f"give encode=EncodeSpec(...) or the shortcuts {sorted(given)}, not both")
        spec = self.spec
        for name in _SHORTCUTS:  # the shortcuts are views of the spec from here on
            set_(name, getattr(spec, name))
        set_("model", ModelOptions.of(self.model) if not isinstance(self.model, ModelOptions) else self.model)
        if not isinstance(self.labels, (list, tuple)) or len(self.labels) == 1:
            raise SpecError(
                f"a classifier needs at least 2 labels (or none yet, to be read from data), got {self.labels!r}"
            )
        if len(set(map(str, self.labels))) != len(self.labels):
            raise SpecError(f"labels must be distinct, got {self.labels!r}")
        set_("labels", tuple(str(label) for label in self.labels))
        if spec.level != "sentence":
            raise SpecError(f"a sequence classifier reads one vector per text: encode.level must be 'sentence', "
                            f"got {spec.level!r}")
        check_choice("pool", spec.pool, POOLS)
        _check_combine(spec.combine)
        check_choice("classifier", self.classifier, CLASSIFIERS)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("mode", self.mode, MODES)
        if self.classifier == "per_layer" and spec.pool == "attention":
            raise SpecError(
                "classifier='per_layer' needs a per-layer pool (cls, mean, max, mean_max, last), not 'attention'"
            )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise SpecError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.hidden, (list, tuple)) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden
        ):
            raise SpecError(f"hidden must be a list of positive ints (MLP layer sizes), got {self.hidden!r}")
        set_("hidden", tuple(self.hidden))
        if self.classifier == "mlp" and not self.hidden:
            raise SpecError("classifier='mlp' needs at least one hidden size, e.g. hidden=[256]; or use 'linear'")

    @property
    def spec(self) -> EncodeSpec:
        """``encode`` (``__post_init__`` always sets it)."""
        return self.encode

    @property
    def options(self) -> ModelOptions:
        """``model``, typed (``__post_init__`` always makes it a :class:`~layerwise.ModelOptions`)."""
        if not isinstance(self.model, ModelOptions):  # pragma: no cover - set in __post_init__
            raise SpecError("HeadConfig.model is not ModelOptions")
        return self.model

    @property
    def num_labels(self) -> int:
        """How many classes."""
        return len(self.labels)

    def replace(self, **changes: Any) -> "HeadConfig":
        """A copy with ``changes`` applied (validated again; a shortcut change rebuilds ``encode``)."""
        if any(k in _SHORTCUTS for k in changes) and "encode" not in changes:
            base = {k: getattr(self, k) for k in _SHORTCUTS}
            changes = {**changes, "encode": None, **{k: changes.get(k, base[k]) for k in _SHORTCUTS}}
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the spec is nested under ``encode``, the encoder's options under ``model``."""
        return {"labels": list(self.labels), "model": self.options.to_dict(), "encode": self.spec.to_dict(),
                "classifier": self.classifier, "hidden": list(self.hidden), "activation": self.activation,
                "dropout": self.dropout, "mode": self.mode}

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to ``path`` when given."""
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadConfig":
        """Build from :meth:`to_dict` output, or from a config of an earlier layerwise: the flat fields
        ``layers``/``pool``/... (0.1), ``model`` as a path and ``max_length`` beside it (0.x)."""
        known = sorted({f.name for f in dataclasses.fields(cls)} | set(_LEGACY))
        data = fields_from(data, known, {}, "HeadConfig", SpecError)
        if isinstance(data.get("encode"), dict):
            data["encode"] = EncodeSpec.from_dict(data["encode"])
        model = data.get("model")
        window = data.pop("max_length", None)
        options = ModelOptions.from_dict(model) if isinstance(model, dict) else ModelOptions.of(model)
        data["model"] = options.replace(max_length=window) if window is not None else options
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "HeadConfig":
        """Read a config from JSON text or a ``config.json`` file (``ValueError`` for a missing file or bad JSON)."""
        return cls.from_dict(read_json_arg(text_or_path, "HeadConfig", SpecError))


__all__ = ["ACTIVATIONS", "CLASSIFIERS", "COMBINES", "HeadConfig", "MODES", "POOLS"]
