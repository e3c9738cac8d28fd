"""``backend="auto"`` (the default): the fastest runtime that gives the exact states on this machine.

For the block site of a family-table encoder in float32 on the CPU there are two candidates, ONNX Runtime
(:mod:`layerwise.model.backends.ort`) and PyTorch, and which one is faster depends on the CPU: ONNX Runtime was 1.2-1.7x
faster on the AMD EPYC development machines, PyTorch ~1.2x faster on an Intel Xeon with AMX (``benchmarks/README.md``).
So the first time a depth is used in a process, both run: the exported graph and PyTorch run the same probe batch
and the states must agree within 1e-5 (relative to the states' scale, the project's tolerance for "the same
states"); then both are timed on a ``RACE_SHAPE`` batch (alternating, best of ``RACE_ROUNDS``) and the faster one
serves that depth from then on. ``$LAYERWISE_AUTO_RUNTIME`` changes the choice among exact runtimes: ``fastest``
(the default), ``onnx`` or ``torch`` (no timing). Every other site, device, dtype, padding side or architecture runs
on PyTorch. :meth:`AutoBackend.runtime` says which ran, and why.

``quantize="int8"`` makes ONNX Runtime the only runtime (block site only); a model it cannot run is refused with
the reason. Reduced precision is never chosen by this backend: ``compute_dtype="bfloat16"`` is an explicit option
that runs on PyTorch.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import torch

from ...errors import ModelLoadError
from ..capture import capture
from ..discovery import probe_batch
from ..loaded import LoadedModel
from ..options import ModelOptions
from .ort import OnnxBackend, check_quantize, ort_available
from .pytorch import TorchBackend

EXACT = 1e-5  # max abs difference to PyTorch, relative to max(1, largest state): "the same states"
RACE_SHAPE = (16, 64)  # (texts, tokens) of the batch both runtimes are timed on
RACE_ROUNDS = 3
CHOICES = ("fastest", "onnx", "torch")


def runtime_choice() -> str:
    """``$LAYERWISE_AUTO_RUNTIME`` (default ``fastest``): how ``auto`` picks among the runtimes that are exact."""
    choice = os.environ.get("LAYERWISE_AUTO_RUNTIME", "fastest").strip().lower() or "fastest"
    if choice not in CHOICES:
        raise ModelLoadError(f"LAYERWISE_AUTO_RUNTIME={choice!r} is not a choice. Valid values are: "
                         f"{', '.join(CHOICES)} (fastest: time both once per depth; onnx/torch: always that one "
                         f"where it is exact)")
    return choice


class AutoBackend(TorchBackend):
    """ONNX Runtime where it is exact and applies, else PyTorch (all sites, early exit).

    Args:
        loaded: the model.
        padding_side: as for :class:`~layerwise.model.backends.pytorch.TorchBackend` (``"left"`` runs PyTorch).
        cache: directory for exported graphs (see :func:`layerwise.model.backends.ort.cache_dir`).
        quantize: ``None`` or ``"int8"`` (dynamic int8 through ONNX Runtime; block site only).
    """

    name = "auto"
    accepts = TorchBackend.accepts | {"quantize", "onnx_cache"}

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "AutoBackend":
        """``AutoBackend(loaded, padding_side, cache=options.onnx_cache, quantize=options.quantize)``."""
        return cls(loaded, options.padding_side, cache=options.onnx_cache, quantize=options.quantize)

    def __init__(self, loaded: LoadedModel, padding_side: str = "right", cache: str | os.PathLike | None = None,
                 quantize: str | None = None):
        super().__init__(loaded, padding_side)
        self.quantize = check_quantize(quantize)
        self.why_torch = self.onnx_unsupported(loaded, padding_side)
        self.onnx: OnnxBackend | None = None
        if self.why_torch is None:
            self.onnx = OnnxBackend(loaded, cache=cache, quantize=self.quantize)
        elif self.quantize:
            raise ModelLoadError(f"quantize={self.quantize!r} runs through ONNX Runtime, which {self.why_torch}")
        self._exact: dict[int, bool] = {}  # depth -> ONNX Runtime agreed with PyTorch on the probe batch
        self._onnx_at: dict[int, bool] = {}  # depth -> ONNX Runtime serves it (exact, and chosen)
        self._why: dict[int, str] = {}  # depth -> why that runtime serves it

    def torch_only(self, reason: str) -> None:
        """Run PyTorch from now on (e.g. the weights are about to change: an exported graph would be stale).

        Raises:
            ValueError: when quantised (int8 exists only in ONNX Runtime).
        """
        if self.quantize:
            raise ModelLoadError(f"quantize={self.quantize!r} runs on ONNX Runtime only; it cannot switch to PyTorch "
                             f"({reason})")
        self.onnx, self.why_torch = None, f"is off: {reason}"
        self._exact.clear()
        self._onnx_at.clear()
        self._why.clear()

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

    def race(self, depth: int) -> tuple[float, float]:
        """Seconds (best of ``RACE_ROUNDS``, alternating) for ``(PyTorch, ONNX Runtime)`` on a ``RACE_SHAPE`` batch
        of layers ``0..depth``, after one warm-up call each."""
        onnx = self.onnx
        if onnx is None:
            raise RuntimeError(f"race({depth}) needs ONNX Runtime, which {self.why_torch}")
        n, t = RACE_SHAPE
        vocab = int(getattr(self.loaded.model.config, "vocab_size", 1000))
        ids = torch.randint(min(1000, vocab - 1), vocab, (n, t), generator=torch.Generator().manual_seed(0))
        mask = torch.ones_like(ids)
        layers = list(range(depth + 1))
        runs = {"torch": lambda: TorchBackend.forward(self, ids, mask, layers, "block"),
                "onnx": lambda: onnx.forward(ids, mask, layers, "block")}
        best = {name: float("inf") for name in runs}
        for run in runs.values():
            run()  # warm-up: first-call allocations
        for _ in range(RACE_ROUNDS):
            for name, run in runs.items():
                t0 = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t0)
        return best["torch"], best["onnx"]

    def serves_onnx(self, depth: int) -> bool:
        """Whether ONNX Runtime serves layers ``0..depth``: exact, and chosen by ``$LAYERWISE_AUTO_RUNTIME``
        (decided once per depth)."""
        if self.onnx is None:
            return False
        if self.quantize:
            return True
        if depth not in self._onnx_at:
            choice = runtime_choice()
            if choice == "torch":
                use, why = False, "LAYERWISE_AUTO_RUNTIME=torch"
            elif not self.exact(depth):
                use, why = False, f"ONNX Runtime not within {EXACT} of PyTorch there"
            elif choice == "onnx":
                use, why = True, "exact; LAYERWISE_AUTO_RUNTIME=onnx"
            else:
                slow, fast = self.race(depth)
                use = fast < slow
                shape = "x".join(map(str, RACE_SHAPE))
                why = f"exact; {'faster' if use else 'slower'} here: {fast * 1e3:.1f} ms vs PyTorch's " \
                      f"{slow * 1e3:.1f} ms on a {shape} batch"
            self._onnx_at[depth], self._why[depth] = use, why
        return self._onnx_at[depth]

    def uses_onnx(self, layers: Sequence[int], site: str) -> bool:
        """Whether a forward pass for ``layers`` at ``site`` runs on ONNX Runtime."""
        if self.onnx is None or site != "block":
            return False
        return self.serves_onnx(self.onnx.depth_for(layers))

    def runtime(self) -> str:
        """Which runtime serves what so far, and why: e.g. ``"onnxruntime 1.23.2 for the block site at depths [6]
        (exact; faster here: ...); torch for other sites"``."""
        if self.onnx is None:
            return f"torch (ONNX Runtime {self.why_torch})"
        head = f"onnxruntime {self.onnx.ort.__version__}"
        if self.quantize:
            return f"{head} ({self.quantize}) for the block site"
        chosen = sorted(self._onnx_at.items())
        parts = [f"{head} for the block site at depths [{d}] ({self._why[d]})" for d, on in chosen if on]
        parts += [f"torch at depths [{d}] ({self._why[d]})" for d, on in chosen if not on]
        return "; ".join(parts or [f"{head} or torch for the block site (decided at first use of each depth)"]) \
            + "; torch for other sites"

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, width]`` (see :meth:`Backend.forward`) from ONNX Runtime where it is exact, else
        from PyTorch."""
        if self.onnx is not None and self.uses_onnx(layers, site):  # (the first test is for the type checker)
            return self.onnx.forward(input_ids, attention_mask, layers, site)
        return super().forward(input_ids, attention_mask, layers, site)


__all__ = ["EXACT", "AutoBackend"]
