"""``auto``'s policy: which runtime may serve a depth, and which one does. No threads, no clocks, no files but
``races.json``: every function here is a decision on facts handed to it, unit-tested as such.

The facts (gathered by :mod:`~layerwise.model.backends.router`, timed by :mod:`~layerwise.model.backends.race`):

- **eligibility** (:func:`onnx_unsupported`, :func:`bf16_on_openvino`): the compiled runtimes (ONNX Runtime, OpenVINO)
  serve the block site of a family-table encoder padded on the right, in float32 (or bf16 on a CPU with native bf16,
  OpenVINO only); everything else runs on PyTorch;
- **exactness** (:func:`agrees`): a compiled runtime serves a depth only where its states on the probe batch equal
  PyTorch's within :data:`EXACT` (relative to the states' scale) in float32, or a per-token cosine of at least
  :data:`BF16_AGREE` in bf16;
- **the race** (:class:`RaceRecord`): seconds a batch of each exact runtime on :data:`RACE_SHAPES`, once per model and
  machine, kept in ``races.json`` keyed by CPU, threads, weights and versions.

:func:`decide` turns them into a :class:`Decision` for one depth, under ``$LAYERWISE_AUTO_RUNTIME``
(:func:`runtime_choice`): ``fastest`` takes the race's winner where it is exact, ``onnx``/``openvino``/``torch`` that
runtime where it is exact. :func:`pays_back` says whether a job of known size should wait for the preparation of a
compiled runtime before its first record (a store is computed by one runtime from its first record to its last).

Example::

    >>> decide(6, "fastest", ["onnx"], {"onnx": True}, race={"torch": 0.2, "onnx": 0.1}).runtime
    'onnx'
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ...errors import LayerwiseError, ModelLoadError
from ..hardware import native_on_cpu
from ..loaded import LoadedModel
from .openvino import OpenVinoBackend, openvino_available, openvino_version
from .ort import OnnxBackend, ort_available

EXACT = 1e-5  # max abs difference to PyTorch, relative to max(1, largest state): "the same states"
BF16_AGREE = 0.999  # min per-token cosine of two bf16 runtimes' states: the same up to bf16 rounding
RACE_SHAPES = ((64, 16), (32, 32), (16, 64), (8, 128))  # (texts, tokens) of the batches timed: 1,024 tokens each
RACE_ROUNDS = 3
CHOICES = ("fastest", "onnx", "openvino", "torch")
LABELS = {"torch": "PyTorch", "onnx": "ONNX Runtime", "openvino": "OpenVINO"}
# a job waits for a compiled runtime only when what it saves is at least this many times what the preparation costs
PAYBACK = 2.0
GAIN_PRIOR = 1.1  # the speed-up assumed over PyTorch before any race on this machine (benchmarks: 1.05-1.2x)
PREPARE_S_PER_MB = 0.5  # seconds of preparation (export, check, race) per MB of weights assumed before one is timed
PREPARE_CACHED_S = 3.0  # ...and where the exported graph is cached (a cut, a check and a race)


def runtime_choice() -> str:
    """``$LAYERWISE_AUTO_RUNTIME`` (default ``fastest``): how ``auto`` picks among the runtimes that are exact.

    Raises:
        ModelLoadError: another value (the valid ones listed).
    """
    choice = os.environ.get("LAYERWISE_AUTO_RUNTIME", "fastest").strip().lower() or "fastest"
    if choice not in CHOICES:
        raise ModelLoadError(f"LAYERWISE_AUTO_RUNTIME={choice!r} is not a choice. Valid values are: "
                             f"{', '.join(CHOICES)} (fastest: time the exact runtimes once per model and machine; "
                             f"onnx/openvino/torch: always that one where it is exact)")
    return choice


def onnx_unsupported(loaded: LoadedModel, padding_side: str = "right") -> str | None:
    """Why the compiled runtimes cannot serve ``loaded`` (a phrase), or ``None`` when they can."""
    if not ort_available():
        return "is not installed (pip install onnxruntime onnx)"
    if padding_side != "right":
        return f"pads on the right, not {padding_side!r}"
    return OnnxBackend.unsupported(loaded)


def bf16_on_openvino(loaded: LoadedModel, padding_side: str = "right") -> bool:
    """Whether a bf16-loaded model can also run on OpenVINO's bf16 hint: installed, a CPU with native bf16 (OpenVINO
    runs float32 where the CPU has none), a family-table encoder, right padding. Then PyTorch bf16 and OpenVINO bf16
    race like the float32 runtimes."""
    return (loaded.dtype == torch.bfloat16 and padding_side == "right" and native_on_cpu(torch.bfloat16)
            and openvino_available() and OpenVinoBackend.unsupported(loaded) is None)


def candidates(loaded: LoadedModel, padding_side: str, cache: Any, quantize: str | None,
               calibration: str | None) -> tuple[OnnxBackend | None, OpenVinoBackend | None, str | None]:
    """The compiled runtimes that may serve ``loaded`` here (not built yet: each builds its graphs on first use), and
    why ONNX Runtime cannot (``None``: it can): ``(onnx, openvino, why_torch)``.

    Raises:
        ModelLoadError: ``quantize`` where the compiled runtimes cannot serve (int8 exists only there).
        ImportError-like: ``int8-full`` without the ``[openvino]`` extra (:func:`~layerwise.extras.require`).
    """
    why_torch = onnx_unsupported(loaded, padding_side)
    full = quantize == "int8-full"
    if full:
        from ...extras import require

        require("openvino", "nncf", what="quantize='int8-full' (int8 weights and activations, on OpenVINO)",
                extra="openvino", packages="openvino, nncf")
    if why_torch is None:
        onnx = OnnxBackend(loaded, cache=cache, quantize=None if full else quantize)
        openvino = OpenVinoBackend(loaded, exporter=onnx, quantize=quantize, calibration=calibration) \
            if openvino_available() and (not quantize or openvino_version("nncf")) else None
        return onnx, openvino, None
    if quantize:
        raise ModelLoadError(f"quantize={quantize!r} runs through OpenVINO or ONNX Runtime, which {why_torch}")
    if bf16_on_openvino(loaded, padding_side):
        return None, OpenVinoBackend(loaded, precision="bfloat16", cache=cache), why_torch
    return None, None, why_torch


def versions() -> dict[str, str]:
    """Each runtime's name with its version, as ``auto``'s description and a store's manifest say them."""
    import onnxruntime

    return {"onnx": f"onnxruntime {onnxruntime.__version__}", "torch": f"torch {torch.__version__}",
            "openvino": f"openvino {openvino_version()}"}


