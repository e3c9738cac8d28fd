"""``SequenceClassifier``: a trained head with its encoder; predicts texts, saves to and loads from a directory.

A model directory holds::

    config.json          HeadConfig (layers, site, pool, combine, classifier, labels, ...)
    labels.json          {"label": index}
    head.safetensors     the head's weights (metadata: layerwise version, encoder, resolved layers)
    train_log.jsonl      one line per epoch (when trained by layerwise)
    metrics.json         dev/test scores of the saved model (when trained by layerwise)
    encoder/             finetune mode only: the fine-tuned encoder (safetensors) and its tokenizer

Frozen mode references the encoder by ``config.model`` (``null`` = the embedded default model).

Example::

    >>> import layerwise as lw
    >>> clf = lw.heads.load("sst2-head")                                       # doctest: +SKIP
    >>> clf.predict(["a gorgeous, witty film", "tedious and flat"])            # doctest: +SKIP
    ['1', '0']
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..capture import capture
from ..extractor import Extractor
from ..loading import quiet_transformers
from ..padding import pad_rows
from ..pooling import pool as pool_tokens
from ..version import __version__
from .config import HeadConfig
from .model import LayerHead


class SequenceClassifier:
    """Encoder + :class:`LayerHead`. ``predict_proba(texts) -> [n, C]``, ``predict(texts) -> labels``."""

    def __init__(self, config: HeadConfig, extractor: Extractor, head: LayerHead | None = None):
        self.config = config
        self.extractor = extractor
        self.spec = config.encode.resolve(extractor, learned=True)
        self.layers: tuple[int, ...] = tuple(self.spec.layer_indices)
        # per-layer features [K, W]: each layer pooled on its own (W doubled for mean_max)
        per_layer = self.spec.replace(combine="stack", weights=None)
        width = per_layer.feature_shape(extractor.site_width(config.site))[-1]
        self.head = head if head is not None else LayerHead(config, len(self.layers), width)
        self.head.to(extractor.loaded.device)

    @property
    def labels(self) -> list[str]:
        return self.config.labels

    # ---- features ------------------------------------------------------------------------------------------
    def features(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Inference features: ``[n, K, W]`` pooled per layer, or padded ``([n, T, K, W], mask)`` for attention."""
        c, ex = self.config, self.extractor
        truncate = c.mode == "finetune"  # fine-tuned on truncated windows: predict the same way
        if c.pool != "attention":
            x = ex.encode(list(texts), layers=list(self.layers), combine="stack", pool=c.pool, site=c.site,
                          return_tensors="pt", truncate=truncate)
            return x.float(), None
        toks = ex.encode(list(texts), layers=list(self.layers), combine="stack", pool=None, site=c.site,
                         return_tensors="pt", truncate=truncate)
        return pad_rows(toks, dtype=torch.float32)

    def train_features(self, texts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Differentiable features for fine-tuning (encoder in train mode, windows truncated at ``max_length``)."""
        ex = self.extractor
        enc = ex.tokenizer(list(texts), truncation=True, max_length=ex.max_length, padding=True, return_tensors="pt")
        dev = ex.loaded.device
        mask = enc["attention_mask"].to(dev)
        states = capture(ex.loaded, enc["input_ids"], mask, self.layers, self.config.site, grad=True)  # [K, B, T, W]
        x = states.permute(1, 2, 0, 3)  # [B, T, K, W]
        if self.config.pool == "attention":
            return x, mask
        return pool_tokens(x, mask, self.config.pool), None

    # ---- prediction ----------------------------------------------------------------------------------------
    def _logits(self, texts: Sequence[str]) -> torch.Tensor:
        x, mask = self.features(texts)
        dev = self.extractor.loaded.device
        with torch.inference_mode():
            return self.head.eval()(x.to(dev), None if mask is None else mask.to(dev)).float().cpu()

    def predict_proba(self, texts: Sequence[str], batch_size: int = 256) -> np.ndarray:
        """Class probabilities ``[n, C]`` in the order of :attr:`labels`."""
        if not len(texts):
            return np.zeros((0, len(self.labels)))
        return np.concatenate([p for _, p in self.iter_predict(texts, batch_size)])

    def iter_predict(self, texts: Sequence[str], batch_size: int = 256) -> Iterator[tuple[list[str], np.ndarray]]:
        """``(labels, probabilities [b, C])`` for consecutive slices of ``batch_size`` texts (streaming)."""
        for start in range(0, len(texts), batch_size):
            probs = torch.softmax(self._logits(texts[start : start + batch_size]), dim=-1).numpy()
            yield [self.labels[i] for i in probs.argmax(1)], probs

    def predict(self, texts: Sequence[str], batch_size: int = 256) -> list[str]:
        """The most probable label of each text."""
        return [label for labels, _ in self.iter_predict(texts, batch_size) for label in labels]

    # ---- persistence ---------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, *, log: list[dict] | None = None, metrics: dict | None = None) -> Path:
        """Write the model directory (see the module docstring); returns its path."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        self.config.to_json(out / "config.json")
        (out / "labels.json").write_text(json.dumps({n: i for i, n in enumerate(self.labels)}, indent=2) + "\n")
        state = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        meta = {"layerwise_version": __version__, "encoder": self.extractor.loaded.name,
                "layers": json.dumps(list(self.layers)), "format": "layerwise-head"}
        save_file(state, str(out / "head.safetensors"), metadata=meta)
        if self.config.mode == "finetune":
            with quiet_transformers():
                # save_pretrained: a transformers PreTrainedModel method, typed here as nn.Module.__getattr__'s Tensor
                self.extractor.model.save_pretrained(out / "encoder", safe_serialization=True)  # type: ignore[operator]
                self.extractor.tokenizer.save_pretrained(out / "encoder")
        if log is not None:
            (out / "train_log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in log))
        if metrics is not None:
            (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
        return out


def load(
    directory: str | os.PathLike, *, device: str | None = None, extractor: Extractor | None = None
) -> SequenceClassifier:
    """Load a model directory written by :meth:`SequenceClassifier.save` (or ``layerwise train``).

    Args:
        directory: the model directory.
        device: where to run (default: CUDA when available, else CPU).
        extractor: reuse an already loaded encoder (frozen mode; must be the config's model).
    """
    from safetensors.torch import load_file

    root = Path(directory)
    if not (root / "config.json").is_file() or not (root / "head.safetensors").is_file():
        raise ValueError(
            f"{os.fspath(directory)!r} is not a layerwise model directory (needs config.json and head.safetensors)"
        )
    config = HeadConfig.from_json(root / "config.json")
    if extractor is None:
        encoder = str(root / "encoder") if config.mode == "finetune" else config.model
        extractor = Extractor(encoder, device=device, max_length=config.max_length)
    clf = SequenceClassifier(config, extractor)
    clf.head.load_state_dict(load_file(str(root / "head.safetensors")))
    clf.head.to(extractor.loaded.device).eval()
    return clf
