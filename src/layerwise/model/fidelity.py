"""How close a reduced-precision runtime stays to float32 on the loaded model, measured once, said when it misses.

A quantised runtime's fidelity depends on the model (its weight and activation ranges), so a figure measured on the
default model says little about another one. The first time a quantised runtime serves a depth, its states for the
bundled sample sentences (``layerwise/data/samples.txt``, short and long ones) are compared with PyTorch float32 on
the same model: every layer up to that depth mean-pooled over its real tokens, the minimum cosine over the
sentences. When the deepest layer falls below :data:`TARGETS` for the precision, a :class:`PrecisionWarning` says
so, once, with the numbers and what to use instead; :func:`measure` returns them either way (``describe()`` shows
them under ``fidelity``).

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor(quantize="int8")                                        # doctest: +SKIP
    >>> ex.describe()["fidelity"]                                                 # doctest: +SKIP
    {'6': {'precision': 'int8-weights', 'min_cosine': [1.0, 0.9999, ...], 'target': 0.99, 'texts': 8}}
"""

from __future__ import annotations

import warnings
from importlib import resources
from typing import Callable

import torch

from .hardware import PrecisionWarning

# deepest layer's min cosine to float32; int8-full trades fidelity for speed on purpose (opt-in), so its bar is lower
TARGETS = {"int8": 0.99, "int8-weights": 0.99, "int8-full": 0.95, "bfloat16": 0.9995}
EXTRA_SAMPLES = ("thank ", "ok", "Yes.")  # very short texts: where int8 activation ranges hurt most


def sample_texts() -> list[str]:
    """The bundled sample sentences and a few very short texts."""
    text = resources.files("layerwise").joinpath("data/samples.txt").read_text(encoding="utf-8")
    return [line for line in text.splitlines() if line.strip()] + list(EXTRA_SAMPLES)


def pooled_min_cosines(got: torch.Tensor, want: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Per layer, the minimum over texts of the cosine between the mean-pooled ``got`` and ``want``.

    Args:
        got, want: ``[K, batch, tokens, width]`` states.
        mask: ``[batch, tokens]``, 1 for real tokens.

    Returns:
        ``K`` floats.
    """
    m = mask.to(torch.float32)[None, :, :, None]
    a = (got.float() * m).sum(2) / m.sum(2).clamp(min=1)  # Shape: (K, batch, width)
    b = (want.float() * m).sum(2) / m.sum(2).clamp(min=1)
    return [round(float(c), 6) for c in torch.nn.functional.cosine_similarity(a, b, dim=-1).min(dim=1).values]


def measure(precision: str, run: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor],
            reference: Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor], tokenizer, depth: int,
            name: str) -> dict:
    """Compare ``run`` (the reduced-precision runtime) with ``reference`` (PyTorch float32) on :func:`sample_texts`
    for layers ``0..depth``; warn once when the deepest layer misses :data:`TARGETS` for ``precision``.

    Args:
        precision: ``"int8"``, ``"int8-weights"``, ``"int8-full"`` or ``"bfloat16"``.
        run, reference: ``(input_ids, attention_mask, layers) -> [K, batch, tokens, width]``.
        tokenizer: the model's fast tokenizer.
        depth: the deepest layer the runtime serves.
        name: the model's name, for the message.

    Returns:
        ``{"precision", "min_cosine" (per layer 0..depth), "target", "texts"}``.
    """
    texts = sample_texts()
    limit = min(int(getattr(tokenizer, "model_max_length", 128) or 128), 128)  # within the model's positions
    enc = tokenizer(texts, padding=True, truncation=True, max_length=limit, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    layers = list(range(depth + 1))
    cosines = pooled_min_cosines(run(ids, mask, layers), reference(ids, mask, layers), mask)
    target = TARGETS.get(precision, 0.0)
    if cosines[-1] < target:
        worst = min(range(len(texts)), key=lambda i: len(texts[i]))
        warnings.warn(
            f"{precision} on {name} keeps a minimum cosine of {cosines[-1]:.4f} to float32 at layer {depth} on "
            f"layerwise's {len(texts)} sample sentences (target {target}; per layer: "
            f"{', '.join(f'{c:.4f}' for c in cosines)}; the shortest, {texts[worst]!r}, are usually the worst). "
            f"Use float32, or check it on your own texts (./dev bench precision measures it downstream).",
            PrecisionWarning, stacklevel=4)
    return {"precision": precision, "min_cosine": cosines, "target": target, "texts": len(texts)}


__all__ = ["EXTRA_SAMPLES", "TARGETS", "measure", "pooled_min_cosines", "sample_texts"]