@dataclass(frozen=True)
class Decision:
    """Which runtime serves a depth (``"torch"``, ``"onnx"`` or ``"openvino"``) and why, in a phrase."""

    runtime: str
    why: str


def agrees(want: torch.Tensor, got: torch.Tensor, keep: torch.Tensor) -> bool:
    """Whether ``got`` (a compiled runtime's states) are PyTorch's ``want``: both ``[layers, batch, tokens, width]``,
    compared on the real tokens ``keep`` (``[batch, tokens]``, bool). float32: within :data:`EXACT` x max(1, largest
    state); otherwise (bf16) a cosine of at least :data:`BF16_AGREE` for every token."""
    if want.dtype == torch.float32:
        scale = max(1.0, float(want[:, keep].abs().max()))
        return float((got[:, keep] - want[:, keep]).abs().max()) <= EXACT * scale
    cos = torch.nn.functional.cosine_similarity(got[:, keep].float(), want[:, keep].float(), dim=-1)
    return float(cos.min()) >= BF16_AGREE


def race_line(times: Mapping[str, float], depth: int, known: bool) -> str:
    """The phrase that says a race's result: the winner's time against the others' on :data:`RACE_SHAPES`."""
    use = min(times, key=lambda name: times[name])
    shapes = ", ".join("x".join(map(str, shape)) for shape in RACE_SHAPES)
    others = ", ".join(f"{LABELS[n]}'s {s * 1e3:.1f} ms" for n, s in times.items() if n != use)
    return (f"{'fastest' if use != 'torch' else 'PyTorch fastest'} here: {times[use] * 1e3:.1f} ms vs {others} a "
            f"batch on batches of {shapes} started ahead, raced at depth {depth} once for the model"
            + (" (timed earlier on this machine)" if known else ""))


def decide(depth: int, choice: str, candidates: Sequence[str], exact: Mapping[str, bool], *,
           race: Mapping[str, float] | None = None, known: bool = False, bf16: bool = False) -> Decision:
    """The runtime for layers ``0..depth``.

    Args:
        choice: ``$LAYERWISE_AUTO_RUNTIME`` (:data:`CHOICES`), or a runtime a store or a resume names.
        candidates: the compiled runtimes available here (``"onnx"``, ``"openvino"``).
        exact: which of them agreed with PyTorch at this depth (a candidate not in it was not checked: not exact).
        race: the race's seconds a batch (``{"torch": s, ...}``) under ``fastest``; ``None`` when not run.
        known: the race came from ``races.json``.
        bf16: the model runs in bf16 (exactness is a cosine then).
    """
    named = [c for c in candidates if choice in ("fastest", c)]
    agreeing = [c for c in named if exact.get(c)]
    inexact = ", ".join(LABELS[c] for c in named if not exact.get(c))
    if choice == "torch":
        return Decision("torch", "LAYERWISE_AUTO_RUNTIME=torch")
    if not agreeing:
        missing = "" if named else f" ({LABELS.get(choice, choice)} is not installed)"
        within = f"at a cosine of {BF16_AGREE} to" if bf16 else f"within {EXACT} of"
        return Decision("torch", f"{inexact or 'no other runtime'} not {within} PyTorch there{missing}")
    if choice != "fastest":
        return Decision(choice, f"exact; LAYERWISE_AUTO_RUNTIME={choice}")
    timed = {n: t for n, t in (race or {}).items() if n == "torch" or n in agreeing}
    if "torch" not in timed or len(timed) < 2:
        raise LayerwiseError(f"decide(fastest) needs a race of PyTorch and the exact runtimes {agreeing}, got {race}")
    use = min(timed, key=lambda name: timed[name])
    raced = race_line(timed, depth, known)
    return Decision(use, f"exact; {raced}" + (f"; {inexact} not exact there" if inexact else ""))


