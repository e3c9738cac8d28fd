"""The two int8 recipes of the OpenVINO backend: int8 weights (``quantize="int8"``) and full int8
(``quantize="int8-full"``), both by NNCF on the float32 graph.

``int8`` (:func:`compress_weights`): the weights of every matrix product in int8 (asymmetric, per output channel),
activations in float; OpenVINO's CPU plugin quantises them on the fly per group. It keeps the layers (last-layer
minimum cosine 0.995 on SST-2 dev with the default model).

``int8-full`` (:func:`quantize_full`): post-training quantisation of weights *and* activations, so every matrix
product runs in int8 (VNNI, AMX-INT8). Faster, less exact, and opt-in:

1. statistics on calibration texts: the user's (``ModelOptions.quantize_calibration``, a text file with one text a
   line) or the bundled neutral sample (``layerwise/data/calibration.txt``: 256 texts of 1 to 120 words from many
   registers), each tokenised alone, at most :data:`CALIBRATION_TOKENS` tokens;
2. NNCF's ``TRANSFORMER`` model type (SmoothQuant on the matrix products; normalisations and softmax stay float)
   with the ``MIXED`` preset (weights symmetric, activations asymmetric);
3. the sensitive matrix products kept in float, chosen by measured error rather than by name: for each activation
   quantiser of the fully quantised graph, the deepest layer's error on :data:`SENSITIVITY_TEXTS` calibration texts
   (spread over the set) is measured with that one quantiser bypassed; a product whose quantiser alone carries at least
   :data:`KEEP_SHARE` of the error is kept in float (at most :data:`MAX_KEPT_SHARE` of them) and the graph is
   quantised again without them;
4. the measured error before and after, the products kept and the calibration set's size and sha256 are returned
   (and saved beside the cached graph), so the fidelity of a store or a response is stated, not assumed.

"Error" here is ``1 - mean cosine`` between the mean-pooled deepest layer of the quantised graph and of the float32
graph over the texts. On the default model the error spreads over every product (no quantiser carries 10% of it),
so nothing is kept: see ``benchmarks/README.md`` for the speed and fidelity measured per machine.

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor(quantize="int8-full")                                    # doctest: +SKIP
    >>> ex.encode(["I love Paris"], layers=-1).shape                                # doctest: +SKIP
    (1, 384)
    >>> ex.describe()["fidelity"]["6"]["calibration"]["kept_in_float"]              # doctest: +SKIP
    []
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from importlib import resources
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ...errors import ModelLoadError

CALIBRATION_TOKENS = 128  # a calibration text is cut to this many tokens (statistics, not features)
SENSITIVITY_TEXTS = 32  # calibration texts the per-quantiser error is measured on (one padded batch)
KEEP_SHARE = 0.10  # a product whose quantiser alone carries this share of the deepest layer's error stays float
MAX_KEPT_SHARE = 0.25  # at most this share of the quantised products is kept in float
PASS_THROUGH = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Convert"})  # between a quantiser and MatMul


def calibration_texts(path: str | None = None) -> list[str]:
    """The texts ``int8-full`` calibrates on: the non-empty lines of ``path``, or the bundled neutral sample.

    Raises:
        ModelLoadError: ``path`` is missing, unreadable or holds no text (the message says what to give instead).
    """
    if path is None:
        text = resources.files("layerwise").joinpath("data/calibration.txt").read_text(encoding="utf-8")
    else:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"quantize_calibration={path!r} cannot be read ({exc}): give a UTF-8 text file "
                                 f"with one text a line, or leave it out for the bundled sample") from exc
    texts = [line.strip() for line in text.splitlines() if line.strip()]
    if not texts:
        raise ModelLoadError(f"quantize_calibration={path!r} holds no text: give a UTF-8 text file with one text a "
                             f"line (a few hundred texts like the ones you will encode)")
    return texts


def texts_digest(texts: list[str]) -> str:
    """The sha256 of ``texts`` (one a line): part of a quantised graph's cache key and of its report."""
    return hashlib.sha256("\n".join(texts).encode("utf-8")).hexdigest()


@contextlib.contextmanager
def quiet_nncf() -> Iterator[Any]:
    """NNCF's progress bars and notes go to stderr (a command writing features to stdout stays clean), errors only."""
    import nncf

    nncf.set_log_level(logging.ERROR)
    with contextlib.redirect_stdout(sys.stderr):
        yield nncf


def compress_weights(model: Any) -> Any:
    """``model`` with the weights of its matrix products in int8 (NNCF, asymmetric, per output channel)."""
    with quiet_nncf() as nncf:
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)


