"""``HeadConfig``: everything that defines a classifier on hidden layers, as a dataclass that round-trips JSON.

Data flow of a head (pool each layer, then combine the layers, then classify)::

    encoder layers [K, batch, tokens, W] --pool per layer--> [batch, K, W] --combine--> [batch, D] --classifier--> logits
                                     \\--(pool="attention")--combine per token--> [batch, tokens, D] --AttentionPool--/

================  ===========================================================================================
field             valid values
================  ===========================================================================================
``layers``        a layer spec (``-1``, ``"-4:"``, ``[0, 2, 4, 6]``, ``"all"``; 0 = embeddings)
``pool``          ``cls | mean | max | mean_max | last`` (per layer, padding excluded) or ``attention`` (a learned
                  query over the tokens of the combined layers)
``combine``       ``concat | sum | mean | scalar_mix`` (learned softmax weights) ``| attention`` (a learned query
                  over the layers)
``classifier``    ``linear | mlp`` (``hidden`` sizes, ``activation``, ``dropout``) ``| per_layer`` (one classifier per
                  layer, logits mixed by learned softmax weights; ``combine`` is not used)
``mode``          ``frozen`` (encoder fixed; trains on cached features) ``| finetune`` (encoder updated too)
================  ===========================================================================================

Because mean, cls and last are linear in the token states, pooling each layer first gives the same vector as
combining first; for ``max`` with a summing combine the order matters, and layerwise pools first (per layer).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

POOLS = ("cls", "mean", "max", "mean_max", "last", "attention")
COMBINES = ("concat", "sum", "mean", "scalar_mix", "attention")
CLASSIFIERS = ("linear", "mlp", "per_layer")
ACTIVATIONS = ("relu", "gelu", "tanh")
MODES = ("frozen", "finetune")


def _check(name: str, value: object, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"unknown {name} {value!r}. Valid {name} values are: {', '.join(valid)}")


@dataclass
class HeadConfig:
    """A sequence classifier on hidden layers (see the module docstring for the valid values).

    Attributes:
        labels: the class names, in the order of the logits.
        model: the encoder (directory or hub id; ``None`` = embedded all-MiniLM-L6-v2).
        layers: layer spec, resolved against the encoder when the head is built.
        site: ``block | attention | intermediate | pre_ln``.
        pool, combine, classifier, mode: see the module docstring.
        hidden: hidden layer sizes of the ``mlp`` classifier (e.g. ``[256]``).
        activation: ``relu | gelu | tanh``.
        dropout: dropout before every linear layer of the classifier (0.1-0.3 is usual).
        max_length: encoder window (``None`` = the model's maximum); long texts are windowed.
    """

    labels: list[str] = field(default_factory=list)  # filled from the training data by train()
    model: str | None = None
    layers: Any = -1
    site: str = "block"
    pool: str = "mean"
    combine: str = "concat"
    classifier: str = "linear"
    hidden: list[int] = field(default_factory=lambda: [256])
    activation: str = "relu"
    dropout: float = 0.1
    mode: str = "frozen"
    max_length: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """``ValueError`` naming the bad field, its value and the valid ones."""
        if not isinstance(self.labels, (list, tuple)) or len(self.labels) == 1:
            raise ValueError(f"a classifier needs at least 2 labels (or none yet, to be read from data), got {self.labels!r}")
        if len(set(map(str, self.labels))) != len(self.labels):
            raise ValueError(f"labels must be distinct, got {self.labels!r}")
        self.labels = [str(label) for label in self.labels]
        _check("pool", self.pool, POOLS)
        _check("combine", self.combine, COMBINES)
        _check("classifier", self.classifier, CLASSIFIERS)
        _check("activation", self.activation, ACTIVATIONS)
        _check("mode", self.mode, MODES)
        if self.classifier == "per_layer" and self.pool == "attention":
            raise ValueError("classifier='per_layer' needs a per-layer pool (cls, mean, max, mean_max, last), not 'attention'")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
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
        return len(self.labels)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2)
        if path is not None:
            Path(path).write_text(text + "\n", encoding="utf-8")
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "HeadConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown HeadConfig field(s) {unknown}; valid fields are: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> "HeadConfig":
        p = Path(text_or_path)
        text = p.read_text(encoding="utf-8") if not str(text_or_path).lstrip().startswith("{") and p.exists() else str(text_or_path)
        return cls.from_dict(json.loads(text))
