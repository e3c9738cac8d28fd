"""The TensorFlow backend: a SavedModel encoder in the TF Hub BERT interface (the TF Hub route of the seeds).

A TF Hub BERT encoder (``hub.load(...)``, e.g. small_bert) is a SavedModel called with a dict of ``input_word_ids``,
``input_mask`` and ``input_type_ids`` (``[batch, tokens]`` int32) that returns ``pooled_output``, ``sequence_output``
and ``encoder_outputs``: one ``[batch, tokens, hidden]`` tensor per layer, embeddings not included. This backend
loads one from a local directory with ``tf.saved_model.load`` and maps its outputs to the one layer rule:

* layer ``i`` (1..L) is ``encoder_outputs[i - 1]``;
* layer 0 (the embeddings) is offered when the model also returns ``embedding_output``, and refused with a message
  naming the outputs it does return otherwise (``Extractor.first_layer`` is then 1);
* ``pool="pooler"`` reads ``pooled_output`` (the model's own pooler on the last layer).

A SavedModel is one traced graph: every call computes all its layers (no early exit; use ``backend="keras"`` on a
keras-hub backbone for that). The tokenizer is a Hugging Face fast tokenizer (offsets and word ids are needed): the
directory's own tokenizer files, else ``assets/vocab.txt`` (where TF Hub BERT models keep their vocabulary), lower
cased when the model's ``do_lower_case`` says so, else pass ``tokenizer=`` a directory with one. TF Hub's own
preprocessing SavedModels (tensorflow_text ops) give no offsets and are not used. Needs
``pip install 'layerwise[tf]'``. CPU, float32, site ``block``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ...errors import ModelLoadError
from ...extras import require
from ..layermap import LayerMap
from ..loaded import LoadedModel
from ..loading import TOKENIZER_FILES, ensure_pad_token
from ..options import ModelOptions
from ..positions import UNLIMITED, Positions
from .base import Backend, refuse_options

INPUTS = ("input_word_ids", "input_mask", "input_type_ids")


def require_tf() -> Any:
    """The ``tensorflow`` module; :class:`~layerwise.MissingExtraError` naming the ``[tf]`` extra when missing."""
    return require("tensorflow", what="backend='tf'", extra="tf", packages="TensorFlow, Keras 3 and keras-hub")


def is_saved_model(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a TensorFlow SavedModel directory."""
    return (Path(path) / "saved_model.pb").is_file()


def _tokenizer(path: Path, obj: Any) -> Any:
    from transformers import AutoTokenizer, BertTokenizer

    if any((path / name).exists() for name in TOKENIZER_FILES):
        tok = AutoTokenizer.from_pretrained(str(path))
    elif (path / "assets" / "vocab.txt").is_file():
        flag: Any = getattr(obj, "do_lower_case", None)  # TF Hub BERT models keep it as a variable
        lower = bool(flag.numpy()) if hasattr(flag, "numpy") else True
        tok = BertTokenizer(vocab=str(path / "assets" / "vocab.txt"), do_lower_case=lower)
    else:
        raise ModelLoadError(
            f"{path} holds no tokenizer layerwise can use (none of {', '.join(TOKENIZER_FILES)}, no assets/vocab.txt); "
            f"pass tokenizer='path/to/tokenizer-dir' (a Hugging Face fast tokenizer for this vocabulary)"
        )
    ensure_pad_token(tok)
    return tok