def winner(race: Mapping[str, float] | None) -> str | None:
    """The fastest runtime of a race, or ``None`` when there was none."""
    return min(race, key=lambda name: race[name]) if race else None


def pays_back(torch_seconds: float, gain: float, prepare_seconds: float) -> bool:
    """Whether a job that takes ``torch_seconds`` on PyTorch should wait ``prepare_seconds`` for a runtime ``gain``
    times faster: only when the time saved is at least :data:`PAYBACK` times the wait (the estimates are rough, and
    a wrong "yes" costs the whole wait, a wrong "no" only part of the gain)."""
    if gain <= 1.0 or torch_seconds <= 0:
        return False
    saved = torch_seconds * (1.0 - 1.0 / gain)
    return saved >= PAYBACK * prepare_seconds


def preparation_seconds(weights_bytes: int, share: float, cached: bool) -> float:
    """What preparing a depth should cost before one was timed here: :data:`PREPARE_CACHED_S` (a cut, a check, a race)
    and, unless its exported graph is cached, :data:`PREPARE_S_PER_MB` per MB of the weights times the ``share`` of the
    layers the depth runs."""
    return PREPARE_CACHED_S + (0.0 if cached else PREPARE_S_PER_MB * weights_bytes / 2**20 * share)


def prior_gain(races: Mapping[str, Mapping[str, float]]) -> float:
    """The speed-up over PyTorch to expect of the fastest compiled runtime before this model has raced here: the
    median over the races recorded on this machine (any model), else :data:`GAIN_PRIOR`."""
    gains = sorted(t["torch"] / min(v for k, v in t.items() if k != "torch") for t in races.values()
                   if "torch" in t and len(t) > 1 and min(v for k, v in t.items() if k != "torch") > 0)
    return gains[len(gains) // 2] if gains else GAIN_PRIOR


class RaceRecord:
    """Races already run on this machine: ``races.json`` in ``directory``, one entry per key (see :meth:`key`); read
    on each lookup and rewritten atomically (merged with what another process wrote)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / "races.json"

    @staticmethod
    def key(fingerprint: str, threads: int, runtimes: Sequence[str], cpu: str, versions: Mapping[str, str]) -> str:
        """A digest of what decides a race: CPU model, threads, weights, the runtimes and their ``versions`` (not
        the depth: a model races once, at the first depth it is asked for)."""
        parts = {"cpu": cpu, "threads": threads, "weights": fingerprint,
                 "shapes": [list(shape) for shape in RACE_SHAPES],
                 "runtimes": {r: versions.get(r, "") for r in sorted(runtimes)}}
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:24]

    def read(self) -> dict[str, dict[str, float]]:
        """Every recorded race ``{key: {runtime: seconds}}``; an unreadable file reads as none (it is a cache)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def get(self, key: str) -> dict[str, float] | None:
        """The times of the race ``key``, or ``None`` when it has not been run here."""
        times = self.read().get(key)
        return {str(k): float(v) for k, v in times.items()} if isinstance(times, dict) else None

    def put(self, key: str, times: Mapping[str, float]) -> None:
        """Record a race (a cache: a directory that cannot be written is skipped, the next process races again)."""
        data = {**self.read(), key: dict(times)}
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


__all__ = ["BF16_AGREE", "CHOICES", "EXACT", "GAIN_PRIOR", "LABELS", "PAYBACK", "PREPARE_CACHED_S",
           "PREPARE_S_PER_MB", "RACE_ROUNDS", "RACE_SHAPES", "Decision", "RaceRecord", "agrees", "bf16_on_openvino",
           "candidates", "decide", "onnx_unsupported", "pays_back", "preparation_seconds", "prior_gain", "race_line",
           "runtime_choice", "versions", "winner"]
