"""``SequenceClassifier``: a trained head with its encoder; predicts texts, saves to and loads from a directory.

A model directory holds::

    config.json          HeadConfig (layers, site, pool, combine, classifier, labels, ...)
    labels.json          {"label": index}
    head.safetensors     the head's weights (metadata: layerwise version, encoder, its weights fingerprint and dtype,
                         resolved layers, ``"format": "layerwise-head"``)
    train_log.jsonl      one line per epoch (when trained by layerwise)
    metrics.json         dev/test scores of the saved model (when trained by layerwise)
    encoder/             finetune mode only: the fine-tuned encoder (safetensors) and its tokenizer

Frozen mode references the encoder by ``config.model`` (``null`` = the embedded default model; a local directory is
saved as an absolute path, so the head loads from any working directory). When the encoder has moved, give its new
place (``load(dir, model=...)``, CLI ``--model``): it is checked against the saved weights fingerprint, so a different
encoder is refused rather than silently giving wrong predictions. Heads saved before fingerprints were recorded load
unchecked.

:meth:`SequenceClassifier.save` writes only the files above: it refuses a file path and a non-empty directory that is
not a layerwise model directory (:func:`is_model_dir`), and never deletes anything.

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

from ..encoding.padding import pad_rows
from ..encoding.pooling import pool as pool_tokens
from ..encoding.tokenize import check_texts
from ..errors import LayerwiseError
from ..extractor import Extractor
from ..model.capture import capture
from ..model.loading import quiet_transformers
from ..model.options import ModelOptions
from ..outputs import OwnedOutput
from ..provenance import tensors_fingerprint
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
        return list(self.config.labels)

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
        if _empty(texts):
            return np.zeros((0, len(self.labels)))
        return np.concatenate([p for _, p in self.iter_predict(texts, batch_size)])

    def iter_predict(self, texts: Sequence[str], batch_size: int = 256) -> Iterator[tuple[list[str], np.ndarray]]:
        """``(labels, probabilities [b, C])`` for consecutive slices of ``batch_size`` texts (streaming).

        Raises:
            TypeError: ``texts`` is a bare string (wrap it in a list: ``[text]``) or holds a non-string.
        """
        if _empty(texts):
            return
        texts = check_texts(texts)  # a bare string is refused, as in Extractor.encode
        for start in range(0, len(texts), batch_size):
            probs = torch.softmax(self._logits(texts[start : start + batch_size]), dim=-1).numpy()
            yield [self.labels[i] for i in probs.argmax(1)], probs

    def predict(self, texts: Sequence[str], batch_size: int = 256) -> list[str]:
        """The most probable label of each text (``TypeError`` for a bare string: pass ``[text]``)."""
        return [label for labels, _ in self.iter_predict(texts, batch_size) for label in labels]

    # ---- persistence ---------------------------------------------------------------------------------------
    def save(self, directory: str | os.PathLike, *, log: list[dict] | None = None, metrics: dict | None = None) -> Path:
        """Write the model directory (see the module docstring); returns its path.

        Only this class's own files are written: into a temporary directory beside ``directory``, then put in
        place (:class:`~layerwise.outputs.OwnedOutput`; an earlier layerwise model there is replaced entry by entry,
        nothing else in it is touched).

        Raises:
            ValueError: ``directory`` is a file, or a non-empty directory that is not a layerwise model directory.
        """
        return owned_model_dir(directory).write(lambda staged: self._write(staged, log, metrics), overwrite=True)

    def _write(self, out: Path, log: list[dict] | None, metrics: dict | None) -> None:
        """The model directory's files, written into ``out`` (a fresh directory)."""
        from safetensors.torch import save_file

        self.config.to_json(out / "config.json")
        (out / "labels.json").write_text(json.dumps({n: i for i, n in enumerate(self.labels)}, indent=2) + "\n")
        state = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        # fine-tuned weights changed since the backend cached its fingerprint: hash them as they are now
        fingerprint = (tensors_fingerprint(self.extractor.loaded.model.state_dict()) if self.config.mode == "finetune"
                       else self.extractor.fingerprint())
        meta = {"layerwise_version": __version__, "encoder": self.extractor.loaded.name,
                "encoder_fingerprint": fingerprint, "encoder_dtype": _dtype_name(self.extractor.loaded.dtype),
                "layers": json.dumps(list(self.layers)), "format": FORMAT}
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


MODEL_ENTRIES = ("config.json", "labels.json", "head.safetensors", "encoder", "train_log.jsonl", "metrics.json")


def owned_model_dir(directory: str | os.PathLike) -> OwnedOutput:
    """A model directory as an :class:`~layerwise.outputs.OwnedOutput`: its marker is :func:`is_model_dir`; the
    entries an earlier model wrote (:data:`MODEL_ENTRIES`) are replaced or removed, nothing else is touched."""
    return OwnedOutput(Path(directory), "directory", "layerwise model directory", owned=is_model_dir,
                       marker="config.json and a head.safetensors written by layerwise",
                       own_entries=lambda d: [n for n in MODEL_ENTRIES if (d / n).exists()])


