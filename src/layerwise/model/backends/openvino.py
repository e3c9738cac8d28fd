"""The OpenVINO backend: the encoder converted once per (weights, deepest layer, precision), run on the CPU with the
throughput hint and a queue of asynchronous infer requests that keeps every stream busy.

``Extractor(..., backend="openvino")`` runs the same pipeline (tokenise, windows, token-budget batches, combine,
pool) with the forward pass executed by OpenVINO; ``backend="auto"`` (see :mod:`layerwise.model.backends.auto`)
times it against ONNX Runtime and PyTorch where it is installed and exact. The graph is the ONNX export of
:mod:`layerwise.model.backends.ort` (the encoder cut after the deepest requested layer, ``hidden_0 .. hidden_d`` as
outputs), compiled by OpenVINO straight from that ONNX graph (no IR copy of the weights is written) and cached as
a compiled blob under the same cache directory, keyed by the graph (the weights' sha256, the family, the depth), the
compile settings, the CPU and the OpenVINO version. A quantised graph (``quantize=``) is first saved as OpenVINO's IR
(its weights in int8), and compiled from it. Every file goes through :meth:`GraphCache.put
<layerwise.model.backends.cache.GraphCache.put>` (written once across processes, the cache trimmed after each write,
blobs included), and a compiled model holds a lease on its blob while it is open.

Precision is explicit: OpenVINO runs float32 by default on a CPU with native bf16 (AVX-512 BF16, AMX) in bfloat16
unless told otherwise, which would be a silent loss. This backend always sets ``INFERENCE_PRECISION_HINT``: ``f32``
for ``compute_dtype="float32"`` (the default; the states equal PyTorch's within 1e-5), ``bf16`` for
``compute_dtype="bfloat16"`` (weights stored in float32, the matrix products in bf16). On a CPU without bf16
(none of ``avx512_bf16``, ``amx_bf16``) OpenVINO ignores the bf16 hint, so the backend says so (a ``PrecisionWarning``),
runs and records ``float32``; a compiled precision other than the hint is refused, never recorded.

``quantize="int8"`` keeps the layers: the weights of every matrix product are compressed to int8 by NNCF
(asymmetric, per output channel; installed with the extra), the rest of the graph stays float32, and OpenVINO's CPU
plugin quantises the activations of those products on the fly in groups of ``DYNAMIC_QUANTIZATION_GROUP`` values (set
explicitly). On SST-2 dev sentences with the default model it kept a last-layer minimum cosine of 0.995 to float32
(``benchmarks/README.md``), where ONNX Runtime's dynamic int8 (``backend="onnx"``) keeps 0.966. Its precision is
``"int8-weights"``, so a store never mixes the two recipes. ``quantize="int8-full"`` quantises activations too
(calibrated on texts, the products measured as most sensitive kept in float; precision ``"int8-full"``): see
:mod:`layerwise.model.backends.openvino_int8` for both recipes.

Memory: OpenVINO's CPU plugin keeps the kernels it prepared for each input shape; at its default (5,000 per kind and
stream) a server fed every batch size and length grows without a ceiling, so the cache is capped at
:data:`SHAPE_CACHE` (``CPU_RUNTIME_CACHE_CAPACITY``), which bounds it at no measured cost in speed.

Speed: the model is compiled with ``PERFORMANCE_HINT=THROUGHPUT`` (OpenVINO picks the number of streams for the
cores it is given), and one padded batch is cut by rows into as many parts as there are streams, each run as an
asynchronous infer request; the requested states are copied once, straight into the result ``[K, batch, tokens,
width]``. The compiled blob is what a second process imports, so it skips the compilation.

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor(backend="openvino")                                      # doctest: +SKIP
    >>> ex.encode(["I love Paris"], layers=-1).shape                               # doctest: +SKIP
    (1, 384)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ...errors import ModelLoadError
from ...extras import require
from ...notices import notice
from ..hardware import FAST_ON_CPU, PrecisionWarning, cpu_model, native_on_cpu
from ..loaded import LoadedModel
from ..loading import load_model
from ..options import ModelOptions
from . import offload
from .base import LOADING_FIELDS, Backend, covering, refuse_options
from .cache import GraphCache, Leases
from .openvino_int8 import calibration_texts, compress_weights, quantize_full, texts_digest
from .openvino_stages import OpenVinoStages
from .ort import ATTEMPTS, BUILD_LOCK, OnnxBackend, check_quantize, measure_fidelity, weights_bytes
from .stages import Staged

IR_FORMAT = 2  # bump when the converted or compiled graph changes (2: float32 compiled from the ONNX graph, no IR)
DYNAMIC_QUANTIZATION_GROUP = 128  # activations of int8-weight products quantised per 128 values (32: 0.9975, 1.8x)
PRECISION_HINTS = {"float32": "f32", "bfloat16": "bf16"}  # compute_dtype -> INFERENCE_PRECISION_HINT
PRECISIONS = {"int8": "int8-weights", "int8-full": "int8-full"}  # quantize -> the precision a store records
RUNS_FROM = (torch.float32, torch.bfloat16)  # the dtypes of a loaded model it converts (auto's bf16 loads bf16)
# kernels kept per input shape (CPU_RUNTIME_CACHE_CAPACITY; OpenVINO's default 5000): at the default a server fed
# random batch sizes and lengths grew ~20 MB/s (1.0 -> 1.8 GB in 50 s, 2-core EPYC, 2026-11-28); at 64 it stayed
# at 1.07 GB, as fast on repeated and on varied shapes (1.45 vs 1.49 s, 1.24 vs 1.27 s); 0 cost 19% on varied
SHAPE_CACHE = 64


def require_openvino() -> Any:
    """The ``openvino`` module; :class:`~layerwise.MissingExtraError` naming the ``[openvino]`` extra."""
    return require("openvino", what="the OpenVINO backend", extra="openvino", packages="openvino")


def openvino_available() -> bool:
    """Whether OpenVINO can be imported (the ``[openvino]`` extra)."""
    import importlib.util

    return importlib.util.find_spec("openvino") is not None


def openvino_version(package: str = "openvino") -> str:
    """The installed version of ``package`` (``"2026.4.1"``), or ``""`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return ""


def check_precision(compute_dtype: object) -> str:
    """The compute dtype OpenVINO runs: ``float32`` or ``bfloat16``; any other is refused, listing these."""
    name = str(compute_dtype or "float32").replace("torch.", "")
    if name not in PRECISION_HINTS:
        raise ModelLoadError(f"backend='openvino' runs compute_dtype {name!r}, which it does not offer. Valid values "
                             f"are: {', '.join(PRECISION_HINTS)} (float16: use backend='torch' on CUDA)")
    return name


class OpenVinoBackend(Staged, Backend):
    """OpenVINO on the CPU, block site only; one converted graph per deepest requested layer. Its infer requests are
    shared: a batch is started, read or run whole under one lock, so a background thread (a fidelity check, a race)
    and a caller never start a request another is reading.

    Args:
        loaded: the model in float32 (converted from its PyTorch weights; a BERT-style encoder of the family table).
        precision: ``"float32"`` (exact) or ``"bfloat16"`` (OpenVINO's bf16 inference hint).
        cache: directory for exported and converted graphs (default ``~/.cache/layerwise/onnx``, see
            :func:`~layerwise.model.backends.ort.cache_dir`).
        threads: the CPU threads OpenVINO uses (default: torch's thread count).
        quantize: ``None``, ``"int8"`` (int8 weights by NNCF) or ``"int8-full"`` (weights and activations, calibrated;
            see :mod:`layerwise.model.backends.openvino_int8`).
        exporter: the ONNX backend whose export (and weights fingerprint) to convert from; one is made when absent.
        calibration: ``quantize="int8-full"`` only: a text file (one text a line) to calibrate on; ``None``: the
            bundled neutral sample.
    """

    name = "openvino"
    sites = ("block",)
    accepts = frozenset((*LOADING_FIELDS, "quantize", "quantize_calibration", "onnx_cache"))
    runs = "runs OpenVINO"

    @classmethod
    def load(cls, options: ModelOptions) -> "OpenVinoBackend":
        """Load the model in float32 (the graph is converted from float32 weights) and run it in
        ``options.compute_dtype`` through OpenVINO's precision hint."""
        refuse_options(cls, options)
        precision = check_precision(options.compute_dtype)
        import dataclasses

        return cls.from_loaded(load_model(dataclasses.replace(options, compute_dtype=None)),
                               dataclasses.replace(options, compute_dtype=precision))

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "OpenVinoBackend":
        """``OpenVinoBackend(loaded, precision=options.compute_dtype, cache=options.onnx_cache,
        quantize=options.quantize, calibration=options.quantize_calibration)``."""
        return cls(loaded, precision=options.compute_dtype or "float32", cache=options.onnx_cache,
                   quantize=options.quantize, calibration=options.quantize_calibration)

    def __init__(self, loaded: LoadedModel, precision: str = "float32", cache: str | os.PathLike | None = None,
                 threads: int | None = None, exporter: OnnxBackend | None = None, quantize: str | None = None,
                 calibration: str | None = None):
        super().__init__(loaded)
        self.compute = check_precision(precision)
        self.quantize = check_quantize(quantize)
        if self.quantize == "int8-full" and self.compute != "float32":
            raise ModelLoadError(f"quantize='int8-full' runs its float parts in float32, not compute_dtype="
                                 f"{self.compute!r}: leave compute_dtype out")
        if self.compute == "bfloat16" and not native_on_cpu(torch.bfloat16):
            warnings.warn(f"OpenVINO runs float32, not bfloat16, on this CPU: it has none of "
                          f"{', '.join(FAST_ON_CPU[torch.bfloat16])}, and OpenVINO's CPU plugin then ignores the bf16 "
                          f"hint; the states are exact float32 and a store records precision 'float32'. Leave "
                          f"compute_dtype out on this machine, or run bf16 on a CPU or GPU that has it",
                          PrecisionWarning, stacklevel=2)
            self.compute = "float32"
        # int8-full: the calibration texts, read now so a bad file is refused before any export
        self.calibration = calibration_texts(calibration) if self.quantize == "int8-full" else None
        problem = self.unsupported(loaded)
        if problem:
            raise ModelLoadError(f"backend='openvino' {problem}")
        self.ov = require_openvino()
        if self.quantize:
            require("nncf", what=f"quantize={self.quantize!r} on OpenVINO", extra="openvino",
                    packages="openvino, nncf")
        self.onnx = exporter or OnnxBackend(loaded, cache=cache, dtypes=RUNS_FROM)  # the exporter and its cache
        self.root = self.onnx.root
        self.threads = threads or torch.get_num_threads()
        self.convert_seconds: dict[int, float] = {}  # depth -> seconds spent exporting and converting here
        self.fidelity: dict[int, dict] = {}  # depth -> measured fidelity to float32 (reduced precision only)
        self._compiled: dict[int, tuple[Any, list[Any]]] = {}  # depth -> (compiled model, infer requests)
        # a depth being opened, seen only by the thread opening it (its fidelity run): published in _compiled once
        # measured, so no other thread starts a batch on its infer requests meanwhile ("Infer Request is busy")
        self._opening = threading.local()
        self.served: tuple[int, ...] = ()  # the depths a server warmed and serves from (serve_only); (): each its own
        self._wrote = 0  # graphs this backend wrote to the cache (a build that wrote none found them built)
        self.leases = Leases()  # on the blob of each compiled model, held while it is open
        # (depth, request slot) -> the started batch whose result it holds (per depth: auto prepares a new depth in
        # the background while the caller runs another)
        self._holding: dict[tuple[int, int], _Pending] = {}
        # the infer requests are shared: a batch is started, read or run whole under this lock, so a request is never
        # started again while another thread reads it ("Infer Request is busy")
        self._requests_lock = threading.RLock()
        self._next = 0  # the slot the next started batch takes
        self.stages = OpenVinoStages(self)  # one-layer graphs, built only when rows of mixed depths are run

    @staticmethod
    def unsupported(loaded: LoadedModel) -> str | None:
        """Why ``loaded`` cannot run on this backend (a phrase to follow "backend='openvino'"), or ``None``: a
        float32 or bf16-loaded BERT-family encoder on the CPU runs (the graph is exported in float32)."""
        return OnnxBackend.unsupported(loaded, RUNS_FROM)

    @property
    def precision(self) -> str:
        """``"float32"`` or ``"bfloat16"``: what OpenVINO computes in, or ``"int8-weights"`` / ``"int8-full"`` when
        quantised (part of a store's identity)."""
        return PRECISIONS[self.quantize] if self.quantize else self.compute

    @property
    def dtype(self) -> torch.dtype:
        """``torch.bfloat16`` when run in bf16 (the states are returned as float32 either way)."""
        return torch.bfloat16 if self.compute == "bfloat16" else torch.float32

    def depth_for(self, layers: Sequence[int]) -> int:
        """The graph depth serving ``layers``: the deepest, at least 1; once :meth:`serve_only` named the depths a
        server warmed, that depth where it is compiled, else the shallowest warmed depth that covers it."""
        depth = max(max(layers), 1)
        return depth if depth in self._compiled else covering(depth, self.served)

    def serve_only(self, depths: Sequence[int]) -> None:
        """See :meth:`OnnxBackend.serve_only <layerwise.model.backends.ort.OnnxBackend.serve_only>`."""
        self.served = tuple(sorted(set(depths)))

    def compile_config(self) -> dict[str, Any]:
        """What every graph of this backend is compiled with: the throughput hint, :attr:`threads`, the precision hint,
        a bounded per-shape kernel cache (:data:`SHAPE_CACHE`) and, for int8 weights, the dynamic quantisation's group
        size."""
        config: dict[str, Any] = {"PERFORMANCE_HINT": "THROUGHPUT", "INFERENCE_NUM_THREADS": self.threads,
                                  "INFERENCE_PRECISION_HINT": PRECISION_HINTS[self.compute],
                                  "CPU_RUNTIME_CACHE_CAPACITY": SHAPE_CACHE}
        if self.quantize == "int8":
            config["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = DYNAMIC_QUANTIZATION_GROUP
        return config

    def blob_path(self, source: Path, prefix: str) -> Path:
        """Where the graph ``source`` (an ONNX graph or IR of the cache, whose name is its key) compiled with
        :meth:`compile_config` is cached: ``<prefix>-<digest>.blob``, keyed by the source, the settings, the CPU and
        the OpenVINO version (a blob runs only where it was compiled)."""
        key = {"source": source.name, "config": self.compile_config(), **self.ir_version(), "cpu": cpu_model()}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        return self.root / f"{prefix}-{digest}.blob"

    def ir_path(self, depth: int) -> Path:
        """Where the quantised IR for ``depth`` is cached (``quantize`` only: ``.xml`` beside its ``.bin``, and the
        calibration report ``.json`` for ``int8-full``), what its blob is compiled from."""
        key = {"weights": self.fingerprint(), "family": self.loaded.architecture, "depth": depth, "site": "block",
               "format": IR_FORMAT, "openvino": openvino_version(), "onnx": self.onnx.path_for(depth).name,
               "quantize": self.quantize, "nncf": openvino_version("nncf") if self.quantize else None,
               "calibration": texts_digest(self.calibration) if self.calibration else None}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        suffix = f"-{self.quantize}" if self.quantize else ""
        return self.root / f"{self.loaded.architecture}-d{depth}-openvino{suffix}-{digest}.xml"

    def path_for(self, depth: int) -> Path:
        """Where the compiled graph for ``depth`` is cached (a ``.blob``; with ``int8-full``, its calibration report
        ``.json`` beside it): compiled from the ONNX cut of the export, or from the quantised IR (:meth:`ir_path`)."""
        source = self.ir_path(depth) if self.quantize else self.onnx.path_for(depth)
        suffix = f"-{self.quantize}" if self.quantize else ""
        return self.blob_path(source, f"{self.loaded.architecture}-d{depth}-openvino{suffix}")

    def fingerprint(self) -> str:
        """The weights' sha256 (shared with the exporter, computed once)."""
        return self.onnx.fingerprint()

    def _complete(self, blob: Path) -> bool:
        return blob.exists() and (self.quantize != "int8-full" or report_path(blob).exists())

    def build(self, depth: int) -> Path:
        """The cached compiled graph (blob) for ``depth``, compiled now if absent from the ONNX cut (exported now if
        absent), or from the quantised IR (converted now if absent); the time is said on stderr (nothing when another
        process built it meanwhile)."""
        path = self.path_for(depth)
        if self._complete(path):
            return path
        cache = GraphCache(self.root)
        weights = weights_bytes(self.loaded)
        t0 = time.perf_counter()
        with BUILD_LOCK:
            wrote = self._wrote
            files, lease = cache.hold(lambda: self._source(depth, cache), ATTEMPTS)
            try:
                def write(tmp: Path) -> None:
                    self.compile_source(files[0], tmp / path.name)
                    if self.quantize == "int8-full":  # the calibration's report, beside the blob it describes
                        shutil.copyfile(report_path(files[0]), report_path(tmp / path.name))

                if cache.put(path, write, weights, keep=files, ready=lambda: self._complete(path)):
                    self._wrote += 1
            finally:
                lease.release()
            if self._wrote == wrote:
                return path
        seconds = time.perf_counter() - t0
        self.convert_seconds[depth] = seconds
        what = f"layers 0..{depth}" + {None: "", "int8": ", int8 weights",
                                       "int8-full": ", int8 weights and activations"}[self.quantize]
        notice(f"compiled {self.loaded.name} ({what}) to OpenVINO in {seconds:.1f} s, cached at {path}")
        cache.say(weights)
        return path

    def _source(self, depth: int, cache: GraphCache) -> list[Path]:
        """The files the blob of ``depth`` is compiled from, the graph first: the ONNX cut and the export it reads, or
        the quantised IR (converted now, from the cut, if absent)."""
        if not self.quantize:
            return [self.onnx.float_graph(depth, cache), *self.onnx.export_files(depth)]
        ir = self.ir_path(depth)
        files = [ir, ir.with_suffix(".bin")] + ([report_path(ir)] if self.quantize == "int8-full" else [])
        if all(f.exists() for f in files):
            return files
        (graph, *reads), lease = cache.hold(lambda: [self.onnx.float_graph(depth, cache),
                                                     *self.onnx.export_files(depth)], ATTEMPTS)
        try:
            def write(tmp: Path) -> None:
                out = tmp / ir.name
                if self.quantize == "int8-full":  # calibrated on the tokenizer's batches, in this process
                    model, report = quantize_full(lambda: self.ov.convert_model(str(graph)), self.loaded.tokenizer,
                                                  self.calibration or [])
                    report_path(out).write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
                    self.ov.save_model(model, str(out), compress_to_fp16=False)  # float32 weights: fp32 means fp32
                else:
                    self.convert(graph, out, self.quantize)

            if cache.put(ir, write, weights_bytes(self.loaded), keep=(graph, *reads),
                         ready=lambda: all(f.exists() for f in files)):
                self._wrote += 1
        finally:
            lease.release()
        return files

    def compile_source(self, graph: Path, out: Path) -> None:
        """Compile ``graph`` (an ONNX graph or IR) with :meth:`compile_config` and write the blob to ``out``: in a child
        process where the caller's thread offloads its build steps (``auto``'s background,
        :mod:`~layerwise.model.backends.offload`), else here (:func:`compile_graph`)."""
        config = json.dumps(self.compile_config(), sort_keys=True)
        if not offload.run(f"{__name__}:compile_graph", os.fspath(graph), os.fspath(out), config):
            compile_graph(graph, out, config)

    @staticmethod
    def convert(graph: str | os.PathLike, out: str | os.PathLike, quantize: str | None = None) -> None:
        """:func:`convert_graph`, in a child process where the caller's thread offloads its build steps (``auto``'s
        background, :mod:`~layerwise.model.backends.offload`), else here."""
        if not offload.run(f"{__name__}:convert_graph", os.fspath(graph), os.fspath(out), quantize or ""):
            convert_graph(graph, out, quantize)

    @staticmethod
    def ir_version() -> dict[str, Any]:
        """What a converted or compiled graph's cache key holds besides the model: the format and OpenVINO's
        version."""
        return {"format": IR_FORMAT, "openvino": openvino_version()}

    def compiled(self, layers: Sequence[int]) -> tuple[Any, list[Any]]:
        """The compiled model serving ``layers`` and its infer requests (one per stream), compiled on first use."""
        depth = self.depth_for(layers)
        if depth in self._compiled:
            return self._compiled[depth]
        opening = getattr(self._opening, "entries", {})
        if depth in opening:
            return opening[depth]
        with BUILD_LOCK:
            return self._compile(depth)

    def open_compiled(self, path: Path, what: str) -> tuple[Any, list[Any]]:
        """The compiled model of the blob at ``path`` (``what`` it runs, for the error: ``"layers 0..6"``), imported
        with :meth:`compile_config`, and one infer request per stream. A compiled precision other than the hint is
        refused (``ModelLoadError``), never recorded."""
        config = self.compile_config()
        compiled = self.ov.Core().import_model(path.read_bytes(), "CPU", config)
        ran = compiled.get_property("INFERENCE_PRECISION_HINT").to_string()
        if ran != config["INFERENCE_PRECISION_HINT"]:  # never a precision other than the one recorded
            raise ModelLoadError(f"OpenVINO compiled {what} in {ran}, not the {config['INFERENCE_PRECISION_HINT']} "
                                 f"asked for (compute_dtype={self.compute!r}) on this CPU ({cpu_model()}); leave "
                                 f"compute_dtype out")
        streams = max(1, int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))
        return compiled, [compiled.create_infer_request() for _ in range(streams)]

    def _compile(self, depth: int) -> tuple[Any, list[Any]]:
        if depth not in self._compiled:
            # the blob leased while the compiled model is open: no process evicts it meanwhile
            (path,), lease = GraphCache(self.root).hold(lambda: [self.build(depth)], ATTEMPTS)
            self.leases.hold(depth, lease)
            entry = self.open_compiled(path, f"layers 0..{depth}")
            if self.precision != "float32" and self.loaded.dtype == torch.float32:  # once per depth, warned if low
                self._opening.entries = {depth: entry}  # this thread's fidelity run, on requests no one else has
                try:
                    self.fidelity[depth] = measure_fidelity(self, depth)
                finally:
                    self._opening.entries = {}
                if self.quantize == "int8-full":  # what calibration measured and kept in float
                    self.fidelity[depth]["calibration"] = json.loads(report_path(path).read_text(encoding="utf-8"))
            self._compiled[depth] = entry
        return self._compiled[depth]

    def warm(self, layers: Sequence[int], site: str = "block") -> None:
        """Convert (or read from the cache) and compile the graph serving ``layers``."""
        self.compiled(layers)

    def settings(self, layers: Sequence[int]) -> dict[str, Any]:
        """What OpenVINO compiled for ``layers``: streams, threads, inference precision, performance hint."""
        compiled, requests = self.compiled(layers)
        return {"streams": len(requests), "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
                "precision": compiled.get_property("INFERENCE_PRECISION_HINT").to_string(),
                "hint": str(compiled.get_property("PERFORMANCE_HINT"))}

    def ahead(self, layers: Sequence[int], site: str) -> int:
        """As many batches as there are infer requests (one per stream) run at once."""
        return len(self.compiled(layers)[1])

    def start(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> Callable[[], torch.Tensor]:
        """Start the whole batch on the next infer request and return at once (see :meth:`Backend.start`); the
        returned callable waits and copies the requested states out, once. A request still holding an unread
        result is read before it is reused, so no result is lost however many batches are started."""
        _, requests = self.compiled(layers)
        with self._requests_lock:
            slot = (self.depth_for(layers), self._next % len(requests))
            self._next += 1
            previous = self._holding.get(slot)
            if previous is not None:
                previous()  # its states copied out: the request is free
            pending = _Pending(requests[slot[1]], list(layers), self.loaded.hidden_size, self._requests_lock)
            requests[slot[1]].start_async({"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                                           "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)})
            self._holding[slot] = pending
        return pending

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, hidden]`` float32 from OpenVINO (see :meth:`Backend.forward`): the batch cut by rows
        across the infer requests, run asynchronously, the requested states copied once into the result."""
        _, requests = self.compiled(layers)
        ids = input_ids.numpy().astype(np.int64, copy=False)
        mask = attention_mask.numpy().astype(np.int64, copy=False)
        batch, tokens = ids.shape
        out = np.empty((len(layers), batch, tokens, self.loaded.hidden_size), dtype=np.float32)
        bounds = np.linspace(0, batch, min(len(requests), batch) + 1).astype(int)
        with self._requests_lock:
            depth = self.depth_for(layers)
            for key in [key for key in self._holding if key[0] == depth]:
                self._holding.pop(key)()  # results of started batches are read before their requests are reused
            running = []
            for request, start, end in zip(requests, bounds[:-1], bounds[1:]):
                request.start_async({"input_ids": ids[start:end], "attention_mask": mask[start:end]})
                running.append((request, start, end))
            for request, start, end in running:
                copy_states(request, layers, out[:, start:end])
        return torch.from_numpy(out)


def compile_graph(graph: str | os.PathLike, out: str | os.PathLike, config: str | dict[str, Any]) -> None:
    """Compile ``graph`` (an ONNX graph, read with the weights file beside it, or an IR) for the CPU with ``config``
    (OpenVINO's properties, or them as JSON: a child process's step, :mod:`~layerwise.model.backends.offload`, passes
    strings) and write the compiled blob to ``out`` (what :meth:`OpenVinoBackend.open_compiled` imports)."""
    ov = require_openvino()
    settings = json.loads(config) if isinstance(config, str) else dict(config)
    blob = ov.Core().compile_model(os.fspath(graph), "CPU", settings).export_model()
    Path(out).write_bytes(blob.getvalue() if hasattr(blob, "getvalue") else blob)


def convert_graph(graph: str | os.PathLike, out: str | os.PathLike, quantize: str | None = None) -> None:
    """Convert the ONNX graph ``graph`` to OpenVINO's IR at ``out`` (``.xml`` and its ``.bin``), its float32 weights
    kept (never compressed to float16: fp32 means fp32); ``quantize="int8"``: the weights of every matrix product
    compressed to int8 first (:func:`~layerwise.model.backends.openvino_int8.compress_weights`). ``""`` is ``None``
    (a child process's step, :mod:`~layerwise.model.backends.offload`, passes strings)."""
    ov = require_openvino()
    model = ov.convert_model(os.fspath(graph))
    if quantize == "int8":
        model = compress_weights(model)
    ov.save_model(model, os.fspath(out), compress_to_fp16=False)


def report_path(graph: Path) -> Path:
    """Where the calibration report of an ``int8-full`` graph is kept: beside it, ``<graph>.json``."""
    return graph.with_suffix(".json")


def copy_states(request: Any, layers: Sequence[int], out: np.ndarray) -> np.ndarray:
    """Wait for ``request`` and copy its ``hidden_<layer>`` outputs into ``out`` ``[K, rows, tokens, width]`` (the
    one copy between the runtime and the reducers); returns ``out``."""
    request.wait()
    for k, layer in enumerate(layers):
        out[k] = request.get_tensor(f"hidden_{layer}").data
    return out


class _Pending:
    """The states of one batch started on an infer request: waited for and copied out on the first call."""

    def __init__(self, request: Any, layers: list[int], width: int, lock: Any):
        self.request, self.layers, self.width, self.lock = request, layers, width, lock
        self.states: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        with self.lock:  # read once, never while its request is started again by another thread
            if self.states is None:
                self.request.wait()
                rows, tokens = self.request.get_tensor(f"hidden_{self.layers[0]}").data.shape[:2]
                out = np.empty((len(self.layers), rows, tokens, self.width), dtype=np.float32)
                self.states = torch.from_numpy(copy_states(self.request, self.layers, out))
        return self.states


__all__ = ["DYNAMIC_QUANTIZATION_GROUP", "OpenVinoBackend", "PRECISIONS", "PRECISION_HINTS", "SHAPE_CACHE",
           "check_precision", "compile_graph", "convert_graph", "copy_states", "openvino_available", "openvino_version",
           "report_path", "require_openvino"]