class SavedModelBackend(Backend):
    """A TF Hub-interface SavedModel encoder behind the seam; see the module docstring.

    Args:
        loaded: the facts, with ``loaded.model`` the restored SavedModel object.
    """

    name = "tf"
    sites = ("block",)
    accepts = frozenset({"tokenizer"})
    runs = "runs float32 on the CPU (a SavedModel)"

    def __init__(self, loaded: LoadedModel, *, has_embeddings: bool = False):
        model: Any = loaded.model  # the restored SavedModel object
        if isinstance(model, torch.nn.Module):
            raise ModelLoadError("backend='tf' loads its own model: pass the SavedModel directory, not an "
                                 "already loaded PyTorch model")
        super().__init__(loaded)
        self.tf = require_tf()
        self.encoder = model
        self.has_embeddings = has_embeddings
        self.training_arg = takes_training(model)

    @property
    def first_layer(self) -> int:
        """0 when the model returns ``embedding_output``, else 1 (TF Hub BERT encoders do not)."""
        return 0 if self.has_embeddings else 1

    @classmethod
    def load(cls, options: ModelOptions) -> "SavedModelBackend":
        """Load the SavedModel directory ``options.model`` (``options.tokenizer``: a directory with a Hugging Face
        tokenizer for it, when the SavedModel has none). Options other than ``model``, ``tokenizer``,
        ``max_length`` and ``stride`` are refused."""
        refuse_options(cls, options)
        model, tokenizer = options.model, options.tokenizer
        if model is None or not isinstance(model, (str, os.PathLike)) or not is_saved_model(model):
            raise ModelLoadError(
                f"backend='tf' loads a TensorFlow SavedModel directory (with saved_model.pb); {model!r} is not one"
            )
        tf = require_tf()
        path = Path(model).expanduser()
        obj = tf.saved_model.load(str(path))
        tok = _tokenizer(Path(tokenizer), None) if tokenizer is not None else _tokenizer(path, obj)
        probe = tok(["layerwise", "hello world"], padding=True, return_tensors="np")
        outs = _call(obj, tf, probe["input_ids"], probe["attention_mask"], takes_training(obj))
        missing = [k for k in ("encoder_outputs", "sequence_output") if k not in outs]
        if missing:
            raise ModelLoadError(
                f"{path} does not follow the TF Hub BERT interface: its outputs are {sorted(outs)}, without "
                f"{', '.join(missing)}"
            )
        hidden = int(outs["sequence_output"].shape[-1])
        loaded = LoadedModel(
            model=obj,
            tokenizer=tok,
            layer_map=LayerMap("tfhub-bert", "given", "encoder_outputs", []),
            name=os.fspath(model),
            num_layers=len(outs["encoder_outputs"]),
            site_widths={"block": hidden},
            positions=Positions("absolute", _cap(tok)),
            device=torch.device("cpu"),
            dtype=torch.float32,
            pooler=None,
        )
        return cls(loaded, has_embeddings="embedding_output" in outs)

    def pooler(self) -> None:
        """The SavedModel's pooler runs inside its graph: ``pool="pooler"`` is not offered (use ``cls``)."""
        return None

    def fingerprint(self) -> str:
        """sha256 over the SavedModel's variables (names, shapes, float32 values)."""
        if self._fingerprint is None:
            h = hashlib.sha256()
            for v in sorted(self.encoder.variables, key=lambda v: v.name):
                value = np.asarray(v.numpy(), dtype=np.float32) if v.dtype.is_floating else np.asarray(v.numpy())
                h.update(v.name.encode())
                h.update(str(value.shape).encode())
                h.update(value.tobytes())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, hidden]`` from one call of the SavedModel (all its layers run)."""
        if 0 in layers and not self.has_embeddings:
            raise ModelLoadError(_NO_EMBEDDINGS)
        outs = _call(self.encoder, self.tf, input_ids.cpu().numpy(), attention_mask.cpu().numpy(), self.training_arg)
        states = [outs["embedding_output"] if i == 0 else outs["encoder_outputs"][i - 1] for i in layers]
        return torch.stack([torch.from_numpy(np.asarray(s.numpy(), dtype=np.float32)) for s in states])


_NO_EMBEDDINGS = (
    "layer 0 (the embeddings) is not an output of this SavedModel: TF Hub BERT encoders return encoder_outputs for "
    "layers 1..L only; ask for layers 1..L (e.g. layers='1:' or layers=-1)"
)


def _cap(tokenizer: Any) -> int:
    tok_max = getattr(tokenizer, "model_max_length", None)
    return tok_max if isinstance(tok_max, int) and 0 < tok_max < UNLIMITED else 512


def takes_training(obj: Any) -> bool:
    """Whether the SavedModel's ``__call__`` takes ``training`` (TF Hub BERT encoders do; plain exports may not).

    Read from the restored function's signature, never found by trial: a restored ``tf.function`` that raises keeps
    an internal lock, and every later call from another thread (the service's worker) would hang.
    """
    spec = getattr(obj.__call__, "function_spec", None) if callable(obj) else None
    args = getattr(spec, "fullargspec", None)
    return args is not None and "training" in (list(args.args) + list(args.kwonlyargs))


def _call(obj: Any, tf: Any, ids: np.ndarray, mask: np.ndarray, training_arg: bool) -> dict[str, Any]:
    ids = ids.astype(np.int32)
    feed = {"input_word_ids": tf.constant(ids), "input_mask": tf.constant(mask.astype(np.int32)),
            "input_type_ids": tf.constant(np.zeros_like(ids))}
    out = obj(feed, training=False) if training_arg else obj(feed)
    if not isinstance(out, dict):
        raise ModelLoadError(f"the SavedModel returned {type(out).__name__}, not the TF Hub BERT output dict")
    return out


__all__ = ["INPUTS", "SavedModelBackend", "is_saved_model", "require_tf"]
