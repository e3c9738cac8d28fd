"""The PyTorch backend: scoped forward hooks record the requested sites and stop after the deepest one.

See :mod:`layerwise.capture` for the hooks and :mod:`layerwise.families` for the module each site maps to.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..capture import capture
from ..layers import SITES
from ..loading import LoadedModel
from .base import Backend


class TorchBackend(Backend):
    """PyTorch, every site, early exit after the deepest requested layer, on the model's device and dtype."""

    name = "torch"
    sites = SITES

    def __init__(self, loaded: LoadedModel):
        super().__init__(loaded)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, width]`` (see :meth:`Backend.forward`)."""
        return capture(self.loaded, input_ids, attention_mask, layers, site)
