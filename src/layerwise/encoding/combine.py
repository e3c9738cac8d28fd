"""Combine a stack of layers into one representation (the modes are named in :mod:`layerwise.encoding.vocab`).

Input everywhere: ``h`` of shape ``[K, *lead, width]`` with the ``K`` selected layers first, in spec order
(``lead`` is ``(batch, tokens)`` for token states, ``(batch,)`` for pooled ones), and an optional ``mask``
``[batch, tokens]`` (1 = real token). Output ``[*lead, D]``:

==============  ===============================================  ==================  =========
mode            formula                                          D                   learned
==============  ===============================================  ==================  =========
``concat``      ``[h_1; h_2; ...; h_K]`` (spec order)            ``K * width``       no
``sum``         ``sum_k h_k``                                    ``width``           no
``mean``        ``(1/K) sum_k h_k``                              ``width``           no
``weighted``    ``sum_k w_k h_k`` (fixed user weights, as given) ``width``           no
``stack``       layers kept as an axis: ``[*lead, K, width]``    ``(K, width)``      no
``scalar_mix``  ``gamma * sum_k softmax(w)_k h_k`` (ScalarMix)   ``width``           yes
``attention``   ``sum_k softmax_k(h_k . q / sqrt(width)) h_k``   ``width``           yes
==============  ===============================================  ==================  =========

The learned modes need trained weights: heads and probes build them with :func:`learned_combiner` and train
them; where nothing is trained (``Extractor.encode``, the store, the service) the name alone is refused and a
trained module (:class:`ScalarMix`, :class:`LayerAttention`) can be passed instead.
:func:`~layerwise.encoding.vocab.combined_shape` is the one place that says ``D``.
Combination never writes into its input.

Example::

    >>> import torch
    >>> h = torch.randn(4, 2, 7, 384)
    >>> combine(h, "concat").shape, combine(h, "mean").shape, combine(h, "stack").shape
    (torch.Size([2, 7, 1536]), torch.Size([2, 7, 384]), torch.Size([2, 7, 4, 384]))
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

from ..errors import SpecError
from .vocab import validate_combine


def combine(
    h: torch.Tensor,
    mode: str | nn.Module = "concat",
    *,
    weights: Sequence[float] | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine ``h [K, *lead, width]`` into ``[*lead, D]`` (``stack``: ``[*lead, K, width]``).

    Args:
        h: the selected layers, in spec order, layer axis first.
        mode: a fixed mode (``concat | sum | mean | weighted | stack``) or a module such as :class:`ScalarMix`
            or :class:`LayerAttention` (the learned modes, built by :func:`learned_combiner`).
        weights: ``K`` fixed weights for ``weighted``.
        mask: ``[batch, tokens]``, used by modules that normalise over tokens (ScalarMix with layer norm).
    """
    validate_combine(mode, h.shape[0], None if weights is None else list(weights))
    if isinstance(mode, nn.Module):
        return mode(h, mask)
    if mode == "concat":
        return torch.cat(list(h.unbind(0)), dim=-1)
    if mode == "sum":
        return h.sum(0)
    if mode == "mean":
        return h.mean(0)
    if mode == "stack":
        return h.movedim(0, -2)
    w = torch.as_tensor(weights, dtype=h.dtype, device=h.device)
    return torch.tensordot(w, h, dims=([0], [0]))


def learned_combiner(mode: str, num_layers: int, width: int) -> nn.Module | None:
    """A fresh trainable module for a learned mode (``scalar_mix``, ``attention``); ``None`` for a fixed one."""
    if mode == "scalar_mix":
        return ScalarMix(num_layers)
    if mode == "attention":
        return LayerAttention(width)
    return None


class LayerAttention(nn.Module):
    """Attention over layers with one learned query: ``a = softmax_k(h_k . q / sqrt(W))``, ``out = sum_k a_k h_k``.

    Shapes: ``forward(h [K, *lead, W], mask=None) -> [*lead, W]``. The query starts at zero (the mean of the layers).
    """

    def __init__(self, width: int):
        super().__init__()
        if isinstance(width, bool) or not isinstance(width, int) or width < 1:
            raise SpecError(f"LayerAttention width must be a positive int, got {width!r}")
        self.query = nn.Parameter(torch.zeros(width))
        self.scale = 1.0 / math.sqrt(width)

    def weights(self, h: torch.Tensor) -> torch.Tensor:
        """``[K, *lead]`` attention weights over the layers."""
        return torch.softmax((h @ self.query.to(h.dtype)) * self.scale, dim=0)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return (self.weights(h).unsqueeze(-1) * h).sum(0)


