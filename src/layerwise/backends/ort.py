"""The ONNX Runtime backend: the encoder exported once per (model, layers), ending after the deepest requested layer.

``Extractor(..., backend="onnx")`` runs the same pipeline (tokenise, windows, token-budget batches, combine,
pool) with the forward pass executed by ONNX Runtime instead of PyTorch. For each set of requested layers the
model is truncated after the deepest one (no later layer exists in the graph) and exported with exactly those
hidden states as its single output ``states [K, batch, tokens, hidden]``. Exports are cached on disk under
``~/.cache/layerwise/onnx`` (``cache_dir=``), keyed by the weights' hash, the family, the layers and the
exporter versions, so the cost is paid once per model and layer choice.

Only the ``block`` site is exported (the other sites are hooks inside a layer); results match the PyTorch path
within 1e-4. Needs ``pip install onnxruntime onnx`` (``layerwise[onnx]``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ..loading import LoadedModel
from .base import Backend


def _require_ort() -> Any:
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ValueError("backend='onnx' needs onnxruntime: pip install 'layerwise[onnx]' (onnxruntime, onnx)") from exc
    return ort


class _Truncated(nn.Module):
    """The encoder cut after its deepest requested layer; returns the requested hidden states stacked."""

    def __init__(self, model: nn.Module, layers: Sequence[int]):
        super().__init__()
        self.model, self.layers = model, list(layers)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hs = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True).hidden_states
        return torch.stack([hs[i] for i in self.layers])  # [K, batch, tokens, hidden]


def truncated_copy(loaded: LoadedModel, depth: int) -> nn.Module:
    """A copy of the model that runs only its first ``depth`` layers (``depth >= 1``)."""
    model = copy.deepcopy(loaded.model).cpu().float().eval()
    if loaded.architecture == "albert":  # one shared layer run num_hidden_layers times
        # config: the transformers model's PretrainedConfig, which mypy sees as nn.Module.__getattr__'s Tensor | Module
        model.config.num_hidden_layers = depth  # type: ignore[union-attr]
        return model
    container_path = loaded.layer_map.path
    parent = model
    *head, last = container_path.split(".")
    for part in head:
        parent = getattr(parent, part)
    setattr(parent, last, getattr(parent, last)[:depth])
    for attr in ("num_hidden_layers", "n_layers"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, depth)
    return model


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The directory for exported graphs: ``explicit``, else ``$XDG_CACHE_HOME/layerwise/onnx``."""
    if explicit is not None:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerwise" / "onnx"


def export(loaded: LoadedModel, layers: Sequence[int], path: Path) -> Path:
    """Export the truncated model with ``states`` as output to ``path`` (atomically)."""
    depth = max(max(layers), 1)
    module = _Truncated(truncated_copy(loaded, depth), layers).eval()
    ids = torch.tensor([[loaded.tokenizer.cls_token_id or 0] + [5] * 6 + [loaded.tokenizer.sep_token_id or 0]] * 2)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with torch.no_grad(), warnings.catch_warnings():
        # tracer warnings about Python-side shape checks; the graph is verified by tests
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module, (ids, mask), str(tmp), input_names=["input_ids", "attention_mask"], output_names=["states"],
            dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                          "states": {1: "batch", 2: "tokens"}},
            opset_version=17, dynamo=False,
        )
    os.replace(tmp, path)
    return path


class OnnxBackend(Backend):
    """ONNX Runtime on the CPU, block site only; one exported graph per set of requested layers.

    Args:
        loaded: the model (exported from its PyTorch weights).
        cache: directory for exported graphs (default ``~/.cache/layerwise/onnx``).
        threads: intra-op threads (default: torch's thread count).
    """

    name = "onnx"
    sites = ("block",)

    def __init__(self, loaded: LoadedModel, cache: str | os.PathLike | None = None, threads: int | None = None):
        super().__init__(loaded)
        if loaded.device.type != "cpu":
            raise ValueError("backend='onnx' runs on the CPU here; use backend='torch' for CUDA")
        if loaded.layer_map.source != "table":
            raise ValueError(
                f"backend='onnx' exports the BERT-family encoders of the family table; this {loaded.architecture} "
                f"model's layers were {loaded.layer_map.source} at load: use backend='torch'"
            )
        self.ort = _require_ort()
        self.root = cache_dir(cache)
        self.threads = threads or torch.get_num_threads()
        self._sessions: dict[tuple[int, ...], Any] = {}

    def path_for(self, layers: Sequence[int]) -> Path:
        """Where the graph for ``layers`` is cached (keyed by weights, family, layers and exporter versions)."""
        spec = {"weights": self.fingerprint(), "family": self.loaded.architecture, "layers": list(layers),
                "torch": torch.__version__, "ort": self.ort.__version__}
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
        return self.root / f"{self.loaded.architecture}-{digest}.onnx"

    def session(self, layers: Sequence[int]) -> Any:
        """The inference session for ``layers`` (exported on first use, then read from the cache)."""
        key = tuple(layers)
        if key not in self._sessions:
            path = self.path_for(layers)
            if not path.exists():
                export(self.loaded, layers, path)
            opts = self.ort.SessionOptions()
            opts.intra_op_num_threads = self.threads
            opts.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            self._sessions[key] = self.ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return self._sessions[key]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, hidden]`` from ONNX Runtime (see :meth:`Backend.forward`)."""
        (states,) = self.session(layers).run(None, {"input_ids": input_ids.numpy().astype(np.int64),
                                                    "attention_mask": attention_mask.numpy().astype(np.int64)})
        return torch.from_numpy(states)


__all__ = ["OnnxBackend", "cache_dir", "export", "truncated_copy"]
