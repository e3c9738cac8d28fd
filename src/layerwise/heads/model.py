"""The trainable part of a head: combine pooled layers, (attention-)pool tokens, classify.

``LayerHead(config, num_layers=K, width=W)`` takes per-layer features and returns logits ``[batch, C]``:

* sentence pools: ``x [batch, K, W]`` (each layer already pooled over its real tokens);
* ``pool="attention"``: ``x [batch, tokens, K, W]`` and ``mask [batch, tokens]``; the layers are combined per token,
  then a learned query pools the tokens (padding gets zero weight).

Combine (over the ``K`` layers, see :mod:`layerwise.encoding.combine`): ``concat`` (``D = K W``), ``sum``, ``mean``,
``weighted`` (fixed), ``scalar_mix`` (``gamma * sum_k softmax(w)_k x_k``), ``attention`` (``a = softmax_k(x_k . q /
sqrt(W))``, ``sum_k a_k x_k``).
Classifier: ``linear`` (dropout -> Linear), ``mlp`` (``[dropout -> Linear -> act] * len(hidden)`` -> dropout -> Linear),
``per_layer`` (one dropout -> Linear per layer; logits ``sum_k softmax(v)_k logits_k``; training adds each layer's
own loss so every layer's classifier is usable alone, see :meth:`LayerHead.loss`).

Example::

    >>> import torch
    >>> from layerwise.heads import HeadConfig, LayerHead
    >>> head = LayerHead(HeadConfig(labels=["neg", "pos"], combine="concat", classifier="mlp"), num_layers=4, width=384)
    >>> head(torch.randn(8, 4, 384)).shape
    torch.Size([8, 2])
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..encoding.combine import LayerAttention, ScalarMix, combine, learned_combiner
from ..encoding.pooling import AttentionPool
from ..encoding.vocab import combined_shape
from ..errors import SpecError
from .config import HeadConfig

_ACTS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh}
__all__ = ["LayerAttention", "LayerHead"]


def _classifier(config: HeadConfig, width: int) -> nn.Sequential:
    parts: list[nn.Module] = []
    size = width
    if config.classifier == "mlp":
        for h in config.hidden:
            parts += [nn.Dropout(config.dropout), nn.Linear(size, h), _ACTS[config.activation]()]
            size = h
    parts += [nn.Dropout(config.dropout), nn.Linear(size, config.num_labels)]
    return nn.Sequential(*parts)


class LayerHead(nn.Module):
    """Combine + pool + classify on top of ``K`` captured layers of width ``W`` (see the module docstring)."""

    def __init__(self, config: HeadConfig, num_layers: int, width: int):
        super().__init__()
        if config.num_labels < 2:
            raise SpecError("the head needs config.labels (at least 2 classes); train() fills them from the data")
        self.config = config
        self.num_layers, self.width = int(num_layers), int(width)
        K, W = self.num_layers, self.width
        self.mix: nn.Module | None = None
        if config.classifier == "per_layer":
            self.layer_classifiers = nn.ModuleList(_classifier(config, W) for _ in range(K))
            self.layer_logit_weights = nn.Parameter(torch.zeros(K))
            return
        self.mix = learned_combiner(config.combine, K, W)
        (dim,) = combined_shape(config.combine, K, W)
        self.token_pool = AttentionPool(dim) if config.pool == "attention" else None
        self.classifier = _classifier(config, dim)

    @property
    def expects_tokens(self) -> bool:
        """Whether ``forward`` takes token-level ``[batch, tokens, K, W]`` input (``pool="attention"``)."""
        return self.config.pool == "attention"

    def combine(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., K, W] -> [..., D]`` with the config's combine mode (see
        :func:`layerwise.encoding.combine.combine`)."""
        mode = self.mix if self.mix is not None else self.config.combine
        return combine(x.movedim(-2, 0), mode, weights=self.config.weights)

    def per_layer_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``per_layer`` only: ``x [batch, K, W] -> [batch, K, C]``, each layer's own classifier."""
        return torch.stack([clf(x[:, k]) for k, clf in enumerate(self.layer_classifiers)], dim=1)

    def layer_weights(self) -> torch.Tensor | None:
        """The learned weights over layers (``per_layer``: logit weights; ``scalar_mix``), else ``None``."""
        if self.config.classifier == "per_layer":
            return torch.softmax(self.layer_logit_weights, 0).detach()
        if isinstance(self.mix, ScalarMix):
            return self.mix.mixing_weights().detach()
        return None

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[batch, C]`` from ``x [batch, K, W]``; for ``pool="attention"``, ``x [batch, T, K, W]`` + mask."""
        if x.shape[-2:] != (self.num_layers, self.width):
            raise SpecError(
                f"head expects features [..., {self.num_layers}, {self.width}] (layers, width), got {tuple(x.shape)}"
            )
        if self.config.classifier == "per_layer":
            weights = torch.softmax(self.layer_logit_weights, 0)
            return torch.einsum("k,bkc->bc", weights, self.per_layer_logits(x))
        h = self.combine(x)
        if self.token_pool is not None:
            if mask is None or x.dim() != 4:
                raise SpecError(
                    "pool='attention' needs token features [batch, tokens, K, W] and a mask [batch, tokens]"
                )
            h = self.token_pool(h, mask)
        return self.classifier(h)

    def loss(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Cross-entropy of the logits; ``per_layer`` adds the mean of every layer's own cross-entropy."""
        if self.config.classifier != "per_layer":
            return F.cross_entropy(self(x, mask), y)
        own = self.per_layer_logits(x)  # [batch, K, C]
        weights = torch.softmax(self.layer_logit_weights, 0)
        mixed = torch.einsum("k,bkc->bc", weights, own)
        aux = F.cross_entropy(own.reshape(-1, own.shape[-1]), y.repeat_interleave(own.shape[1]))
        return F.cross_entropy(mixed, y) + aux