FORMAT = "layerwise-head"  # the ``format`` metadata of every head.safetensors layerwise writes


def _empty(texts: object) -> bool:
    return isinstance(texts, Sequence) and not isinstance(texts, (str, bytes)) and len(texts) == 0


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _head_metadata(path: Path) -> dict[str, str] | None:
    """The metadata of a head.safetensors layerwise wrote, else ``None`` (absent, unreadable or someone else's)."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
    except Exception:  # not a readable safetensors file: not one layerwise wrote
        return None
    return meta if meta.get("format") == FORMAT else None


def is_model_dir(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a model directory layerwise wrote (config.json and a layerwise head.safetensors)."""
    root = Path(directory)
    return (root / "config.json").is_file() and _head_metadata(root / "head.safetensors") is not None


def check_encoder(extractor: Extractor, metadata: dict[str, str], trained_on: str | None) -> None:
    """``ValueError`` when ``extractor`` is not the encoder a head was trained on (by weights fingerprint).

    A head saved without a fingerprint (before layerwise recorded one) is not checked. An encoder loaded in another
    dtype than the training one is compared after casting its weights to the training dtype.
    """
    want = metadata.get("encoder_fingerprint")
    if not want:
        return
    trained_dtype, now_dtype = metadata.get("encoder_dtype"), _dtype_name(extractor.loaded.dtype)
    if trained_dtype in (None, now_dtype) or not hasattr(torch, trained_dtype):
        got = extractor.fingerprint()
    else:
        cast = getattr(torch, trained_dtype)
        got = tensors_fingerprint({k: v.to(cast) if v.is_floating_point() else v
                                   for k, v in extractor.loaded.model.state_dict().items()})
    if got == want:
        return
    hint = (f" (the encoder is loaded in {now_dtype}, the head was trained on {trained_dtype} weights: load it in "
            f"{trained_dtype})" if trained_dtype not in (None, now_dtype) else "")
    raise LayerwiseError(
        f"the encoder {extractor.loaded.name!r} is not the one this head was trained on{hint}: its weights "
        f"fingerprint is {got[:12]}, the head expects {want[:12]} (trained on {trained_on or 'the default model'!r}); "
        f"give the training encoder's current location with --model (load(dir, model=...))"
    )


def load(
    directory: str | os.PathLike,
    *,
    model: ModelOptions | Extractor | str | os.PathLike | None = None,
    device: str | None = None,
) -> SequenceClassifier:
    """Load a model directory written by :meth:`SequenceClassifier.save` (or ``layerwise train``).

    Args:
        directory: the model directory.
        model: the encoder (frozen mode; default: the :class:`~layerwise.ModelOptions` saved in the config): where
            it is now, when it moved since training (a path or hub id; CLI ``--model``), other options for it
            (a ``ModelOptions``), or one already loaded (an :class:`Extractor`; it must be the config's model).
        device: where to run (default: CUDA when available, else CPU); a shortcut for the options' ``device``.

    Raises:
        ValueError: not a model directory; ``model`` with a fine-tuned head (it carries its encoder); an encoder
            whose weights fingerprint differs from the one saved with the head (both named).
    """
    from safetensors import safe_open
    from safetensors.torch import load_file

    root = Path(directory)
    if not (root / "config.json").is_file() or not (root / "head.safetensors").is_file():
        raise LayerwiseError(
            f"{os.fspath(directory)!r} is not a layerwise model directory (needs config.json and head.safetensors)"
        )
    config = HeadConfig.from_json(root / "config.json")
    if model is not None and config.mode == "finetune" and not isinstance(model, Extractor):
        raise LayerwiseError(
            f"{os.fspath(directory)!r} holds a fine-tuned head that carries its own encoder (in encoder/); "
            f"--model / model= does not apply to it: leave it out"
        )
    if isinstance(model, Extractor):
        extractor = model
    else:
        if isinstance(model, ModelOptions):
            options = model
        else:
            options = config.options if model is None else config.options.replace(model=os.fspath(model))
        if config.mode == "finetune":
            options = options.replace(model=str(root / "encoder"))
        extractor = Extractor.from_options(options if device is None else options.replace(device=device))
    with safe_open(str(root / "head.safetensors"), framework="pt") as fh:
        metadata = fh.metadata() or {}
    check_encoder(extractor, metadata, config.options.model)
    clf = SequenceClassifier(config, extractor)
    clf.head.load_state_dict(load_file(str(root / "head.safetensors")))
    clf.head.to(extractor.loaded.device).eval()
    return clf
