"""ONNX Runtime backend: the encoder exported once per (model, layers), ending after the deepest requested layer.

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
from typing import Sequence

import numpy as np
import torch
from torch import nn

from .loading import LoadedModel

BACKENDS = ("torch", "onnx")


def _require_ort():
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
    fam = loaded.family
    if fam.name == "albert":  # one shared layer run num_hidden_layers times
        model.config.num_hidden_layers = depth
        return model
    container_path = fam.layer_paths[0]
    parent = model
    *head, last = container_path.split(".")
    for part in head:
        parent = getattr(parent, part)
    setattr(parent, last, getattr(parent, last)[:depth])
    for attr in ("num_hidden_layers", "n_layers"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, depth)
    return model


def weights_key(loaded: LoadedModel) -> str:
    """A content hash of the model's parameters and buffers (one pass over the weights)."""
    h = hashlib.sha256()
    for name, p in sorted(loaded.model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(p.shape)).encode())
        h.update(p.detach().cpu().float().contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
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
        warnings.simplefilter("ignore")  # tracer warnings about Python-side shape checks; the graph is verified by tests
        torch.onnx.export(
            module, (ids, mask), str(tmp), input_names=["input_ids", "attention_mask"], output_names=["states"],
            dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                          "states": {1: "batch", 2: "tokens"}},
            opset_version=17, dynamo=False,
        )
    os.replace(tmp, path)
    return path


class OnnxRunner:
    """Runs exported graphs for an Extractor: ``run(ids, mask, layers) -> [K, batch, tokens, hidden]``."""

    def __init__(self, loaded: LoadedModel, cache: str | os.PathLike | None = None, threads: int | None = None):
        self.ort = _require_ort()
        self.loaded = loaded
        self.root = cache_dir(cache)
        self.threads = threads or torch.get_num_threads()
        self._key = None
        self._sessions: dict[tuple[int, ...], object] = {}

    def path_for(self, layers: Sequence[int]) -> Path:
        import onnxruntime

        if self._key is None:
            self._key = weights_key(self.loaded)
        spec = {"weights": self._key, "family": self.loaded.family.name, "layers": list(layers),
                "torch": torch.__version__, "ort": onnxruntime.__version__}
        digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:20]
        return self.root / f"{self.loaded.family.name}-{digest}.onnx"

    def session(self, layers: Sequence[int]):
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

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int]) -> torch.Tensor:
        sess = self.session(layers)
        (states,) = sess.run(None, {"input_ids": input_ids.numpy().astype(np.int64),
                                    "attention_mask": attention_mask.numpy().astype(np.int64)})
        return torch.from_numpy(states)


def check_backend(backend: object, site: str | None = None) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}. Valid backends are: {', '.join(BACKENDS)}")
    if backend == "onnx" and site not in (None, "block"):
        raise ValueError(f"backend='onnx' exports block outputs only; site {site!r} needs backend='torch'")
    return backend


__all__ = ["BACKENDS", "OnnxRunner", "check_backend", "export", "truncated_copy"]
