"""Output precision: the last step of an encoding, after pooling. Keep the leading ``dimensions``, L2-normalise, then
quantize to the spec's ``output_dtype``, as sentence-transformers' ``quantize_embeddings`` and vLLM's ``embed_dtype``
do. Imports no torch at module level.

==============  ======================================================================================
output_dtype    each value of the last axis becomes
==============  ======================================================================================
``float32``     itself
``float16``     itself, rounded to half precision
``int8``        ``round((x - lo) / (hi - lo) * 255) - 128``, clipped to ``-128..127``
``uint8``       ``round((x - lo) / (hi - lo) * 255)``, clipped to ``0..255``
``binary``      one bit, ``x > 0``, packed 8 to a byte (first value = highest bit), stored as ``int8``
                (``byte - 128``, sentence-transformers' ``binary``)
``ubinary``     the same bits as ``uint8`` bytes (sentence-transformers' ``ubinary``)
==============  ======================================================================================

``lo`` and ``hi`` are the per-value ranges of a calibration set (:func:`calibration_ranges`): the minimum and maximum
of each of the ``D`` float values over the set's rows. They are part of the :class:`~layerwise.EncodeSpec`
(``calibration``), so a store, a served alias or a later run quantize the same way; ``int8``/``uint8`` without them
are refused. A packed last axis of ``d`` values is ``ceil(d / 8)`` bytes (a 384-float32 vector, 1,536 bytes,
becomes 48: 32 times smaller).

Example::

    >>> import numpy as np
    >>> from layerwise.encoding.precision import quantize_array, calibration_ranges
    >>> quantize_array(np.array([[0.5, -1.0, 2.0, 0.0, 1, 1, 1, 1, -3.0]]), "ubinary")   # 9 values -> 2 bytes
    array([[175,   0]], dtype=uint8)
    >>> lo_hi = calibration_ranges(np.array([[0.0, -1.0], [1.0, 1.0]]))
    >>> quantize_array(np.array([[0.5, 0.0]]), "int8", lo_hi)
    array([[0, 0]], dtype=int8)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from ..errors import SpecError
from .vocab import CALIBRATED_DTYPES, PACKED_DTYPES, VALUE_DTYPES

if TYPE_CHECKING:
    import torch

    from .spec import EncodeSpec

Ranges = tuple[tuple[float, ...], tuple[float, ...]]

# numpy dtype of each output precision (the store's and the service's)
NUMPY_DTYPES: dict[str, Any] = {name: np.dtype(value).type for name, value in VALUE_DTYPES.items()}


def packed_width(width: int, output_dtype: str) -> int:
    """The last axis of ``width`` values after ``output_dtype``: ``ceil(width / 8)`` bytes for ``binary``/``ubinary``,
    else ``width``."""
    return -(-width // 8) if output_dtype in PACKED_DTYPES else width


def require_calibration(output_dtype: str) -> SpecError:
    """The error for ``int8``/``uint8`` without ranges, saying the three ways to give them."""
    return SpecError(
        f"output_dtype={output_dtype!r} needs calibration ranges, the minimum and maximum of every value over a set "
        f"of texts you choose once: Extractor.calibrate(texts, spec), spec.calibrated(float32 features), or on the "
        f"command line --calibration FILE (one text a line, or a JSON of {{\"min\": [...], \"max\": [...]}}); "
        f"float16, binary and ubinary need none"
    )


def check_calibration(calibration: Any, output_dtype: str) -> Ranges | None:
    """``calibration`` as ``(lo, hi)`` tuples of finite floats of one length with ``lo <= hi``, or ``None`` (an
    ``int8``/``uint8`` spec without ranges is refused when resolved: :func:`require_calibration`).

    Accepts what :func:`parse_ranges` accepts.

    Raises:
        SpecError: ranges given for a precision that takes none, or malformed ranges (naming the first bad value).
    """
    if calibration is None:
        return None
    if output_dtype not in CALIBRATED_DTYPES:
        raise SpecError(f"calibration ranges apply to output_dtype int8 or uint8 only, not {output_dtype!r}; "
                        f"drop calibration or choose int8/uint8")
    return parse_ranges(calibration)


def parse_ranges(calibration: Any) -> Ranges:
    """``(lo, hi)`` sequences, an array ``[2, D]`` or a dict ``{"min": [...], "max": [...]}`` as ``(lo, hi)`` tuples
    of finite floats of one length with ``lo <= hi``.

    Raises:
        SpecError: malformed ranges (naming the first bad value).
    """
    if isinstance(calibration, dict):
        if set(calibration) != {"min", "max"}:
            raise SpecError(f"calibration as a dict takes the keys 'min' and 'max', got {sorted(calibration)}")
        calibration = (calibration["min"], calibration["max"])
    try:
        lo, hi = (np.asarray(row, dtype=np.float64).reshape(-1) for row in calibration)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"calibration must be two lists of numbers (min, max), got {type(calibration).__name__}: "
                        f"{exc}") from None
    if lo.shape != hi.shape or lo.size == 0:
        raise SpecError(f"calibration min and max must have one equal, non-zero length, got {lo.size} and {hi.size}")
    bad = np.flatnonzero(~(np.isfinite(lo) & np.isfinite(hi) & (lo <= hi)))
    if bad.size:
        i = int(bad[0])
        raise SpecError(f"calibration value {i} has min {lo[i]} and max {hi[i]}; each needs finite min <= max")
    return tuple(float(x) for x in lo), tuple(float(x) for x in hi)


def calibration_ranges(features: Any, width: int | None = None) -> Ranges:
    """Per-value ``(min, max)`` over the rows of ``features``, flattened over ``D``: the ranges an ``int8``/``uint8``
    spec records.

    Args:
        features: an array ``[n, *D]`` (``n`` rows), or a list of arrays or tensors (each ``[*D]`` for one row, or
            ``[m, *D]`` for ``m`` rows: give ``width``).
        width: ``prod(D)``, the values of one row; needed for lists whose items hold several rows or a
            multi-axis ``D`` (``Extractor.calibrate`` gives it).

    Raises:
        SpecError: no rows, rows of different widths, or inf/NaN values.
    """
    if isinstance(features, np.ndarray):
        parts = [features.reshape(len(features), -1) if width is None else features.reshape(-1, width)]
    else:
        arrays = [np.asarray(f.numpy() if hasattr(f, "numpy") else f, dtype=np.float64) for f in features]
        parts = [a.reshape(-1, width) if width is not None else a.reshape(1, -1) if a.ndim == 1 else a
                 for a in arrays]
    if not parts or sum(p.shape[0] for p in parts) == 0:
        raise SpecError("calibration needs at least one row of features")
    widths = {p.shape[-1] for p in parts}
    if len(widths) != 1:
        raise SpecError(f"calibration rows differ in width: {sorted(widths)}")
    flat = np.concatenate([p.astype(np.float64) for p in parts])
    if not np.isfinite(flat).all():
        raise SpecError("calibration features hold inf or NaN values; use texts that encode to finite vectors")
    return tuple(float(x) for x in flat.min(0)), tuple(float(x) for x in flat.max(0))


def read_calibration(path: str | Path) -> Ranges | list[str]:
    """A calibration file: ranges from ``.json`` (``{"min": [...], "max": [...]}``, or a spec holding
    ``calibration``) or ``.npy`` (``[2, D]``), else texts (one a line, blank lines skipped) to encode.

    Raises:
        SpecError: a missing, empty or malformed file.
    """
    p = Path(path)
    if not p.is_file():
        raise SpecError(f"calibration file {str(p)!r} does not exist; give a text file (one text a line) or a JSON "
                        f"of {{\"min\": [...], \"max\": [...]}}")
    if p.suffix == ".npy":
        arr = np.load(p, allow_pickle=False)
        if arr.ndim < 2 or arr.shape[0] != 2:
            raise SpecError(f"{p}: a .npy calibration is [2, D] (min row, max row), got shape {list(arr.shape)}")
        return parse_ranges(arr.reshape(2, -1))
    if p.suffix == ".json":
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError) as exc:
            raise SpecError(f"{p}: not valid JSON ({exc})") from None
        if isinstance(data, dict) and "calibration" in data:
            data = data["calibration"]
        return parse_ranges(data)
    texts = [line for line in p.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        raise SpecError(f"calibration file {str(p)!r} holds no text; give one text a line")
    return texts


def apply_calibration(spec: EncodeSpec, source: str | Path | None,
                      calibrate: Callable[[list[str], EncodeSpec], EncodeSpec]) -> EncodeSpec:
    """``spec`` with the calibration ranges of ``source`` (a file, :func:`read_calibration`): ranges are taken as they
    are, texts are encoded by ``calibrate`` (``Extractor.calibrate``). ``None`` leaves ``spec`` as it is.

    Raises:
        SpecError: as :func:`read_calibration`, or ranges for a spec that is not ``int8``/``uint8``.
    """
    if source is None:
        return spec
    if spec.output_dtype not in CALIBRATED_DTYPES:
        raise SpecError(f"a calibration file applies to output_dtype int8 or uint8, not {spec.output_dtype!r}")
    got = read_calibration(source)
    return calibrate(got, spec) if isinstance(got, list) else spec.replace(calibration=got)


def quantize_array(x: np.ndarray, output_dtype: str, calibration: Ranges | None = None) -> np.ndarray:
    """``x`` ``[..., *D]`` (float) in ``output_dtype`` (numpy; see the module table). ``calibration`` flattens
    ``D``; packed precisions pack the last axis."""
    import torch

    run = quantizer(output_dtype, calibration, tuple(x.shape[-1:]))
    return run(torch.from_numpy(np.asarray(x, np.float32))).numpy()


def quantizer(output_dtype: str, calibration: Ranges | None, shape: Sequence[int]) -> Callable[[torch.Tensor],
                                                                                              torch.Tensor]:
    """A function from float features ``[..., *shape]`` to ``output_dtype`` on their device (batched: one call per
    forward batch). ``calibration`` holds ``prod(shape)`` ranges.

    Raises (from the function):
        SpecError: inf or NaN features (they have no integer value).
    """
    import torch

    def check(x: torch.Tensor) -> None:
        if not bool(torch.isfinite(x).all()):
            raise SpecError(f"the features hold inf or NaN values, which {output_dtype} cannot hold (huge weights "
                            f"or a float16 overflow); use smaller weights or output_dtype float32")

    if output_dtype in ("float32", "float16"):
        dtype = torch.float32 if output_dtype == "float32" else torch.float16
        return lambda x: x.to(dtype)
    if output_dtype in PACKED_DTYPES:
        width = int(shape[-1])
        pad = packed_width(width, output_dtype) * 8 - width

        def pack(x: torch.Tensor) -> torch.Tensor:
            check(x)
            bits = (x > 0).to(torch.int32)
            if pad:
                bits = torch.nn.functional.pad(bits, (0, pad))
            weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.int32, device=x.device)
            byte = (bits.reshape(*bits.shape[:-1], -1, 8) * weights).sum(-1)
            return (byte - 128).to(torch.int8) if output_dtype == "binary" else byte.to(torch.uint8)

        return pack
    if calibration is None:
        raise require_calibration(output_dtype)
    n = math.prod(shape)
    if len(calibration[0]) != n:
        raise SpecError(f"the calibration holds {len(calibration[0])} ranges but this spec gives {n} values "
                        f"({list(shape)}); calibrate again with this spec's layers, combine, pool and dimensions")
    lo_np = np.asarray(calibration[0], np.float32).reshape(tuple(shape))
    step_np = np.maximum((np.asarray(calibration[1], np.float32).reshape(tuple(shape)) - lo_np) / 255.0, 1e-12)
    offset = 128.0 if output_dtype == "int8" else 0.0
    out_dtype = torch.int8 if output_dtype == "int8" else torch.uint8
    cache: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def scale(x: torch.Tensor) -> torch.Tensor:
        check(x)
        if x.device not in cache:
            cache[x.device] = (torch.from_numpy(lo_np).to(x.device), torch.from_numpy(step_np).to(x.device))
        lo, step = cache[x.device]
        q = torch.round((x.float() - lo) / step) - offset
        return q.clamp_(-offset, 255.0 - offset).to(out_dtype)

    return scale


def dimension_cut(dimensions: int | None, normalize: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The float part of the finish: keep the leading ``dimensions`` of the last axis, then L2-normalise it when
    ``normalize``; ``None`` when there is nothing to do."""
    if dimensions is None and not normalize:
        return None
    import torch

    def cut(x: torch.Tensor) -> torch.Tensor:
        if dimensions is not None:
            x = x[..., :dimensions]
        return torch.nn.functional.normalize(x, dim=-1) if normalize else x

    return cut


def finisher(spec: EncodeSpec, width: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The last step of a resolved ``spec`` for layers of ``width`` features: ``[..., *D]`` float features ->
    ``[..., *feature_shape]`` in ``output_dtype`` (dimensions kept, L2-normalised, quantized; see the module table).

    Raises (from the function):
        SpecError: inf or NaN features for an integer precision.
    """
    cut = dimension_cut(spec.dimensions, spec.normalize)
    quantize = quantizer(spec.output_dtype, spec.calibration, spec.float_shape(width))
    if cut is None:
        return quantize
    return lambda x: quantize(cut(x))


__all__ = ["NUMPY_DTYPES", "Ranges", "apply_calibration", "calibration_ranges", "check_calibration",
           "dimension_cut", "finisher", "packed_width", "parse_ranges", "quantize_array", "quantizer",
           "read_calibration", "require_calibration"]
