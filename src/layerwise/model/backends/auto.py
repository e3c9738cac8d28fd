"""``backend="auto"`` (the default): the fastest runtime that gives the exact states on this machine.

For the block site of a family-table encoder in float32 on the CPU there are up to three candidates: ONNX Runtime
(:mod:`layerwise.model.backends.ort`, a core dependency), OpenVINO (:mod:`layerwise.model.backends.openvino`, where
the ``[openvino]`` extra is installed) and PyTorch. Which one is faster depends on the CPU: OpenVINO, then ONNX
Runtime, on the AMD EPYC development machines; PyTorch and OpenVINO within 1% of each other on an Intel Xeon with
AMX (``benchmarks/README.md``). So each compiled runtime runs the same probe batch as PyTorch and must agree within
1e-5 (relative to the states' scale, the project's tolerance for "the same states"); then, once per model, the exact
ones and PyTorch are timed on the batches of ``RACE_SHAPES`` (one token budget, the shapes length-sorted batches take)
started as the pipeline starts them (an asynchronous runtime overlapping them; alternating, best of ``RACE_ROUNDS``),
at the first depth asked for, and the fastest serves every depth where it is exact. One repeated shape would favour a
runtime that caches per shape (PyTorch bf16 won a 16x64 race by 15% on an AMX Xeon and then ran SST-2 30% slower
than OpenVINO's bf16).

None of that is on the caller's path: until a depth is decided, PyTorch serves it, and a background thread exports,
checks and races (:meth:`AutoBackend.serving`); the winner takes over from the next batch, and a ``layerwise:`` line
says so. When PyTorch wins, no later depth is exported at all. The thread starts once the caller is idle for
``QUIET_S`` or has kept PyTorch busy for ``GRACE_S``, so a script's one short call is neither slowed by it nor kept
waiting for it at exit (at exit it stops after the step it is in). :meth:`AutoBackend.settle` waits for the background
work (servers warming depths, benchmarks, tests).

The race's result is kept on disk (``races.json`` beside the exported graphs), keyed by the CPU model, the thread
count, the weights' fingerprint and the runtimes' versions, so a later process on the same machine skips the timing
(the exactness check still runs: it is one small batch). ``$LAYERWISE_AUTO_RUNTIME`` changes the choice among exact
runtimes: ``fastest`` (the default), ``onnx``, ``openvino`` (that runtime, prepared on the caller's path, since it was
asked for) or ``torch`` (no timing). Every other site, device, dtype, padding side or architecture runs on PyTorch.
:meth:`AutoBackend.runtime` says which ran, and why.

``compute_dtype="bfloat16"`` on the CPU races PyTorch bf16 against OpenVINO's bf16 hint the same way (where the
extra is installed), the two agreeing when every token's states have a cosine of at least ``BF16_AGREE``.

``quantize="int8"`` (block site only) runs OpenVINO with int8 weights (NNCF) where the ``[openvino]`` extra is
installed, which keeps the layers (last-layer minimum cosine 0.995 on SST-2 dev), else ONNX Runtime's dynamic int8
(0.966); the two are different precisions of a store (``int8-weights``, ``int8``). ``quantize="int8-full"`` (weights
and activations, calibrated) runs on OpenVINO only; without the extra it is refused, naming it. A model they cannot
run is refused with the reason. Reduced precision is never chosen by this backend: it is an explicit option.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ...errors import ModelLoadError
from ...extras import require
from ...notices import notice
from ..capture import capture
from ..discovery import probe_batch
from ..hardware import cpu_model, native_on_cpu
from ..loaded import LoadedModel
from ..options import ModelOptions
from . import offload
from .base import Backend
from .offload import Stopped
from .openvino import OpenVinoBackend, openvino_available, openvino_version
from .ort import OnnxBackend, check_quantize, ort_available
from .pytorch import TorchBackend
from .stages import Staged

log = logging.getLogger("layerwise")

EXACT = 1e-5  # max abs difference to PyTorch, relative to max(1, largest state): "the same states"
BF16_AGREE = 0.999  # min per-token cosine of two bf16 runtimes' states: the same up to bf16 rounding
RACE_SHAPES = ((64, 16), (32, 32), (16, 64), (8, 128))  # (texts, tokens) of the batches timed: 1,024 tokens each
RACE_ROUNDS = 3
QUIET_S = 0.25  # the background preparation starts once the caller has made no call for this long...
GRACE_S = 3.0  # ...or once the caller has kept PyTorch busy this long (a long job gains from the compiled runtime)
HOLD_S = 10.0  # the longest the caller waits for a timing run alone, and for its own passes to end before one
CHOICES = ("fastest", "onnx", "openvino", "torch")
LABELS = {"torch": "PyTorch", "onnx": "ONNX Runtime", "openvino": "OpenVINO"}
_PREPARING: "weakref.WeakSet[AutoBackend]" = weakref.WeakSet()  # backends whose background thread may be running


@atexit.register
def _stop_preparing() -> None:
    """At exit, stop every background preparation after the step it is in (an export, a conversion, a check), and
    wait for that step: a thread left inside a runtime's native code while the interpreter tears the runtimes down
    aborts the process. What it finished is in the cache for the next process."""
    for backend in list(_PREPARING):
        backend.stop()


def runtime_choice() -> str:
    """``$LAYERWISE_AUTO_RUNTIME`` (default ``fastest``): how ``auto`` picks among the runtimes that are exact."""
    choice = os.environ.get("LAYERWISE_AUTO_RUNTIME", "fastest").strip().lower() or "fastest"
    if choice not in CHOICES:
        raise ModelLoadError(f"LAYERWISE_AUTO_RUNTIME={choice!r} is not a choice. Valid values are: "
                             f"{', '.join(CHOICES)} (fastest: time the exact runtimes once per depth and machine; "
                             f"onnx/openvino/torch: always that one where it is exact)")
    return choice


class RaceRecord:
    """Races already run on this machine: ``races.json`` in ``directory``, one entry per key (see
    :meth:`key`); read on each lookup and rewritten atomically (merged with what another process wrote)."""

    def __init__(self, directory: Path):
        self.path = Path(directory) / "races.json"

    @staticmethod
    def key(fingerprint: str, threads: int, runtimes: Sequence[str]) -> str:
        """A digest of what decides a race: CPU model, threads, weights, the runtimes and their versions (not the
        depth: a model races once, at the first depth it is asked for)."""
        import onnxruntime

        versions = {"torch": torch.__version__, "onnx": onnxruntime.__version__, "openvino": openvino_version()}
        parts = {"cpu": cpu_model(), "threads": threads, "weights": fingerprint,
                 "shapes": [list(shape) for shape in RACE_SHAPES],
                 "runtimes": {r: versions[r] for r in sorted(runtimes)}}
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

    def put(self, key: str, times: dict[str, float]) -> None:
        """Record a race (a cache: a directory that cannot be written is skipped, the next process races again)."""
        data = {**self.read(), key: times}
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)


class AutoBackend(TorchBackend):
    """The fastest exact runtime per depth (ONNX Runtime, OpenVINO or PyTorch) for the block site, PyTorch
    elsewhere (all sites, early exit).

    Args:
        loaded: the model.
        padding_side: as for :class:`~layerwise.model.backends.pytorch.TorchBackend` (``"left"`` runs PyTorch).
        cache: directory for exported graphs and ``races.json`` (see :func:`layerwise.model.backends.ort.cache_dir`).
        quantize: ``None``, ``"int8"`` (int8 weights on OpenVINO where installed, else dynamic int8 through ONNX
            Runtime) or ``"int8-full"`` (OpenVINO only); block site only.
        calibration: ``quantize="int8-full"``: a text file to calibrate on (``None``: the bundled sample).
    """

    name = "auto"
    accepts = TorchBackend.accepts | {"quantize", "quantize_calibration", "onnx_cache"}

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "AutoBackend":
        """``AutoBackend(loaded, padding_side, cache=options.onnx_cache, quantize=options.quantize,
        calibration=options.quantize_calibration)``."""
        return cls(loaded, options.padding_side, cache=options.onnx_cache, quantize=options.quantize,
                   calibration=options.quantize_calibration)

    def __init__(self, loaded: LoadedModel, padding_side: str = "right", cache: str | os.PathLike | None = None,
                 quantize: str | None = None, calibration: str | None = None):
        super().__init__(loaded, padding_side)
        self.quantize = check_quantize(quantize)
        self.why_torch = self.onnx_unsupported(loaded, padding_side)
        self.onnx: OnnxBackend | None = None
        self.openvino: OpenVinoBackend | None = None
        full = self.quantize == "int8-full"
        if full:
            require("openvino", "nncf", what="quantize='int8-full' (int8 weights and activations, on OpenVINO)",
                    extra="openvino", packages="openvino, nncf")
        if self.why_torch is None:
            self.onnx = OnnxBackend(loaded, cache=cache, quantize=None if full else self.quantize)
            if openvino_available() and (not self.quantize or openvino_version("nncf")):
                self.openvino = OpenVinoBackend(loaded, exporter=self.onnx, quantize=self.quantize,
                                                calibration=calibration)
        elif self.quantize:
            raise ModelLoadError(f"quantize={self.quantize!r} runs through OpenVINO or ONNX Runtime, which "
                                 f"{self.why_torch}")
        elif self.bf16_on_openvino(loaded, padding_side):
            self.openvino = OpenVinoBackend(loaded, precision="bfloat16", cache=cache)
        first = self.onnx or self.openvino
        self.races = RaceRecord(first.root) if first is not None else None
        self._exact: dict[tuple[str, int], bool] = {}  # (runtime, depth) -> agreed with PyTorch on the probe batch
        self._serving: dict[int, str] = {}  # depth -> the runtime that serves it
        self._why: dict[int, str] = {}  # depth -> why that runtime serves it
        self._winner: tuple[str, str] | None = None  # the race's winner (once per model) and what it measured
        self._race_times: dict[str, float] | None = None  # seconds a batch on the race's batches, per runtime
        self._decided = threading.Condition()  # guards _serving/_why/_preparing; notified as each depth is decided
        self._preparing: list[int] = []  # depths waiting for (or in) the background preparation, in order
        # depths whose rows of mixed depths were asked for (ragged_price), and those of them whose one-layer graphs
        # (OpenVINO's or ONNX Runtime's) wait for (or are in) the background preparation: the chain is built only
        # where it is asked for
        self._ragged_asked: set[int] = set()
        self._staging: list[int] = []
        self._worker: threading.Thread | None = None
        self.prepared: dict[int, float] = {}  # depth -> seconds its background preparation took
        self._stopping = threading.Event()
        self._deciding = threading.Lock()  # one decision at a time
        self._last_call = 0.0  # time.monotonic() when the caller's last forward pass through auto ended
        self._busy = 0  # the caller's forward passes running now
        self._free = threading.Event()  # cleared while the preparation times a runtime alone (_alone)
        self._free.set()
        self._int8_thread: threading.Thread | None = None
        self.int8_timing: dict[str, Any] | None = None  # quantized: the int8 runtimes timed against float32, once

    def fingerprint(self) -> str:
        """The weights' sha256 (computed once, shared with the exporter)."""
        first = self.onnx or self.openvino
        return first.fingerprint() if first is not None else super().fingerprint()

    @staticmethod
    def bf16_on_openvino(loaded: LoadedModel, padding_side: str = "right") -> bool:
        """Whether a bf16-loaded model can also run on OpenVINO's bf16 hint: installed, a CPU with native bf16
        (OpenVINO runs float32 where the CPU has none), a family-table encoder, right padding. Then PyTorch bf16 and
        OpenVINO bf16 race like the float32 runtimes."""
        return (loaded.dtype == torch.bfloat16 and padding_side == "right" and native_on_cpu(torch.bfloat16)
                and openvino_available() and OpenVinoBackend.unsupported(loaded) is None)

    @property
    def fidelity(self) -> dict[int, dict]:
        """The measured fidelity to float32 per depth of the reduced-precision runtime serving it (quantised or
        bf16 OpenVINO of a float32 model; see :mod:`layerwise.model.fidelity`)."""
        out: dict[int, dict] = {}
        for runtime in self.compiled_runtimes.values():
            out.update(getattr(runtime, "fidelity", {}))
        return out

    @property
    def compiled_runtimes(self) -> dict[str, Backend]:
        """The runtimes other than PyTorch that can serve the block site here: ``{"onnx": ..., "openvino": ...}``."""
        return {name: rt for name, rt in (("onnx", self.onnx), ("openvino", self.openvino)) if rt is not None}

    def torch_only(self, reason: str) -> None:
        """Run PyTorch from now on (e.g. the weights are about to change: an exported graph would be stale).

        Raises:
            ModelLoadError: when quantised (int8 exists only in the compiled runtimes).
        """
        if self.quantize:
            raise ModelLoadError(f"quantize={self.quantize!r} runs on OpenVINO or ONNX Runtime only; it cannot "
                                 f"switch to PyTorch ({reason})")
        with self._decided:
            self.onnx, self.openvino, self.why_torch = None, None, f"is off: {reason}"
            self._exact.clear()
            self._serving.clear()
            self._why.clear()
            self._preparing.clear()
            self._winner = None
            self._decided.notify_all()

    @staticmethod
    def onnx_unsupported(loaded: LoadedModel, padding_side: str = "right") -> str | None:
        """Why the compiled runtimes cannot serve ``loaded`` (a phrase), or ``None`` when they can."""
        if not ort_available():
            return "is not installed (pip install onnxruntime onnx)"
        if padding_side != "right":
            return f"pads on the right, not {padding_side!r}"
        return OnnxBackend.unsupported(loaded)

    @property
    def model_sites(self) -> tuple[str, ...]:
        """Every site PyTorch records; only ``block`` when quantised."""
        return ("block",) if self.quantize else super().model_sites

    @property
    def precision(self) -> str:
        """When quantised, the recipe's (``"int8-weights"`` on OpenVINO, ``"int8"`` on ONNX Runtime), else the
        dtype."""
        quantized = self.openvino or self.onnx
        return quantized.precision if self.quantize and quantized is not None else super().precision

    def exact(self, depth: int, runtime: str = "onnx") -> bool:
        """Whether ``runtime`` gives PyTorch's states for layers ``0..depth`` (checked once per runtime and depth):
        within :data:`EXACT` in float32; in bf16, a cosine of at least :data:`BF16_AGREE` for every token."""
        backend = self.compiled_runtimes.get(runtime)
        if backend is None:
            return False
        if (runtime, depth) not in self._exact:
            ids, mask = probe_batch(self.loaded.tokenizer)
            layers = list(range(depth + 1))
            want = capture(self.loaded, ids, mask, layers)  # Shape: (layers, 2, tokens, hidden)
            got = backend.forward(ids, mask, layers, "block")
            keep = mask.bool()
            if self.loaded.dtype == torch.float32:
                scale = max(1.0, float(want[:, keep].abs().max()))
                agree = float((got[:, keep] - want[:, keep]).abs().max()) <= EXACT * scale
            else:  # both approximate (bf16): the same states up to bf16's rounding, token by token
                cos = torch.nn.functional.cosine_similarity(got[:, keep].float(), want[:, keep].float(), dim=-1)
                agree = float(cos.min()) >= BF16_AGREE
            self._exact[runtime, depth] = agree
        return self._exact[runtime, depth]

    def race(self, depth: int, runtimes: Sequence[str] = ("onnx", "openvino")) -> dict[str, float]:
        """Seconds per batch (best of ``RACE_ROUNDS``, alternating) of PyTorch and each of ``runtimes`` that is
        available, on one batch of each of ``RACE_SHAPES`` through layers ``0..depth``, started the way the pipeline
        starts them (:meth:`Backend.start`, up to :meth:`Backend.ahead` at once, so an asynchronous runtime is timed
        with its overlap), after one warm-up run each: ``{"torch": s, "onnx": s, ...}``."""
        contestants: dict[str, Backend] = {"torch": self}
        contestants.update({n: b for n, b in self.compiled_runtimes.items() if n in runtimes})
        return self.timed(depth, contestants)

    def timed(self, depth: int, contestants: dict[str, Backend]) -> dict[str, float]:
        """Seconds per batch of each of ``contestants`` (``self`` runs as PyTorch) through layers ``0..depth`` on
        :data:`RACE_SHAPES`' batches, as :meth:`race` times them."""
        vocab = int(getattr(self.loaded.model.config, "vocab_size", 1000))
        seeded = torch.Generator().manual_seed(0)
        longest = self.loaded.max_length  # a model with fewer positions gets the same budget in shorter rows
        shapes = [(n * t // min(t, longest), min(t, longest)) for n, t in RACE_SHAPES]
        batches = [torch.randint(min(1000, vocab - 1), vocab, shape, generator=seeded) for shape in shapes]
        layers = list(range(depth + 1))

        def torch_start(*args: Any) -> Callable[[], torch.Tensor]:  # PyTorch runs now (not through auto's dispatch)
            states = TorchBackend.forward(self, *args)
            return lambda: states

        def runs(name: str) -> None:
            backend = contestants[name]
            start = torch_start if backend is self else backend.start
            ahead = 1 if backend is self else max(1, backend.ahead(layers, "block"))
            started: list[Callable[[], torch.Tensor]] = []
            for ids in batches:
                if len(started) >= ahead:
                    started.pop(0)()
                started.append(start(ids, torch.ones_like(ids), layers, "block"))
            for done in started:
                done()

        best = {name: float("inf") for name in contestants}
        for name in contestants:
            runs(name)  # warm-up: first-call allocations
        for _ in range(RACE_ROUNDS):
            for name in contestants:
                t0 = time.perf_counter()
                runs(name)
                best[name] = min(best[name], (time.perf_counter() - t0) / len(batches))
        return best

    def timed_race(self, depth: int, runtimes: Sequence[str]) -> tuple[dict[str, float], bool]:
        """The race of ``runtimes`` and PyTorch at ``depth``: from ``races.json`` when this machine ran it before
        (``True``), else run now and recorded (``False``)."""
        key = RaceRecord.key(self.fingerprint(), torch.get_num_threads(), ["torch", *runtimes])
        known = self.races.get(key) if self.races is not None else None
        if known is not None and set(known) == {"torch", *runtimes}:
            return known, True
        times = self.race(depth, runtimes)
        if self.races is not None:
            self.races.put(key, times)
        return times, False

    def serving(self, depth: int) -> str:
        """The runtime that serves layers ``0..depth`` of the block site now (``"onnx"``, ``"openvino"`` or
        ``"torch"``): exact, and chosen by ``$LAYERWISE_AUTO_RUNTIME``.

        ``fastest`` (the default) never makes the caller wait: until a depth is decided, PyTorch serves it, while a
        background thread exports, checks and (once per model) races the compiled runtimes; the winner takes over
        from the next batch on (one ``layerwise:`` line says so). ``onnx``/``openvino`` name the runtime wanted, so
        it is prepared on the caller's path, as it was asked for."""
        if not self.compiled_runtimes:
            return "torch"
        if self.quantize:
            self._time_int8(depth)
            return "openvino" if self.openvino is not None else "onnx"
        with self._decided:
            if depth in self._serving:
                return self._serving[depth]
        choice = runtime_choice()
        if choice != "fastest":
            with self._deciding:  # a server's request and its warming may both ask first
                if depth not in self._serving:
                    self._decide(depth, choice)
            return self._serving.get(depth, "torch")
        self._prepare(depth)
        return "torch"

    def _prepare(self, depth: int) -> None:
        """Queue ``depth`` for the background thread (started on first use; it ends when the queue is empty)."""
        with self._decided:
            if depth in self._serving or depth in self._preparing:
                return
            self._preparing.append(depth)
            if not self._stopping.is_set():
                self._start_worker()

    def _start_worker(self) -> None:
        """Start the background thread unless it runs (the caller holds ``_decided``); a daemon, stopped at exit
        after its current step (_stop_preparing)."""
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._prepare_all, name="layerwise-auto", daemon=True)
            _PREPARING.add(self)
            self._worker.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background preparation after the step it is in, and wait for it (``timeout`` seconds at most);
        the depths not decided stay on PyTorch."""
        self._stopping.set()
        for worker in (self._worker, self._int8_thread):
            if worker is not None and worker is not threading.current_thread():
                worker.join(timeout)

    def _quiet_moment(self) -> None:
        """Wait until the caller is idle (no call for :data:`QUIET_S`) or has been busy for :data:`GRACE_S`: a short
        job (a script's one call) is never slowed by the preparation, nor kept waiting for it at exit."""
        started = time.monotonic()
        while not self._stopping.is_set():
            now = time.monotonic()
            if (not self._busy and now - self._last_call >= QUIET_S) or now - started >= GRACE_S:
                return
            self._stopping.wait(0.05)

    def _prepare_all(self) -> None:
        with offload.offloaded(self._stopping):  # the export and conversions in a child: the caller keeps the GIL
            self._prepare_queued()

    def _prepare_queued(self) -> None:
        self._quiet_moment()
        while True:
            with self._decided:
                if (not self._preparing and not self._staging) or self._stopping.is_set():
                    self._preparing.clear()
                    self._staging.clear()
                    self._worker = None
                    self._decided.notify_all()
                    return
                staging = not self._preparing  # the depths' runtimes first, then the stages asked for
                depth = self._staging[0] if staging else self._preparing[0]
            if staging:
                self._prepare_stages(depth)
                continue
            t0 = time.perf_counter()
            try:
                with self._deciding:
                    self._decide(depth, "fastest")
            except Stopped:
                continue
            except Exception as exc:  # a runtime that fails to build is not a reason to fail the caller's job
                with self._decided:
                    self._serving.setdefault(depth, "torch")
                    self._why.setdefault(depth, f"preparing the compiled runtimes failed: {type(exc).__name__}: {exc}")
            self.prepared[depth] = time.perf_counter() - t0
            with self._decided:
                if depth in self._preparing:
                    self._preparing.remove(depth)
                self._decided.notify_all()
            use = self._serving.get(depth)
            if use is not None:
                notice(f"{LABELS[use]} serves layers 0..{depth} from now on ({self._why[depth]}; prepared in the "
                       f"background in {self.prepared[depth]:.1f} s while PyTorch served)")
            if depth in self._ragged_asked:  # (only where the runtime that now serves it has stages)
                self._queue_stages(depth)

    def _queue_stages(self, depth: int) -> None:
        """Queue the one-layer graphs up to ``depth`` of the runtime serving it for the background thread (once per
        depth)."""
        staged = self._decided_stages(depth)
        if staged is None or staged.stages.prepared(depth):
            return
        with self._decided:
            if depth in self._staging or self._stopping.is_set():
                return
            self._staging.append(depth)
            self._start_worker()

    def _prepare_stages(self, depth: int) -> None:
        """Build, check and time the one-layer graphs up to ``depth`` of the runtime serving it
        (:meth:`Staged.prepare_ragged <layerwise.model.backends.stages.Staged.prepare_ragged>`); a failure leaves
        mixed depths on PyTorch or in segments, and is logged."""
        staged = self._decided_stages(depth)
        try:
            if staged is not None:  # (a runtime's error there is logged and leaves the depth unstaged)
                staged.prepare_ragged(depth, alone=self._alone)
        except Stopped:
            pass
        with self._decided:
            if depth in self._staging:
                self._staging.remove(depth)
            self._decided.notify_all()

    def _time_int8(self, depth: int) -> None:
        """Once per model: time the int8 runtimes against each other and against float32 in the background (at a
        quiet moment); a ``layerwise:`` line says so when every int8 runtime is slower (see :attr:`int8_timing`)."""
        with self._decided:
            if self._int8_thread is not None or self.quantize == "int8-full" or self._stopping.is_set():
                return
            self._int8_thread = threading.Thread(target=self._int8_race, args=(depth,), name="layerwise-int8",
                                                 daemon=True)
            _PREPARING.add(self)
            self._int8_thread.start()

    def _int8_race(self, depth: int) -> None:
        self._quiet_moment()
        try:
            with offload.offloaded(self._stopping):
                self.int8_timing = self.time_int8(depth)
            said = self.int8_timing.get("said")
            if said:
                notice(said)
        except Stopped:
            pass
        except Exception as exc:  # the timing is advice: it never fails the caller's job
            self.int8_timing = {"error": f"{type(exc).__name__}: {exc}"}

    def time_int8(self, depth: int) -> dict[str, Any]:
        """Seconds per batch through layers ``0..depth`` of the int8 runtimes available (OpenVINO int8 weights, ONNX
        Runtime dynamic int8) and of float32 (PyTorch, and ONNX Runtime exact), timed as :meth:`race` times; with
        ``"slower"``: whether every int8 runtime is slower than the fastest float32 one, and then ``"said"``: the line
        that says so, naming the faster exact path."""
        from .ort import OnnxBackend

        cache = (self.openvino or self.onnx).root  # type: ignore[union-attr]
        contestants: dict[str, Backend] = {}
        if self.openvino is not None:
            contestants["int8 OpenVINO"] = self.openvino
        contestants["int8 ONNX Runtime"] = self.onnx if self.onnx is not None and self.onnx.quantize else \
            OnnxBackend(self.loaded, cache=cache, quantize="int8")
        contestants["float32 PyTorch"] = self
        contestants["float32 ONNX Runtime"] = OnnxBackend(self.loaded, cache=cache)
        for backend in contestants.values():  # built (or read from the cache) one by one, stopping at exit
            if self._stopping.is_set():
                raise Stopped
            if backend is not self:
                backend.warm(list(range(depth + 1)))
        times = self.timed(depth, contestants)
        int8 = {n: t for n, t in times.items() if n.startswith("int8")}
        exact = {n: t for n, t in times.items() if n.startswith("float32")}
        fastest = min(exact, key=lambda n: exact[n])
        slower = min(int8.values()) > exact[fastest]
        out: dict[str, Any] = {"depth": depth, "ms_per_batch": {n: round(t * 1e3, 2) for n, t in times.items()},
                               "slower": slower}
        if slower:
            listed = ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in int8.items())
            out["said"] = (f"quantize={self.quantize!r} is slower than float32 on this CPU ({cpu_model()}): {listed} "
                           f"against {fastest} {exact[fastest] * 1e3:.1f} ms a batch; drop quantize for the faster, "
                           f"exact path (backend='auto' serves float32 with the fastest runtime here)")
        return out

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until every depth queued for background preparation is decided (``timeout`` seconds at most);
        ``True`` when none is left. For servers that warm depths before they report ready, benchmarks and tests."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._decided:
            while self._preparing or self._staging:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._decided.wait(left)
        if self._int8_thread is not None:
            self._int8_thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            return not self._int8_thread.is_alive()
        return True

    def pending(self) -> list[int]:
        """The depths being prepared in the background (PyTorch serves them meanwhile), and those whose one-layer
        graphs are (their rows of mixed depths run on PyTorch or in segments meanwhile)."""
        with self._decided:
            return list(dict.fromkeys([*self._preparing, *self._staging]))

    def warm(self, layers: Sequence[int], site: str = "block") -> None:
        """Load the blocks ``layers`` need and decide their runtime: under ``fastest`` the background preparation
        starts (:meth:`pending` lists it until done); a runtime named by ``$LAYERWISE_AUTO_RUNTIME`` is prepared
        now."""
        TorchBackend.warm(self, layers, site)
        self.runtime_for(layers, site)

    def _step(self) -> bool:
        """Between two steps of the preparation: ``True``, or :class:`Stopped` when the process is exiting."""
        if self._stopping.is_set() and threading.current_thread() is self._worker:
            raise Stopped
        return True

    def _decide(self, depth: int, choice: str) -> None:
        """Decide which runtime serves layers ``0..depth`` (building and checking the compiled ones) and record it.
        Under ``fastest`` the exact runtimes race once per model: later depths take the winner where it is exact."""
        candidates = list(self.compiled_runtimes)
        if choice != "fastest":
            candidates = [c for c in candidates if c == choice]
        winner = self._winner
        if choice == "fastest" and winner is not None and winner[0] == "torch":
            use, why = "torch", winner[1]  # PyTorch won the race: no graph to export for this depth
            exact: list[str] = []
        else:
            if choice == "fastest" and winner is not None:
                candidates = [c for c in candidates if c == winner[0]]  # only the winner is built for a new depth
            exact = [c for c in candidates if self._step() and self.exact(depth, c)]
            inexact = ", ".join(LABELS[c] for c in candidates if c not in exact)
            if choice == "torch":
                use, why = "torch", "LAYERWISE_AUTO_RUNTIME=torch"
            elif not exact:
                missing = "" if candidates else f" ({LABELS.get(choice, choice)} is not installed)"
                within = f"within {EXACT} of" if self.loaded.dtype == torch.float32 else \
                    f"at a cosine of {BF16_AGREE} to"
                use, why = "torch", f"{inexact or 'no other runtime'} not {within} PyTorch there{missing}"
            elif choice != "fastest":
                use, why = choice, f"exact; LAYERWISE_AUTO_RUNTIME={choice}"
            elif winner is not None:
                use, why = winner[0], f"exact; {winner[1]}"
            else:
                self._step()
                times, known = self.timed_race(depth, exact)
                self._race_times = times
                use = min(times, key=lambda name: times[name])
                shapes = ", ".join("x".join(map(str, shape)) for shape in RACE_SHAPES)
                others = ", ".join(f"{LABELS[n]}'s {s * 1e3:.1f} ms" for n, s in times.items() if n != use)
                raced = (f"{'fastest' if use != 'torch' else 'PyTorch fastest'} here: {times[use] * 1e3:.1f} ms vs "
                         f"{others} a batch on batches of {shapes} started ahead, raced at depth {depth} once for "
                         f"the model" + (" (timed earlier on this machine)" if known else ""))
                self._winner = (use, raced)
                why = f"exact; {raced}" + (f"; {inexact} not exact there" if inexact else "")
        with self._decided:
            if self.compiled_runtimes or use == "torch":  # torch_only() may have switched them off meanwhile
                self._serving[depth], self._why[depth] = use, why

    def runtime_for(self, layers: Sequence[int], site: str) -> str:
        """Which runtime runs a forward pass for ``layers`` at ``site``: ``"onnx"``, ``"openvino"`` or ``"torch"``
        (always PyTorch for layers streamed block by block under ``max_memory``: an export needs every block)."""
        self._last_call = time.monotonic()  # the caller is at work (the preparation waits for a quiet moment)
        if not self.compiled_runtimes or site != "block" or self.loaded.streams(max(layers)):
            return "torch"
        return self.serving(max(max(layers), 1))

    def runtime(self) -> str:
        """Which runtime serves what so far, and why: e.g. ``"openvino 2026.4.1 for the block site at depths [6]
        (exact; fastest here: ...); torch for other sites"``."""
        if not self.compiled_runtimes:
            return f"torch (ONNX Runtime {self.why_torch})"
        import onnxruntime

        bf16 = " bf16" if self.loaded.dtype == torch.bfloat16 else ""
        versions = {"onnx": f"onnxruntime {onnxruntime.__version__}", "torch": f"torch{bf16}",
                    "openvino": f"openvino {openvino_version()}{bf16}"}
        if self.quantize:
            if self.openvino is not None:
                what = "int8 weights and activations" if self.quantize == "int8-full" else "int8 weights"
                return f"{versions['openvino']} with {what} (nncf {openvino_version('nncf')}) for the block site"
            return f"{versions['onnx']} ({self.quantize}, dynamic) for the block site"
        parts = []
        with self._decided:  # the background thread may be deciding a depth
            serving, why = dict(self._serving), dict(self._why)
        for name in ("openvino", "onnx", "torch"):
            depths = sorted(d for d, use in serving.items() if use == name)
            for d in depths:
                parts.append(f"{versions[name]} {'for the block site ' if name != 'torch' else ''}at depths [{d}] "
                             f"({why[d]})")
        with self._decided:
            preparing = list(self._preparing)
        for d in preparing:
            parts.append(f"torch at depths [{d}] (while the compiled runtimes are prepared in the background)")
        candidates = " or ".join(versions[n] for n in (*self.compiled_runtimes, "torch"))
        return "; ".join(parts or [f"{candidates} for the block site (decided at first use of each depth)"]) \
            + "; torch for other sites"

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start` on the runtime :meth:`runtime_for` picks (OpenVINO's returns at once)."""
        with self._calling():
            backend = self.compiled_runtimes.get(self.runtime_for(layers, site))
            if backend is not None:
                return backend.start(input_ids, attention_mask, layers, site)
            return super().start(input_ids, attention_mask, layers, site)

    def staged(self, depth: int, site: str = "block") -> Staged | None:
        """The compiled runtime that serves ``depth`` at ``site`` where it can run one-layer stages
        (:mod:`~layerwise.model.backends.stages`), else ``None`` (PyTorch serves, or a quantised graph)."""
        return self._staged_on(self.runtime_for((depth,), site))

    def _decided_stages(self, depth: int) -> Staged | None:
        """:meth:`staged` for a depth already decided, without counting as a call of the caller's (the background
        thread asks it)."""
        with self._decided:
            use = self._serving.get(depth, "torch")
        return self._staged_on(use)

    def _staged_on(self, runtime: str) -> Staged | None:
        backend = self.compiled_runtimes.get(runtime)
        return backend if isinstance(backend, Staged) and not self.quantize else None

    def ragged_price(self, depth: int, site: str) -> float | None:
        """:meth:`Backend.ragged_price`. Where a compiled runtime serves ``depth`` and its one-layer graphs are
        prepared: their measured price (:mod:`~layerwise.model.backends.stages`); the first ask queues their
        preparation in the background. Otherwise rows leave a batch early on PyTorch: where PyTorch serves ``depth``,
        ``1.0``; where a compiled runtime won the race, PyTorch's time over the winner's on the race's batches (a
        token-layer on PyTorch costs that much more); where a runtime was named by ``$LAYERWISE_AUTO_RUNTIME`` (no
        race): ``None``."""
        self._ragged_asked.add(depth)
        serving = self.runtime_for((depth,), site)
        staged = self._staged_on(serving)
        if staged is not None:
            price = staged.ragged_price(depth, site)
            if price is not None:
                return price
            self._queue_stages(depth)
        if not self.can_leave_early(depth, site):
            return None
        if serving == "torch":
            return 1.0
        times = self._race_times or {}
        if times.get(serving, 0.0) <= 0.0 or "torch" not in times:
            return None
        return times["torch"] / times[serving]

    def start_ragged(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str,
        depths: Sequence[int],
    ) -> Callable[[], torch.Tensor]:
        """:meth:`Backend.start_ragged` on the one-layer graphs of the compiled runtime that serves ``max(layers)``
        where they are prepared, else on PyTorch (the caller weighed :meth:`ragged_price`)."""
        with self._calling():
            staged = self.staged(max(layers), site)
            if staged is not None and staged.ragged_price(max(layers), site) is not None:
                return staged.start_ragged(input_ids, attention_mask, layers, site, depths)
            return super().start_ragged(input_ids, attention_mask, layers, site, depths)

    @contextlib.contextmanager
    def _calling(self) -> Iterator[None]:
        """A forward pass of the caller's (the background preparation waits for a quiet moment; the caller waits
        while the preparation times a runtime alone)."""
        self._free.wait(HOLD_S)
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
            self._last_call = time.monotonic()

    @contextlib.contextmanager
    def _alone(self) -> Iterator[None]:
        """The background preparation times a runtime with the machine to itself: the caller's next forward pass
        waits (at most :data:`HOLD_S`), and the passes it is in are let finish first (at most :data:`HOLD_S`)."""
        self._free.clear()
        try:
            deadline = time.monotonic() + HOLD_S
            while self._busy and time.monotonic() < deadline and not self._stopping.is_set():
                time.sleep(0.005)
            yield
        finally:
            self._free.set()

    def ahead(self, layers: Sequence[int], site: str) -> int:
        """The :meth:`Backend.ahead` of the runtime that serves ``layers`` at ``site``."""
        backend = self.compiled_runtimes.get(self.runtime_for(layers, site))
        return backend.ahead(layers, site) if backend is not None else super().ahead(layers, site)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, width]`` (see :meth:`Backend.forward`) from the runtime :meth:`runtime_for` picks."""
        with self._calling():
            backend = self.compiled_runtimes.get(self.runtime_for(layers, site))
            if backend is not None:
                return backend.forward(input_ids, attention_mask, layers, site)
            return super().forward(input_ids, attention_mask, layers, site)


__all__ = ["BF16_AGREE", "CHOICES", "EXACT", "RACE_ROUNDS", "RACE_SHAPES", "AutoBackend", "RaceRecord",
           "runtime_choice"]
