"""The check every export passes before it is reported: the written directory, loaded by plain transformers and by
sentence-transformers, against layerwise on the source model.

The probe set is fixed: the bundled sample sentences and every eighth text of the bundled calibration sample (short
and long texts, several registers and languages), cut at the window as sentence-transformers cuts them.

* :func:`reference` runs layerwise on the *source* model before it is cut: the token states of each layer the
  directory holds and reads (with the final norm applied after its last layer where the cut adds it) and the pooled
  vectors of the plan's spec.
* :func:`check_transformers` loads the directory with ``AutoModel`` (``T5EncoderModel`` and its kind for T5-family
  encoders, as sentence-transformers does) and compares every exported layer's ``hidden_states`` and
  ``last_hidden_state`` on the real tokens: the largest absolute difference must be at most :data:`TOKEN_BOUND`.
  The token ids of the written tokenizer must be layerwise's.
* :func:`check_sentence_transformers` loads it with ``SentenceTransformer`` and compares the vectors: the smallest
  cosine must be at least :data:`COSINE_BOUND`, and their lengths must agree within :data:`NORM_BOUND` (relative,
  after the plan's ``scale``).
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..extractor import Extractor
from ..model.depth import ENCODER_CLASSES
from ..model.loading import quiet_transformers
from .plan import ExportPlan

TOKEN_BOUND = 1e-5
COSINE_BOUND = 0.99999
NORM_BOUND = 1e-4  # the vectors' lengths, relative: the scale of a mix is checked, not only its direction


def probe_texts() -> list[str]:
    """The fixed probe set: the bundled sample sentences and every eighth bundled calibration text."""
    data = resources.files("layerwise").joinpath("data")
    samples = [t for t in data.joinpath("samples.txt").read_text(encoding="utf-8").splitlines() if t.strip()]
    calibration = [t for t in data.joinpath("calibration.txt").read_text(encoding="utf-8").splitlines() if t.strip()]
    return samples + calibration[::8]


class ExportMix(nn.Module):
    """The spec's combination of layers with the final norm where the cut adds it, as a layerwise combine module.

    ``h [k, *lead, W]`` (the spec's layers in order) -> ``[*lead, W]``: the final norm applied to the entries that
    are layer ``K`` when the cut adds it, then ``sum_i w_i h_i`` with the spec's own weights (``mean``: ``1/k``
    each, ``sum``: 1 each; one layer: that layer).
    """

    def __init__(self, weights: Sequence[float], final: nn.Module | None, normed: Sequence[bool]):
        super().__init__()
        self.weights = [float(w) for w in weights]
        self.final = final
        self.normed = list(normed)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        parts = [self.final(x) if norm and self.final is not None else x for x, norm in zip(h.unbind(0), self.normed)]
        return sum((w * x for w, x in zip(self.weights, parts)), torch.zeros_like(parts[0]))


@dataclass
class Reference:
    """layerwise's results on the probe set, computed on the source model before the cut.

    Attributes:
        texts: the probe texts.
        ids: each text's token ids, cut at the window.
        states: layer index (the spec's layers and the directory's last, ``plan.kept``) -> one ``[n_tokens, W]``
            tensor per text (layer ``kept`` with the final norm where the cut adds it).
        vectors: ``[n_texts, W]`` float32: layerwise's vectors of the plan's spec (the directory's are ``plan.scale``
            times these).
    """

    texts: list[str]
    ids: list[list[int]]
    states: dict[int, list[torch.Tensor]]
    vectors: np.ndarray


def reference(ex: Extractor, plan: ExportPlan, texts: list[str]) -> Reference:
    """layerwise's token states and vectors for ``texts`` on the source model ``ex`` (PyTorch, float32)."""
    spec = plan.spec
    layers = spec.layer_indices
    final = ex.loaded.layer_map.final if plan.norm_added else None
    toks = ex.tokenize(texts, words=False, truncate=True)
    wanted = sorted(set(layers) | {plan.kept})
    # one text a batch (a budget of one token): the shapes the transformers check runs, so kernels agree. The states
    # transformers gives (site block): every plan's raw layer is its block state (plan_export refuses the others)
    stack = ex.hidden_states(texts, layers=wanted, site="block", truncate=True, batch_tokens=1)
    states: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode():
        for pos, layer in enumerate(wanted):
            x = stack.tensor[pos]
            if final is not None and layer == plan.kept:
                x = final(x.to(ex.loaded.device)).cpu()
            states[layer] = [x[r, : len(t.ids)].float() for r, t in enumerate(toks)]
    if len(layers) > 1 and spec.combine == "weighted" and spec.weights:
        weights = [float(w) for w in spec.weights]
    else:
        weights = [1.0 / len(layers) if spec.combine == "mean" or len(layers) == 1 else 1.0] * len(layers)
    mix = ExportMix(weights, final, [plan.vectors_normed and layer == plan.depth for layer in layers])
    vectors = ex.encode(texts, layers=list(layers), combine=mix, pool=spec.pool, site=spec.site, truncate=True,
                        normalize=spec.normalize, prompt=spec.prompt)
    return Reference(texts=texts, ids=[list(t.ids) for t in toks], states=states,
                     vectors=np.asarray(vectors, dtype=np.float32))