def _masked_layer_norm(x: torch.Tensor, mask: torch.Tensor | None, eps: float = 1e-12) -> torch.Tensor:
    """Normalise ``x [batch, tokens, width]`` with one mean/std per sequence over its real tokens."""
    if mask is None:
        mask = torch.ones(x.shape[:2], dtype=x.dtype, device=x.device)
    m = mask.to(x.dtype).unsqueeze(-1)  # [batch, tokens, 1]
    n = (m.sum(dim=(1, 2)) * x.shape[-1]).clamp_min(1.0)  # [batch]
    mean = (x * m).sum(dim=(1, 2)) / n
    centred = x - mean[:, None, None]
    var = ((centred * m) ** 2).sum(dim=(1, 2)) / n
    return centred / torch.sqrt(var + eps)[:, None, None]


class ScalarMix(nn.Module):
    """Learned scalar mix of ``K`` layers (Peters et al. 2018; AllenNLP ``scalar_mix.py``).

    ``normalize="softmax"`` (default, AllenNLP): ``out = gamma * sum_k softmax(w)_k * LN(h_k)``.
    ``normalize="sum"`` (sentence-transformers ``WeightedLayerPooling``): ``out = sum_k w_k h_k / sum_k w_k``
    with raw weights initialised to 1 (``gamma`` still applies, initialised to 1).

    ``LN`` is the identity unless ``layer_norm=True``; then each layer is normalised with one mean and
    standard deviation per sequence over its real (mask = 1) tokens. AllenNLP pools these statistics over
    the whole batch; layerwise keeps them per sequence so a vector never depends on its batch neighbours.

    Args:
        mixture_size: ``K``, the number of layers mixed.
        layer_norm: normalise each layer before mixing.
        normalize: ``"softmax"`` or ``"sum"``.
        initial_weights: starting ``w`` (default zeros for softmax, ones for sum).
        trainable: whether ``w`` and ``gamma`` get gradients.
        layers: optional layer spec this mix is meant for (see :meth:`over`).

    Shapes: ``forward(h [K, *lead, width], mask [batch, tokens]) -> [*lead, width]`` (``layer_norm`` needs token
    states ``[K, batch, tokens, width]``).
    """

    NORMALIZE = ("softmax", "sum")

    def __init__(
        self,
        mixture_size: int,
        *,
        layer_norm: bool = False,
        normalize: str = "softmax",
        initial_weights: Sequence[float] | None = None,
        trainable: bool = True,
        layers: object = None,
    ):
        super().__init__()
        if not isinstance(mixture_size, int) or mixture_size < 1:
            raise SpecError(f"ScalarMix mixture_size must be a positive int, got {mixture_size!r}")
        if normalize not in self.NORMALIZE:
            raise SpecError(f"unknown ScalarMix normalize {normalize!r}. Valid values are: softmax, sum")
        if initial_weights is None:
            initial_weights = [0.0 if normalize == "softmax" else 1.0] * mixture_size
        if len(initial_weights) != mixture_size:
            raise SpecError(
                f"ScalarMix got {len(initial_weights)} initial weights for mixture_size={mixture_size}"
            )
        self.mixture_size = mixture_size
        self.layer_norm = layer_norm
        self.normalize = normalize
        self.layers = layers
        self.weights = nn.Parameter(torch.tensor(list(initial_weights), dtype=torch.float32), requires_grad=trainable)
        self.gamma = nn.Parameter(torch.tensor([1.0]), requires_grad=trainable)

    @classmethod
    def over(cls, num_layers: int, *, include_embeddings: bool = True, **kwargs) -> "ScalarMix":
        """A mix over all layers of a model with ``num_layers`` layers; ``layers`` is set to ``"all"`` or ``"1:"``."""
        size = num_layers + 1 if include_embeddings else num_layers
        return cls(size, layers="all" if include_embeddings else "1:", **kwargs)

    def mixing_weights(self) -> torch.Tensor:
        """The effective ``s_k`` (softmax of ``w``, or ``w / sum(w)``), shape ``[K]``."""
        if self.normalize == "softmax":
            return torch.softmax(self.weights, dim=0)
        return self.weights / self.weights.sum()

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if h.shape[0] != self.mixture_size:
            raise SpecError(f"ScalarMix expects {self.mixture_size} layers, got a stack of {h.shape[0]}")
        s = self.mixing_weights().to(h.dtype)
        def term(k: int) -> torch.Tensor:
            return s[k] * (_masked_layer_norm(h[k], mask) if self.layer_norm else h[k])

        out = term(0)  # mixture_size >= 1 (checked in __init__)
        for k in range(1, self.mixture_size):
            out = out + term(k)
        return self.gamma.to(h.dtype) * out

    def extra_repr(self) -> str:
        return f"mixture_size={self.mixture_size}, layer_norm={self.layer_norm}, normalize={self.normalize!r}"