def quantize_full(fresh: Callable[[], Any], tokenizer: Any, texts: list[str]) -> tuple[Any, dict]:
    """Quantise weights and activations to int8, keeping in float the products measured as most sensitive.

    Args:
        fresh: returns a new float32 ``openvino.Model`` of the graph each call (inputs ``input_ids`` and
            ``attention_mask`` ``[batch, tokens]``; outputs ``hidden_0 .. hidden_d`` ``[batch, tokens, width]``).
        tokenizer: the model's fast tokenizer.
        texts: the calibration texts (see :func:`calibration_texts`).

    Returns:
        ``(model, report)``: the quantised ``openvino.Model`` and ``{"recipe", "calibration_texts",
        "calibration_sha256", "matmuls", "kept_in_float", "error_all_int8", "error", "most_sensitive"}``.
    """
    import openvino as ov

    items = [{k: v.astype(np.int64) for k, v in tokenizer([t], truncation=True, max_length=CALIBRATION_TOKENS,
                                                        return_tensors="np").items()
              if k in ("input_ids", "attention_mask")} for t in texts]
    core = ov.Core()
    float_model = fresh()
    deepest = max(float_model.outputs, key=lambda o: int(o.get_any_name().split("_")[-1])).get_any_name()
    spread = texts[:: max(1, len(texts) // SENSITIVITY_TEXTS)][:SENSITIVITY_TEXTS]  # short and long alike
    batch = tokenizer(spread, padding=True, truncation=True, max_length=CALIBRATION_TOKENS,
                      return_tensors="np")
    feed = {name: batch[name].astype(np.int64) for name in ("input_ids", "attention_mask")}

    def pooled(model: Any) -> np.ndarray:
        compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        states = compiled(feed)[deepest]  # Shape: (batch, tokens, width)
        mask = feed["attention_mask"][..., None]
        mean = (states * mask).sum(1) / np.maximum(mask.sum(1), 1)  # Shape: (batch, width)
        return mean / np.maximum(np.linalg.norm(mean, axis=1, keepdims=True), 1e-12)

    want = pooled(float_model)

    def error(model: Any) -> float:
        return float(1.0 - (pooled(model) * want).sum(1).mean())

    def quantize(keep: list[str]) -> Any:
        with quiet_nncf() as nncf:
            scope = nncf.IgnoredScope(names=keep, validate=False) if keep else None
            return nncf.quantize(fresh(), nncf.Dataset(items), model_type=nncf.ModelType.TRANSFORMER,
                                 preset=nncf.QuantizationPreset.MIXED, subset_size=len(items), ignored_scope=scope)

    quantized = quantize([])
    quantizers = activation_quantizers(quantized)
    matmuls = sorted({name for _, names in quantizers for name in names})
    base = error(quantized)
    ranked = sensitivity(quantized, quantizers, error, base)
    keep: list[str] = []
    for share, names in ranked:
        if share < KEEP_SHARE or len(keep) + len(names) > MAX_KEPT_SHARE * len(matmuls):
            break
        keep += [n for n in names if n not in keep]
    final, final_error = quantized, base
    if keep:
        final = quantize(keep)
        final_error = error(final)
    report = {"recipe": "nncf TRANSFORMER, MIXED preset, SmoothQuant; sensitive products kept in float",
              "calibration_texts": len(texts), "calibration_sha256": texts_digest(texts), "matmuls": len(matmuls),
              "kept_in_float": sorted(keep), "error_all_int8": round(base, 6), "error": round(final_error, 6),
              "most_sensitive": [{"share": round(s, 4), "matmuls": n} for s, n in ranked[:5]]}
    return final, report


def activation_quantizers(model: Any) -> list[tuple[Any, list[str]]]:
    """Each activation quantiser (``FakeQuantize`` on a computed value, not on a weight) of ``model`` with the names
    of the matrix products it feeds (through reshapes and transposes)."""
    found = []
    for op in model.get_ops():
        if op.get_type_name() != "FakeQuantize" or op.input_value(0).get_node().get_type_name() == "Constant":
            continue
        names, todo = [], [target.get_node() for target in op.output(0).get_target_inputs()]
        while todo:
            node = todo.pop()
            if node.get_type_name() == "MatMul":
                names.append(node.get_friendly_name())
            elif node.get_type_name() in PASS_THROUGH:
                todo += [target.get_node() for target in node.output(0).get_target_inputs()]
        if names:
            found.append((op, sorted(set(names))))
    return found


def sensitivity(model: Any, quantizers: list[tuple[Any, list[str]]], error: Callable[[Any], float],
                base: float) -> list[tuple[float, list[str]]]:
    """The share of ``base`` (the error of ``model``) each activation quantiser carries: the error removed when that
    one quantiser is bypassed, over ``base``; largest first, with the products each feeds.

    Args:
        model: the fully quantised ``openvino.Model``.
        quantizers: its :func:`activation_quantizers`.
        error: the measured error of a model (see :func:`quantize_full`).
        base: ``error(model)``.
    """
    ranked = []
    for op, names in quantizers:
        trial = model.clone()
        node = next(n for n in trial.get_ops() if n.get_friendly_name() == op.get_friendly_name())
        source = node.input_value(0)
        for target in list(node.output(0).get_target_inputs()):
            target.replace_source_output(source)
        ranked.append(((base - error(trial)) / base if base > 0 else 0.0, names))
    ranked.sort(key=lambda pair: -pair[0])
    return ranked


__all__ = ["CALIBRATION_TOKENS", "KEEP_SHARE", "MAX_KEPT_SHARE", "SENSITIVITY_TEXTS", "activation_quantizers",
           "calibration_texts", "compress_weights", "quantize_full", "quiet_nncf", "sensitivity", "texts_digest"]
