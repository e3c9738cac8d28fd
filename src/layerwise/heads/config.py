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
                  ``| attention`` (a learned query over the layers): the one vocabulary of :mod:`layerwise.combine`
                  (``stack`` keeps the layer axis, which a classifier cannot read: use ``classifier="per_layer"``)
``classifier``    ``linear | mlp`` (``hidden`` sizes, ``activation``, ``dropout``) ``| per_layer`` (one classifier per
                  layer, logits mixed by learned softmax weights; ``combine`` is not used)
``mode``          ``frozen`` (encoder fixed; trains on cached features) ``| finetune`` (encoder updated too)
================  ===========================================================================================

Because mean, cls and last are linear in the token states, pooling each layer first gives the same vector as
combining first; for ``max`` with a summing combine the order matters, and layerwise pools first (per layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..layers import LayerSpec
from ..spec import EncodeSpec, dump_json, read_json_arg

POOLS = ("cls", "mean", "max", "mean_max", "last", "attention")
COMBINES = ("concat", "sum", "mean", "weighted", "scalar_mix", "attention")
CLASSIFIERS = ("linear", "mlp", "per_layer")
ACTIVATIONS = ("relu", "gelu", "tanh")
MODES = ("frozen", "finetune")
_SHORTCUTS = ("layers", "site", "pool", "combine", "weights")


def _check(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}. Valid {name} values are: {', '.join(valid)}")


def _check_combine(combine: object) -> None:
    if combine == "stack":
        raise ValueError("combine='stack' keeps the layer axis, which a classifier cannot read; use concat, sum, "
                         "mean, weighted, scalar_mix or attention, or classifier='per_layer' for one per layer")
    _check("combine", combine, COMBINES)


@dataclass(init=False)
class HeadConfig:
    """A sequence classifier on hidden layers (see the module docstring for the valid values).

    Attributes:
        labels: the class names, in the order of the logits.
        model: the encoder (directory or hub id; ``None`` = embedded all-MiniLM-L6-v2).
        encode: what the head reads: an :class:`~layerwise.EncodeSpec` (layers resolved against the encoder when the
            head is built). ``layers``, ``site``, ``pool``, ``combine`` and ``weights`` are read-only views of it.
        classifier, mode: see the module docstring.
        hidden: hidden layer sizes of the ``mlp`` classifier (e.g. ``[256]``).
        activation: ``relu | gelu | tanh``.
        dropout: dropout before every linear layer of the classifier (0.1-0.3 is usual).
        max_length: encoder window (``None`` = the model's maximum); long texts are windowed.

    Build it with an ``encode=EncodeSpec(...)`` or with the shortcuts ``layers=``, ``site=``, ``pool=``,
    ``combine=``, ``weights=`` (not both).
    """

    labels: list[str]
    model: str | None
    encode: EncodeSpec
    classifier: str
    hidden: list[int]
    activation: str
    dropout: float
    mode: str
    max_length: int | None

    def __init__(
        self,
        labels: Sequence[str] = (),
        model: str | None = None,
        encode: EncodeSpec | None = None,
        *,
        layers: LayerSpec | None = None,
        site: str | None = None,
        pool: str | None = None,
        combine: str | None = None,
        weights: Sequence[float] | None = None,
        classifier: str = "linear",
        hidden: Sequence[int] = (256,),
        activation: str = "relu",
        dropout: float = 0.1,
        mode: str = "frozen",
        max_length: int | None = None,
    ):
        # keyword arguments of EncodeSpec, each from the same-named parameter above (their types differ)
        given: dict[str, Any] = {
            k: v for k, v in zip(_SHORTCUTS, (layers, site, pool, combine, weights)) if v is not None
        }
        if encode is not None and given:
            raise ValueError(f"give encode=EncodeSpec(...) or the shortcuts {sorted(given)}, not both")
        if encode is not None and not isinstance(encode, EncodeSpec):
            raise ValueError(f"encode must be a layerwise.EncodeSpec, got {type(encode).__name__}")
        if pool is not None:
            _check("pool", pool, POOLS)  # the head's own vocabulary first: its message lists what heads accept
        if combine is not None:
            _check_combine(combine)
        self.labels = list(labels) if isinstance(labels, (list, tuple)) else labels  # type: ignore[assignment]
        self.model = model
        self.encode = encode if encode is not None else EncodeSpec(**given)
        self.classifier, self.hidden, self.activation = classifier, hidden, activation  # type: ignore[assignment]
        self.dropout, self.mode, self.max_length = dropout, mode, max_length
        self.validate()

    # ---- views of the spec -----------------------------------------------------------------------------------
    @property
    def layers(self) -> LayerSpec:
        """The layer spec the head reads."""
        return self.encode.layers

    @property
    def site(self) -> str:
        """The site inside each layer."""
        return self.encode.site

    @property
    def pool(self) -> str:
        """How each layer is pooled over tokens."""
        return str(self.encode.pool)

    @property
    def combine(self) -> str:
        """How the pooled layers are combined."""
        return str(self.encode.combine)

    @property
    def weights(self) -> Sequence[float] | None:
        """Fixed layer weights (``combine="weighted"``; a tuple of floats)."""
        return self.encode.weights

    def validate(self) -> None:
        """``ValueError`` naming the bad field, its value and the valid ones."""
        if not isinstance(self.labels, (list, tuple)) or len(self.labels) == 1:
            raise ValueError(
                f"a classifier needs at least 2 labels (or none yet, to be read from data), got {self.labels!r}"
            )
        if len(set(map(str, self.labels))) != len(self.labels):
            raise ValueError(f"labels must be distinct, got {self.labels!r}")
        self.labels = [str(label) for label in self.labels]
        if self.encode.level != "sentence":
            raise ValueError(f"a sequence classifier reads one vector per text: encode.level must be 'sentence', "
                             f"got {self.encode.level!r}")
        _check("pool", self.pool, POOLS)
        _check_combine(self.combine)
        _check("classifier", self.classifier, CLASSIFIERS)
        _check("activation", self.activation, ACTIVATIONS)
        _check("mode", self.mode, MODES)
        if self.classifier == "per_layer" and self.pool == "attention":
            raise ValueError(
                "classifier='per_layer' needs a per-layer pool (cls, mean, max, mean_max, last), not 'attention'"
            )
        dropout = self.dropout
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.hidden, (list, tuple)) or any(
            isinstance(h, bool) or not isinstance(h, int) or h < 1 for h in self.hidden
        ):
            raise ValueError(f"hidden must be a list of positive ints (MLP layer sizes), got {self.hidden!r}")
        self.hidden = list(self.hidden)
        if self.classifier == "mlp" and not self.hidden:
            raise ValueError("classifier='mlp' needs at least one hidden size, e.g. hidden=[256]; or use 'linear'")

    @property
    def num_labels(self) -> int:
        """How many classes."""
        return len(self.labels)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready; the spec is nested under ``encode``."""
        return {"labels": list(self.labels), "model": self.model, "encode": self.encode.to_dict(),
                "classifier": self.classifier, "hidden": list(self.hidden), "activation": self.activation,
                "dropout": self.dropout, "mode": self.mode, "max_length": self.max_length}

    def to_json(self, path: str | Path | None = None) -> str:
        """The config as JSON text; also written to ``path`` when given."""
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HeadConfig":
        """Build from :meth:`to_dict` output (or the flat fields ``layers``/``pool``/... of layerwise 0.1 configs)."""
        if not isinstance(data, dict):
            raise ValueError(f"a HeadConfig is a JSON object, got {type(data).__name__}")
        known = {"labels", "model", "encode", "classifier", "hidden", "activation", "dropout", "mode", "max_length",
                 *_SHORTCUTS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown HeadConfig field(s) {unknown}; valid fields are: {', '.join(sorted(known))}")
        data = dict(data)
        if isinstance(data.get("encode"), dict):
            data["encode"] = EncodeSpec.from_dict(data["encode"])
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "HeadConfig":
        """Read a config from JSON text or a ``config.json`` file (``ValueError`` for a missing file or bad JSON)."""
        return cls.from_dict(read_json_arg(text_or_path, "HeadConfig"))
