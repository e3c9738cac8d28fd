"""``backend="auto"`` (the default): the fastest runtime that gives the exact states on this machine.

For the block site of a family-table encoder in float32 on the CPU, ONNX Runtime (:mod:`layerwise.backends.ort`)
is 1.2-1.7x faster than PyTorch on the development CPUs (``benchmarks/README.md``). It is used only where it is
exact: the first time a depth is used in a process, the exported graph and PyTorch run the same probe batch and the
states must agree within 1e-5 (relative to the states' scale, the project's tolerance for "the same states");
otherwise, and for every other site, device, dtype, padding side or architecture, the PyTorch backend runs.
:meth:`AutoBackend.runtime` says which ran.

``quantize="int8"`` makes ONNX Runtime the only runtime (block site only); a model it cannot run is refused with
the reason. Reduced precision is never chosen by this backend: ``dtype="bfloat16"`` is an explicit option that runs
on PyTorch.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch

from ..capture import capture
from ..discovery import probe_batch
from ..loading import LoadedModel
from .ort import OnnxBackend, check_quantize, ort_available
from .pytorch import TorchBackend

EXACT = 1e-5  # max abs difference to PyTorch, relative to max(1, largest state): "the same states"


class AutoBackend(TorchBackend):
    """ONNX Runtime where it is exact and applies, else PyTorch (all sites, early exit).

    Args:
        loaded: the model.
        padding_side: as for :class:`~layerwise.backends.pytorch.TorchBackend` (``"left"`` runs PyTorch).
        cache: directory for exported graphs (see :func:`layerwise.backends.ort.cache_dir`).
        quantize: ``None`` or ``"int8"`` (dynamic int8 through ONNX Runtime; block site only).
    """

    name = "auto"

    def __init__(self, loaded: LoadedModel, padding_side: str = "right", cache: str | os.PathLike | None = None,
                 quantize: str | None = None):
        super().__init__(loaded, padding_side)
        self.quantize = check_quantize(quantize)
        self.why_torch = self.onnx_unsupported(loaded, padding_side)
        self.onnx: OnnxBackend | None = None
        if self.why_torch is None:
            self.onnx = OnnxBackend(loaded, cache=cache, quantize=self.quantize)
        elif self.quantize:
            raise ValueError(f"quantize={self.quantize!r} runs through ONNX Runtime, which {self.why_torch}")
        self._exact: dict[int, bool] = {}  # depth -> ONNX Runtime agreed with PyTorch on the probe batch

    def torch_only(self, reason: str) -> None:
        """Run PyTorch from now on (e.g. the weights are about to change: an exported graph would be stale).

        Raises:
            ValueError: when quantised (int8 exists only in ONNX Runtime).
        """
        if self.quantize:
            raise ValueError(f"quantize={self.quantize!r} runs on ONNX Runtime only; it cannot switch to PyTorch "
                             f"({reason})")
        self.onnx, self.why_torch = None, f"is off: {reason}"
        self._exact.clear()

    @staticmethod
    def onnx_unsupported(loaded: LoadedModel, padding_side: str = "right") -> str | None:
        """Why ONNX Runtime cannot serve ``loaded`` (a phrase), or ``None`` when it can."""
        if not ort_available():
            return "is not installed (pip install onnxruntime onnx)"
        if padding_side != "right":
            return f"pads on the right, not {padding_side!r}"
        return OnnxBackend.unsupported(loaded)

    @property
    def model_sites(self) -> tuple[str, ...]:
        """Every site PyTorch records; only ``block`` when quantised."""
        return ("block",) if self.quantize else super().model_sites

    @property
    def precision(self) -> str:
        """``"int8"`` when quantised, else the dtype."""
        return self.quantize or super().precision

    def exact(self, depth: int) -> bool:
        """Whether ONNX Runtime gives PyTorch's states for layers ``0..depth`` (checked once per depth)."""
        if self.onnx is None:
            return False
        if depth not in self._exact:
            ids, mask = probe_batch(self.loaded.tokenizer)
            layers = list(range(depth + 1))
            want = capture(self.loaded, ids, mask, layers)  # Shape: (layers, 2, tokens, hidden)
            got = self.onnx.forward(ids, mask, layers, "block")
            keep = mask.bool()
            scale = max(1.0, float(want[:, keep].abs().max()))
            self._exact[depth] = float((got[:, keep] - want[:, keep]).abs().max()) <= EXACT * scale
        return self._exact[depth]

    def uses_onnx(self, layers: Sequence[int], site: str) -> bool:
        """Whether a forward pass for ``layers`` at ``site`` runs on ONNX Runtime."""
        if self.onnx is None or site != "block":
            return False
        return bool(self.quantize) or self.exact(self.onnx.depth_for(layers))

    def runtime(self) -> str:
        """Which runtime serves what, so far: e.g. ``"onnxruntime (block, depths 6); torch otherwise"``."""
        if self.onnx is None:
            return f"torch (ONNX Runtime {self.why_torch})"
        fast = sorted(d for d, ok in self._exact.items() if ok)
        slow = sorted(d for d, ok in self._exact.items() if not ok)
        parts = [f"onnxruntime {self.onnx.ort.__version__} for the block site"
                 + (f" (exact at depths {fast})" if fast else "")]
        if slow:
            parts.append(f"torch at depths {slow} (ONNX Runtime not within {EXACT} of PyTorch there)")
        return "; ".join(parts) + ("" if self.quantize else "; torch for other sites")

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, width]`` (see :meth:`Backend.forward`) from ONNX Runtime where it is exact, else
        from PyTorch."""
        if self.onnx is not None and self.uses_onnx(layers, site):  # (the first test is for the type checker)
            return self.onnx.forward(input_ids, attention_mask, layers, site)
        return super().forward(input_ids, attention_mask, layers, site)


__all__ = ["EXACT", "AutoBackend"]
