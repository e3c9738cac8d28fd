"""Combine a stack of layers into one representation per token.

Input everywhere: ``h`` of shape ``[K, batch, tokens, width]`` (``K`` selected layers, in spec order) and an
optional ``mask`` ``[batch, tokens]`` (1 = real token). Output ``[batch, tokens, D]``:

==============  ===============================================  ==================
mode            formula                                          D
==============  ===============================================  ==================
``concat``      ``[h_1; h_2; ...; h_K]`` (spec order)            ``K * width``
``sum``         ``sum_k h_k``                                    ``width``
``mean``        ``(1/K) sum_k h_k``                              ``width``
``weighted``    ``sum_k w_k h_k`` (fixed user weights, as given) ``width``
``stack``       layers kept as an axis: ``[batch, tokens, K, width]``  ``(K, width)``
ScalarMix       ``gamma * sum_k s_k h_k`` (learned, see below)   ``width``
==============  ===============================================  ==================

Combination never writes into its input.

Example::

    >>> import torch
    >>> h = torch.randn(4, 2, 7, 384)
    >>> combine(h, "concat").shape, combine(h, "mean").shape, combine(h, "stack").shape
    (torch.Size([2, 7, 1536]), torch.Size([2, 7, 384]), torch.Size([2, 7, 4, 384]))
"""

from __future__ import annotations

from typing import Literal, Sequence, get_args

import torch
from torch import nn

CombineMode = Literal["concat", "sum", "mean", "weighted", "stack"]
COMBINE_MODES: tuple[str, ...] = get_args(CombineMode)


def validate_combine(mode: object, num_layers: int, weights: Sequence[float] | None = None) -> None:
    """Check a combine mode (string or :class:`ScalarMix`) against the number of selected layers.

    Raises:
        ValueError: unknown mode (the valid ones are listed), weights missing or of the wrong length.
    """
    if isinstance(mode, ScalarMix):
        if mode.mixture_size != num_layers:
            raise ValueError(
                f"ScalarMix was built for {mode.mixture_size} layers but {num_layers} are selected; "
                f"build ScalarMix({num_layers}) or change the layer spec"
            )
        return
    if isinstance(mode, nn.Module):
        return  # any user module taking (h, mask) -> [batch, tokens, D]
    if mode not in COMBINE_MODES:
        raise ValueError(
            f"unknown combine mode {mode!r}. Valid combine modes are: {', '.join(COMBINE_MODES)} "
            f"(or a layerwise.ScalarMix instance)"
        )
    if mode == "weighted":
        if weights is None:
            raise ValueError("combine='weighted' needs weights=[w_1, ..., w_K], one per selected layer")
        if len(weights) != num_layers:
            raise ValueError(
                f"combine='weighted' got {len(weights)} weights for {num_layers} selected layers; give one per layer"
            )
    elif weights is not None:
        raise ValueError(f"weights are only used with combine='weighted', not {mode!r}")


def combine(
    h: torch.Tensor,
    mode: str | nn.Module = "concat",
    *,
    weights: Sequence[float] | torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Combine ``h [K, batch, tokens, width]`` into ``[batch, tokens, D]`` (``stack``: ``[batch, tokens, K, width]``).

    Args:
        h: the selected layers, in spec order.
        mode: one of ``concat | sum | mean | weighted | stack`` or a module such as :class:`ScalarMix`.
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
        return h.permute(1, 2, 0, 3)
    w = torch.as_tensor(weights, dtype=h.dtype, device=h.device)
    return torch.tensordot(w, h, dims=([0], [0]))


def output_width(mode: str | nn.Module, num_layers: int, width: int) -> int | tuple[int, int]:
    """``D`` for a combine mode (``(K, width)`` for ``stack``)."""
    if mode == "concat":
        return num_layers * width
    if mode == "stack":
        return (num_layers, width)
    return width


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

    Shapes: ``forward(h [K, batch, tokens, width], mask [batch, tokens]) -> [batch, tokens, width]``.
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
            raise ValueError(f"ScalarMix mixture_size must be a positive int, got {mixture_size!r}")
        if normalize not in self.NORMALIZE:
            raise ValueError(f"unknown ScalarMix normalize {normalize!r}. Valid values are: softmax, sum")
        if initial_weights is None:
            initial_weights = [0.0 if normalize == "softmax" else 1.0] * mixture_size
        if len(initial_weights) != mixture_size:
            raise ValueError(
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
            raise ValueError(f"ScalarMix expects {self.mixture_size} layers, got a stack of {h.shape[0]}")
        s = self.mixing_weights().to(h.dtype)
        out = None
        for k in range(self.mixture_size):
            layer = _masked_layer_norm(h[k], mask) if self.layer_norm else h[k]
            term = s[k] * layer
            out = term if out is None else out + term
        return self.gamma.to(h.dtype) * out

    def extra_repr(self) -> str:
        return f"mixture_size={self.mixture_size}, layer_norm={self.layer_norm}, normalize={self.normalize!r}"