def base_class(model_type: str) -> Any:
    """The transformers class a plain user loads the directory with: ``AutoModel``, or the encoder-only class of a
    T5-family encoder (what sentence-transformers uses too)."""
    import transformers

    if model_type in ENCODER_CLASSES:
        return getattr(transformers, ENCODER_CLASSES[model_type])
    return transformers.AutoModel


def check_transformers(directory: Path, plan: ExportPlan, ref: Reference, model_type: str,
                       device: torch.device | str = "cpu") -> dict[str, Any]:
    """Load ``directory`` with plain transformers on ``device`` (the reference's) and compare it with ``ref`` (see the
    module docstring).

    Returns:
        ``{"class", "layers_compared", "max_abs_diff", "per_layer", "bound", "ids_equal", "passed"}``.
    """
    from transformers import AutoTokenizer

    cls = base_class(model_type)
    with quiet_transformers():
        net = cls.from_pretrained(directory, dtype=torch.float32).eval().to(device)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = [tokenizer(text, truncation=True, max_length=plan.window)["input_ids"] for text in ref.texts]
    bad = [r for r, (a, b) in enumerate(zip(ids, ref.ids)) if list(a) != b]
    compared = [*(str(k) for k in sorted(ref.states)), "last_hidden_state"]
    per_layer: dict[str, float] = dict.fromkeys(compared, 0.0)
    for r, row in enumerate(ids):
        if r in bad or not row:
            continue
        with torch.inference_mode():  # one text a call, no padding: the same shapes as the reference's
            batch = torch.tensor([row], device=device)
            out = net(input_ids=batch, attention_mask=torch.ones_like(batch), output_hidden_states=True)
        for key in compared:
            got = out.last_hidden_state if key == "last_hidden_state" else out.hidden_states[int(key)]
            want = ref.states[plan.kept if key == "last_hidden_state" else int(key)][r]
            diff = float((got[0].float().cpu() - want).abs().max())
            per_layer[key] = max(per_layer[key], diff if math.isfinite(diff) else math.inf)
    max_diff = max(per_layer.values())
    return {"class": type(net).__name__, "layers_compared": compared, "per_layer": per_layer,
            "max_abs_diff": max_diff, "bound": TOKEN_BOUND, "ids_equal": not bad,
            "ids_differ_at": [ref.texts[r][:60] for r in bad[:3]],
            "passed": not bad and math.isfinite(max_diff) and max_diff <= TOKEN_BOUND}


@contextlib.contextmanager
def _quiet_logger(name: str) -> Iterator[None]:
    """Hold a library's logger at ERROR for the duration (its notices while the check loads are not the user's)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def check_sentence_transformers(directory: Path, ref: Reference, scale: float = 1.0,
                                device: torch.device | str = "cpu") -> dict[str, Any]:
    """Load ``directory`` with ``SentenceTransformer`` on ``device`` and compare its vectors with ``scale`` times
    ``ref``'s: the smallest cosine, and the lengths (within :data:`NORM_BOUND`, relative), so a wrong scale fails too.

    Returns:
        ``{"version", "modules", "min_cosine", "max_abs_diff", "max_norm_ratio_diff", "bound", "passed"}``, or
        ``{"checked": False, "why"}`` when sentence-transformers is not installed.
    """
    try:
        import sentence_transformers
        from sentence_transformers import SentenceTransformer
    except ImportError:
        return {"checked": False, "why": "sentence-transformers is not installed (pip install sentence-transformers)"}
    with quiet_transformers(), _quiet_logger("sentence_transformers"):
        # float32, as the reference: a bfloat16 checkpoint would otherwise compute in bfloat16 (as its source would)
        model = SentenceTransformer(str(directory), device=str(device), local_files_only=True,
                                    model_kwargs={"dtype": torch.float32})
    got = np.asarray(model.encode(ref.texts, batch_size=16, convert_to_numpy=True), dtype=np.float64)
    want = ref.vectors.astype(np.float64) * scale
    got_norm, want_norm = np.linalg.norm(got, axis=1), np.linalg.norm(want, axis=1)
    cos = (got * want).sum(1) / np.maximum(got_norm * want_norm, 1e-30)
    min_cos = float(cos.min())
    max_diff = float(np.abs(got - want).max())
    ratio = float(np.abs(got_norm / np.maximum(want_norm, 1e-30) - 1).max())
    passed = math.isfinite(min_cos) and min_cos >= COSINE_BOUND and math.isfinite(ratio) and ratio <= NORM_BOUND
    return {"checked": True, "version": sentence_transformers.__version__,
            "modules": [type(m).__name__ for m in model], "min_cosine": min_cos, "max_abs_diff": max_diff,
            "max_norm_ratio_diff": ratio, "bound": COSINE_BOUND, "norm_bound": NORM_BOUND, "passed": passed}


__all__ = ["COSINE_BOUND", "NORM_BOUND", "TOKEN_BOUND", "ExportMix", "Reference", "base_class",
           "check_sentence_transformers", "check_transformers", "probe_texts", "reference"]
