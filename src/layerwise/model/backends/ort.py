"""The ONNX Runtime backend: the encoder exported once per model, each depth a graph cut from that export.

``Extractor(..., backend="onnx")`` runs the same pipeline (tokenise, windows, token-budget batches, combine,
pool) with the forward pass executed by ONNX Runtime instead of PyTorch; ``backend="auto"`` (the default, see
:mod:`layerwise.model.backends.auto`) does so wherever the result is exact. A model up to ``EXPORT_WHOLE_BYTES`` is
exported once, whole, with every hidden state ``hidden_0 .. hidden_L`` an output ``[batch, tokens, hidden]`` and its
weights in one ``.onnx.data`` file; for a deepest requested layer ``d`` the graph is cut after ``hidden_d``
(:func:`cut_graph`: the nodes and weights later layers need are left out, in milliseconds) and reads the exported
weights, so every depth shares one copy of them on disk. A larger model is exported per depth, truncated after layer
``d`` (never loaded whole for an export). A call asks ONNX Runtime for the requested states only, so every layer
choice with the same deepest layer shares one graph.

Graph optimisations: the session runs with ``ORT_ENABLE_ALL`` (constant folding, LayerNorm, BiasGelu and MatMul
fusions, kept although the intermediate states are graph outputs). The offline transformer fusions (one
``Attention`` node per layer, ``SkipLayerNormalization``, ``EmbedLayerNormalization``) were measured on the
development CPU (2-core AVX-512, MiniLM-L6, SST-2 sentences): no faster (3.76 s against 3.71 s for 872 sentences)
and 1.5x further from PyTorch (9.5e-6 against 6.1e-6), so they are not applied.

``quantize="int8"``: dynamic int8 through ONNX Runtime (``MatMulInteger`` on VNNI/AVX-512/AVX2): every matrix
product with a weight is quantised, weights per output channel (symmetric int8), activations per tensor at run
time (asymmetric uint8). The attention score and context products (both inputs activations), the embeddings,
LayerNorm, softmax and GELU stay float32, which keeps more fidelity than quantising them (sentence-transformers'
int8 export quantises the score products and the embeddings too). Fidelity and speed are measured per layer in
``benchmarks/README.md``; it is an approximation by design (the activations' range depends on the batch).

Exports are cached on disk under ``$LAYERWISE_CACHE/onnx`` (default ``~/.cache/layerwise/onnx``; ``cache=``),
keyed by the weights' sha256, the family, the depth, the site, the quantisation and the exporter versions, and
written through :meth:`GraphCache.put <layerwise.model.backends.cache.GraphCache.put>` (atomically, once across the
processes that share the cache: a second one waits for the first's export), so the cost (a few seconds, said on stderr
the first time) is paid once per model. A session holds a lease on the graphs it reads, so no other process evicts
them while it is open. Only the ``block`` site is exported (the other sites are hooks inside a layer).

Rows of one batch that need different depths leave it at their own depth through a chain of one-layer graphs cut
from the same export (:mod:`~layerwise.model.backends.ort_stages`, opened only where mixed depths are asked for).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from torch import nn

from ...errors import ModelLoadError, SpecError
from ...extras import require
from ...notices import notice
from ..loaded import LoadedModel
from ..options import QUANTIZE_MODES, ModelOptions
from .base import LOADING_FIELDS, Backend, covering
from .cache import GraphCache, Leases
from .ort_stages import OrtStages
from .stages import Staged

EXPORT_FORMAT = 3  # bump when the exported graph changes (outputs, opset, quantisation recipe, cut graphs)
EXPORT_WHOLE_BYTES = 2 * 10**9  # a model up to this size is exported once, whole; each depth is cut from it
# one build at a time in a process: torch's ONNX exporter keeps global state, and a server may build the same depth
# from two threads at once (a request and the warming of --warm depths); OpenVINO's conversion takes it too. Between
# processes, GraphCache.put's entry locks (taken after this one) keep a graph from being built twice.
BUILD_LOCK = threading.RLock()
ATTEMPTS = 3  # builds of a graph that other processes evicted before it could be leased, before giving up


def require_ort() -> Any:
    """The ``onnxruntime`` module; :class:`~layerwise.MissingExtraError` naming the ``[onnx]`` extra."""
    return require("onnxruntime", what="the ONNX Runtime backend", extra="onnx", packages="onnxruntime, onnx")


def ort_available() -> bool:
    """Whether ONNX Runtime and the ONNX exporter's package can be imported."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("onnxruntime", "onnx"))


def check_quantize(quantize: object) -> str | None:
    """``None`` (full precision) or a mode of :data:`QUANTIZE_MODES`; ``ValueError`` lists the valid values."""
    if quantize in (None, "none"):
        return None
    if quantize not in QUANTIZE_MODES:
        raise ModelLoadError(f"unknown quantize {quantize!r}. Valid values are: none, {', '.join(QUANTIZE_MODES)}")
    return str(quantize)


def measure_fidelity(backend: Backend, depth: int) -> dict:
    """:func:`layerwise.model.fidelity.measure` of ``backend`` (a reduced-precision runtime of a float32 PyTorch
    model) against that model, for layers ``0..depth``."""
    from ..capture import capture
    from ..fidelity import measure

    loaded = backend.loaded
    return measure(backend.precision, lambda ids, mask, layers: backend.forward(ids, mask, layers, "block"),
                   lambda ids, mask, layers: capture(loaded, ids, mask, layers), loaded.tokenizer, depth, loaded.name)


class Truncated(nn.Module):
    """The encoder cut after its deepest requested layer; returns every hidden state up to it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Shape: each (batch, tokens, hidden)
        return tuple(self.model(input_ids=input_ids, attention_mask=attention_mask,
                                output_hidden_states=True).hidden_states)


def truncated_copy(loaded: LoadedModel, depth: int) -> nn.Module:
    """A float32 CPU copy of the model that runs only its first ``depth`` layers (``depth >= 1``)."""
    if loaded.streams(depth):
        raise ModelLoadError(f"layers 0..{depth} exceed max_memory and run block by block, which only PyTorch does; "
                             f"an ONNX or OpenVINO export needs them all in memory: use backend='torch' or 'auto', or "
                             f"raise max_memory")
    loaded.ensure_depth(depth)  # a model loaded by depth: its first blocks, read now if they are not in memory
    with loaded.lock:  # never while a capture's hooks are on the modules: the copy would carry them
        model = copy.deepcopy(loaded.model)
    if loaded.architecture == "albert":  # one shared layer run num_hidden_layers times
        # config: the transformers model's PretrainedConfig, which mypy sees as nn.Module.__getattr__'s Tensor | Module
        model.config.num_hidden_layers = depth  # type: ignore[union-attr]
        return model.cpu().float().eval()
    container_path = loaded.layer_map.path
    parent = model
    *head, last = container_path.split(".")
    for part in head:
        parent = getattr(parent, part)
    setattr(parent, last, getattr(parent, last)[:depth])  # before the copy moves: deeper blocks may hold no weights
    for attr in ("num_hidden_layers", "n_layers"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, depth)
    return model.cpu().float().eval()


def weights_bytes(loaded: LoadedModel) -> int:
    """Bytes of the model's weights: the whole checkpoint's when it is loaded by depth, else its parameters'."""
    if loaded.blocks is not None:
        return int(loaded.blocks.checkpoint.total_bytes)
    return sum(p.numel() * p.element_size() for p in loaded.model.parameters())


def cache_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The directory for exported graphs: ``explicit``, else ``$LAYERWISE_CACHE/onnx``, else
    ``$XDG_CACHE_HOME/layerwise/onnx`` (``~/.cache/layerwise/onnx``)."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get("LAYERWISE_CACHE"):
        return Path(os.environ["LAYERWISE_CACHE"]) / "onnx"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerwise" / "onnx"


def output_names(depth: int) -> list[str]:
    """The graph's outputs for ``depth``: ``hidden_0 .. hidden_depth``."""
    return [f"hidden_{i}" for i in range(depth + 1)]


def _atomic(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def scratch_prefix(path: Path) -> str:
    """The name prefix of a scratch file or directory beside ``path``: ``.<name>.tmp-<PID>-``, so that what a killed
    process leaves is known as a dead process's temporary file (:class:`~layerwise.model.backends.cache.GraphCache`)."""
    return f".{path.name}.tmp-{os.getpid()}-"


def export(loaded: LoadedModel, depth: int, path: Path) -> Path:
    """Export the model truncated after layer ``depth`` with outputs ``hidden_0 .. hidden_depth`` to ``path``, its
    weights in ``path.onnx.data`` beside it (atomically: both whole, or the graph absent; the cache writes it into a
    temporary directory of :meth:`~layerwise.model.backends.cache.GraphCache.put`). ``depth`` 0 exports one layer (the
    graph needs a layer to trace). In ``auto``'s background preparation the export runs in a child process
    (:mod:`layerwise.model.backends.offload`: it holds the GIL for seconds), which rebuilds the truncated copy from a
    file beside ``path`` (:func:`save_truncated`)."""
    import tempfile

    from . import offload

    depth = max(depth, 1)
    model = truncated_copy(loaded, depth)
    cls_id, sep_id = loaded.tokenizer.cls_token_id or 0, loaded.tokenizer.sep_token_id or 0
    if offload.active():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, saved = tempfile.mkstemp(prefix=scratch_prefix(path), suffix=".pt", dir=path.parent)
        os.close(fd)
        try:
            save_truncated(model, saved)
            del model  # the child holds its own copy
            if offload.run(f"{__name__}:export_saved", saved, str(depth), str(cls_id), str(sep_id), str(path)):
                return path
        finally:
            os.unlink(saved)
        model = truncated_copy(loaded, depth)  # the child failed: exported here, where an error is raised
    return export_module(Truncated(model).eval(), depth, cls_id, sep_id, path)


def export_saved(saved: str, depth: str, cls_id: str, sep_id: str, path: str) -> None:
    """The export step of a child process (:mod:`~layerwise.model.backends.offload`; arguments as strings): the
    model written by :func:`save_truncated` at ``saved`` exported by :func:`export_module` to ``path``, on one
    thread."""
    torch.set_num_threads(1)
    export_module(Truncated(load_truncated(saved)).eval(), int(depth), int(cls_id), int(sep_id), path)


def save_truncated(model: nn.Module, path: str | os.PathLike) -> None:
    """Write a truncated transformers model (:func:`truncated_copy`) as its class, config and weights, for
    :func:`load_truncated` in another process (the module itself does not pickle: transformers' output-capturing
    hooks are closures). The weights are written without holding the GIL for long."""
    cls = type(model)
    torch.save({"class": f"{cls.__module__}:{cls.__qualname__}", "config": model.config,
                "state": model.state_dict()}, path)


def load_truncated(path: str | os.PathLike) -> nn.Module:
    """The model written by :func:`save_truncated`: its class built from the config (whose layer count is the
    truncated one), the weights loaded; ``ModelLoadError`` when they do not fit it (a key the class lacks)."""
    import importlib

    saved = torch.load(path, weights_only=False)
    module_name, _, qualname = saved["class"].partition(":")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    model = cls(saved["config"])
    # a key the class builds but the weights lack (an unused pooler left out at load) keeps its value: the graph is
    # checked against PyTorch before it serves
    unexpected = model.load_state_dict(saved["state"], strict=False).unexpected_keys
    if unexpected:
        raise ModelLoadError(f"{saved['class']} rebuilt from its config has no {', '.join(unexpected[:5])}")
    return model.float().eval()


def export_module(module: nn.Module, depth: int, cls_id: int, sep_id: int, path: str | os.PathLike) -> Path:
    """Export ``module`` (a :class:`Truncated` encoder of ``depth`` layers: ``(input_ids, attention_mask)``, each
    ``[batch, tokens]``, to ``hidden_0 .. hidden_depth``, each ``[batch, tokens, hidden]``) to ``path``, its weights
    in ``path.onnx.data`` beside it (atomically), tracing it on a padded batch of two rows ``[CLS] x x x x x x [SEP]``
    (``cls_id``, ``sep_id``)."""
    import shutil
    import tempfile

    import onnx

    path = Path(path)
    ids = torch.tensor([[cls_id] + [5] * 6 + [sep_id]] * 2)
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    names = output_names(depth)
    path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=scratch_prefix(path), dir=path.parent))  # a graph over 2 GB: many files
    try:
        with torch.no_grad(), warnings.catch_warnings():
            # tracer warnings about Python-side shape checks; the graph is verified against PyTorch where it is used
            warnings.simplefilter("ignore")
            torch.onnx.export(
                module, (ids, mask), str(work / "model.onnx"), input_names=["input_ids", "attention_mask"],
                output_names=names,
                dynamic_axes={"input_ids": {0: "batch", 1: "tokens"}, "attention_mask": {0: "batch", 1: "tokens"},
                              **{n: {0: "batch", 1: "tokens"} for n in names}},
                opset_version=17, dynamo=False,
            )
        del module
        graph = onnx.load(str(work / "model.onnx"))
        data = path.name + ".data"
        onnx.save_model(graph, str(work / path.name), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data, size_threshold=1024)
        os.replace(work / data, path.with_name(data))
        os.replace(work / path.name, path)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return path


def cut_graph(base: Path, depth: int, path: Path) -> Path:
    """The graph of layers ``0..depth`` cut from ``base`` (outputs ``hidden_0 .. hidden_depth``; the nodes and
    weights they do not need left out), written to ``path`` beside it, reading its weights from ``base``'s
    ``.onnx.data`` (nothing is copied). A few milliseconds, where an export takes seconds."""
    import onnx
    import onnx.utils

    graph = onnx.load(str(base), load_external_data=False)
    cut = onnx.utils.Extractor(graph).extract_model(["input_ids", "attention_mask"], output_names(max(depth, 1)))
    tmp = _atomic(path)
    onnx.save_model(cut, str(tmp))
    os.replace(tmp, path)
    return path


def cut_stage(base: Path, first: int, last: int, path: Path) -> Path:
    """The graph of layers ``first+1 .. last`` run from the state after layer ``first``, cut from ``base`` and
    written to ``path`` beside it (its weights read from ``base``'s ``.onnx.data``): inputs ``hidden_<first>``
    ``[batch, tokens, hidden]`` and ``attention_mask`` ``[batch, tokens]``, outputs ``hidden_<first+1> ..
    hidden_<last>``. A chain of such stages lets the rows of a batch leave it between layers (see
    :mod:`~layerwise.model.backends.stages`).

    The exported graph builds the attention mask from the shapes of ``input_ids`` and of the embeddings' output;
    in the stage those ``Shape`` nodes read ``attention_mask`` and ``hidden_<first>`` (the same batch and token
    sizes), so the stage holds none of the embeddings.

    Raises:
        ModelLoadError: the layers need another tensor of the earlier graph (a model whose blocks read more than
            the state and the mask): it cannot be run in stages.
    """
    import onnx
    import onnx.utils

    graph = onnx.load(str(base), load_external_data=False)
    state = f"hidden_{first}"
    for node in graph.graph.node:
        if node.op_type != "Shape":
            continue
        if node.input[0] == "input_ids":
            node.input[0] = "attention_mask"
        elif node.input[0].startswith("hidden_") and int(node.input[0][len("hidden_"):]) < first:
            node.input[0] = state
    cut = onnx.utils.Extractor(graph).extract_model([state, "attention_mask"],
                                                    [f"hidden_{k}" for k in range(first + 1, last + 1)])
    known = {o for n in cut.graph.node for o in n.output} | {i.name for i in cut.graph.input} | \
        {i.name for i in cut.graph.initializer}
    missing = sorted({i for n in cut.graph.node for i in n.input if i and i not in known})
    if missing:
        raise ModelLoadError(f"layers {first + 1}..{last} of {base.name} read {', '.join(missing[:3])} besides "
                             f"hidden_{first} and the attention mask, so they cannot run as a stage")
    tmp = _atomic(path)
    onnx.save_model(cut, str(tmp))
    os.replace(tmp, path)
    return path


def quantize_graph(source: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Dynamic int8 copy of ``source`` at ``path``: the matrix products with a weight, per output channel (in a
    child process in ``auto``'s background preparation, :mod:`layerwise.model.backends.offload`)."""
    import onnx

    from . import offload

    source, path = Path(source), Path(path)
    if offload.run(f"{__name__}:quantize_graph", str(source), str(path)):
        return path
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    tmp = _atomic(path)
    prepared = tmp.with_name(tmp.name + ".pre")
    whole = tmp.with_name(tmp.name + ".whole")
    try:
        # the cut graph with its weights inside (ORT's preprocessing copies the graph elsewhere, away from the
        # exported weights it reads)
        onnx.save_model(onnx.load(str(source)), str(whole))
        # shapes inferred and constants folded, as ORT recommends (its symbolic shape pass cannot follow the window
        # arithmetic of the position ids, so the ONNX shape inference is used)
        quant_pre_process(str(whole), str(prepared), skip_symbolic_shape=True)
        graph = onnx.load(str(prepared), load_external_data=False).graph
        weights = {t.name for t in graph.initializer}
        activations_only = [n.name for n in graph.node if n.op_type == "MatMul" and not (set(n.input) & weights)]
        quantize_dynamic(str(prepared), str(tmp), weight_type=QuantType.QInt8, per_channel=True,
                         op_types_to_quantize=["MatMul"], nodes_to_exclude=activations_only)
    finally:
        prepared.unlink(missing_ok=True)
        whole.unlink(missing_ok=True)
    os.replace(tmp, path)
    return path


class OnnxBackend(Staged, Backend):
    """ONNX Runtime on the CPU, block site only; one exported graph per deepest requested layer.

    Args:
        loaded: the model (exported from its PyTorch weights; one of the family table's BERT-style encoders).
        cache: directory for exported graphs (default ``~/.cache/layerwise/onnx``, see :func:`cache_dir`).
        threads: intra-op threads (default: torch's thread count).
        quantize: ``None`` (float32, the default) or ``"int8"`` (dynamic int8; see the module docstring);
            ``"int8-full"`` is refused (it runs on OpenVINO).
        dtypes: the dtypes of ``loaded`` it takes: float32 to run it; the OpenVINO backend, which only exports
            through it, also takes a bf16-loaded model (the export is float32, OpenVINO's hint runs it in bf16).
    """

    name = "onnx"
    sites = ("block",)
    accepts = frozenset((*LOADING_FIELDS, "quantize", "onnx_cache"))
    spin = False  # let idle intra-op threads spin-wait (ONNX Runtime's default); off: see :meth:`session`

    @classmethod
    def from_loaded(cls, loaded: LoadedModel, options: ModelOptions) -> "OnnxBackend":
        """``OnnxBackend(loaded, cache=options.onnx_cache, quantize=options.quantize)``."""
        return cls(loaded, cache=options.onnx_cache, quantize=options.quantize)

    def __init__(self, loaded: LoadedModel, cache: str | os.PathLike | None = None, threads: int | None = None,
                 quantize: str | None = None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
        super().__init__(loaded)
        self.quantize = check_quantize(quantize)
        if self.quantize == "int8-full":
            raise ModelLoadError("quantize='int8-full' runs on OpenVINO (pip install 'layerwise[openvino]'; "
                                 "backend='auto' or 'openvino'), not backend='onnx': ONNX Runtime's int8 is "
                                 "quantize='int8'")
        problem = self.unsupported(loaded, dtypes)
        if problem:
            raise ModelLoadError(f"backend='onnx' {problem}")
        self.ort = require_ort()
        self.root = cache_dir(cache)
        self.threads = threads or torch.get_num_threads()
        self.export_seconds: dict[int, float] = {}  # exported depth -> seconds spent exporting it in this process
        self.fidelity: dict[int, dict] = {}  # depth -> measured fidelity to float32 (quantised only)
        self._sessions: dict[int, Any] = {}
        self.served: tuple[int, ...] = ()  # the depths a server warmed and serves from (serve_only); () : each its own
        self._wrote = 0  # graphs this backend wrote to the cache (a build that wrote none found them built)
        self.leases = Leases()  # on what each open session reads, held while it is open
        self.stages = OrtStages(self)  # one-layer graphs, opened only when rows of mixed depths are run

    @staticmethod
    def unsupported(loaded: LoadedModel, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> str | None:
        """Why ``loaded`` cannot run on this backend (a phrase to follow "backend='onnx'"), or ``None``. ``dtypes``:
        the dtypes of a loaded model it takes (the export itself is always float32)."""
        if loaded.device.type != "cpu":
            return f"runs on the CPU here, not {loaded.device}; use backend='torch' for CUDA"
        if loaded.dtype not in dtypes:
            return f"exports float32, not {str(loaded.dtype).replace('torch.', '')}; use backend='torch' for it"
        if loaded.layer_map.source != "table":
            return (f"exports the BERT-family encoders of the family table; this {loaded.architecture} model's "
                    f"layers were {loaded.layer_map.source} at load: use backend='torch'")
        return None

    @property
    def precision(self) -> str:
        """``"float32"``, or ``"int8"`` when quantised."""
        return self.quantize or "float32"

    def depth_for(self, layers: Sequence[int]) -> int:
        """The graph depth serving ``layers``: the deepest, at least 1; once :meth:`serve_only` named the depths a
        server warmed, that depth where its graph is open (the one-layer stages' head, depth 1, is), else the
        shallowest warmed depth that covers it (:func:`~layerwise.model.backends.base.covering`)."""
        depth = max(max(layers), 1)
        return depth if depth in self._sessions else covering(depth, self.served)

    def serve_only(self, depths: Sequence[int]) -> None:
        """Serve every request from the graphs of ``depths`` (a server's warmed depths, all compiled): a request for
        another depth runs on the shallowest of them that covers it rather than compiling its own graph on the
        request's path. Rows of several depths still leave their batches at their own depth where the one-layer
        stages are prepared."""
        self.served = tuple(sorted(set(depths)))

    def path_for(self, depth: int, quantize: str | None = None) -> Path:
        """Where the graph for ``depth`` (quantised as ``quantize``) is cached: keyed by weights, family, depth,
        site, quantisation, format and versions."""
        import onnx

        key = {"weights": self.fingerprint(), "family": self.loaded.architecture, "depth": depth, "site": "block",
               "quantize": quantize, "format": EXPORT_FORMAT, "torch": torch.__version__,
               "ort": self.ort.__version__, "onnx": onnx.__version__}
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        suffix = f"-{quantize}" if quantize else ""
        return self.root / f"{self.loaded.architecture}-d{depth}{suffix}-{digest}.onnx"

    def export_depth(self, depth: int) -> int:
        """The depth of the graph that ``depth``'s graph is cut from: the whole model when its weights are at most
        :data:`EXPORT_WHOLE_BYTES` (exported once, every depth a cut of it), else ``depth`` itself (a large model is
        never loaded whole for an export: memory follows the layers asked for)."""
        whole = self.loaded.num_layers
        if weights_bytes(self.loaded) <= EXPORT_WHOLE_BYTES and not self.loaded.streams(whole):
            return whole
        return max(depth, 1)

    def export_files(self, depth: int) -> tuple[Path, Path]:
        """The exported graph that ``depth``'s cut is taken from and reads its weights from: ``(x.onnx,
        x.onnx.data)``, for layers ``0..export_depth(depth)``."""
        whole = self.export_depth(depth)
        cut = self.path_for(whole)
        base = cut.with_name(cut.name.replace(f"-d{whole}-", f"-all{whole}-", 1))
        return base, base.with_name(base.name + ".data")

    def exported(self, depth: int, cache: GraphCache | None = None) -> list[Path]:
        """The exported graph that ``depth``'s cut reads (:meth:`export_files`), exported now if absent (through
        :meth:`GraphCache.put <layerwise.model.backends.cache.GraphCache.put>`: a process that finds another one
        exporting it waits for that export)."""
        cache = cache or GraphCache(self.root)
        base, data = self.export_files(depth)
        with BUILD_LOCK:
            if not self.intact(depth):
                whole = self.export_depth(depth)
                self.path_for(depth).unlink(missing_ok=True)  # a cut of an export that is gone
                t0 = time.perf_counter()
                if cache.put(base, lambda tmp: export(self.loaded, whole, tmp / base.name), weights_bytes(self.loaded),
                             ready=lambda: self.intact(depth)):
                    self.export_seconds[whole] = time.perf_counter() - t0
                    self._wrote += 1
        return [base, data]

    def float_graph(self, depth: int, cache: GraphCache | None = None) -> Path:
        """The cached float32 graph for ``depth`` (what quantisation and OpenVINO's compilation start from): a cut of
        the exported graph (:meth:`export_depth`), which is exported now if absent. The cut holds no weights: it
        reads the exported graph's ``.onnx.data``, so every depth of a model shares one copy of them on disk."""
        cut = self.path_for(depth)
        cache = cache or GraphCache(self.root)
        with BUILD_LOCK:
            (base, data), lease = cache.hold(lambda: self.exported(depth, cache), ATTEMPTS)
            try:
                if cache.put(cut, lambda tmp: cut_graph(base, depth, tmp / cut.name), weights_bytes(self.loaded),
                             keep=(base, data)):
                    self._wrote += 1
            finally:
                lease.release()
        return cut

    def stage_path(self, layer: int) -> Path:
        """Where the graph of ``layer`` alone (:meth:`stage_graph`) is cached."""
        return self.path_for(layer).with_name(self.path_for(layer).name.replace(f"-d{layer}-", f"-s{layer}-", 1))

    def stage_graph(self, layer: int) -> Path:
        """The cached float32 graph of ``layer`` alone (``layer >= 2``), run from ``hidden_<layer-1>`` and the mask
        (:func:`cut_stage`), cut from the exported graph that serves ``layer`` (exported now if absent)."""
        if layer < 2:
            raise SpecError(f"a stage graph runs one layer from 2 on (layers 0..1 are the depth-1 graph), not {layer}")
        path = self.stage_path(layer)
        cache = GraphCache(self.root)
        with BUILD_LOCK:
            (base, data), lease = cache.hold(lambda: self.exported(layer, cache), ATTEMPTS)
            try:
                cache.put(path, lambda tmp: cut_stage(base, layer - 1, layer, tmp / path.name),
                          weights_bytes(self.loaded), keep=(base, data))
            finally:
                lease.release()
        return path

    def build(self, depth: int) -> Path:
        """The cached graph for ``depth``, cut from the exported graph (exported now if absent) and quantised if
        asked; what it cost is said on stderr (nothing when another process built it meanwhile)."""
        path = self.path_for(depth, self.quantize)
        cache = GraphCache(self.root)
        weights = weights_bytes(self.loaded)
        with BUILD_LOCK:
            if path.exists() and (self.quantize or self.intact(depth)):
                return path
            t0 = time.perf_counter()
            exported, wrote = set(self.export_seconds), self._wrote
            if self.quantize:
                (full, *reads), lease = cache.hold(lambda: [self.float_graph(depth, cache), *self.export_files(depth)],
                                                   ATTEMPTS)
                try:
                    if cache.put(path, lambda tmp: quantize_graph(full, tmp / path.name), weights,
                                 keep=(full, *reads)):
                        self._wrote += 1
                finally:
                    lease.release()
            else:
                self.float_graph(depth, cache)
            if self._wrote == wrote:  # another process built it meanwhile (this one waited for it)
                return path
        seconds = time.perf_counter() - t0
        what = f"layers 0..{depth}" + (f", {self.quantize}" if self.quantize else "")
        if set(self.export_seconds) != exported:
            notice(f"exported {self.loaded.name} (layers 0..{self.export_depth(depth)}) to ONNX once for every "
                   f"depth, and cut {what} from it, in {seconds:.1f} s, cached at {path}")
        else:
            notice(f"cut {what} of {self.loaded.name} from its exported graph in {seconds:.2f} s, cached at {path}")
        cache.say(weights)
        return path

    def intact(self, depth: int) -> bool:
        """Whether the exported graph that ``depth``'s cut reads its weights from is in the cache (the cache may
        have evicted it)."""
        return all(f.exists() for f in self.export_files(depth))

    def warm(self, layers: Sequence[int], site: str = "block") -> None:
        """Export (or read from the cache) and open the graph serving ``layers``."""
        self.session(layers)

    def session(self, layers: Sequence[int]) -> Any:
        """The inference session serving ``layers`` (graph exported on first use, then read from the cache)."""
        depth = self.depth_for(layers)
        if depth in self._sessions:
            return self._sessions[depth]
        with BUILD_LOCK:
            return self._open(depth)

    def options(self) -> Any:
        """The session options of every graph this backend opens (the depth graphs, the one-layer stages):
        :attr:`threads` intra-op threads, one inter-op thread, every graph optimisation, spinning per :attr:`spin`."""
        opts = self.ort.SessionOptions()
        opts.intra_op_num_threads = self.threads
        opts.inter_op_num_threads = 1
        opts.graph_optimization_level = self.ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if not self.spin:
            # idle intra-op threads sleep instead of spinning: a spinning pool steals the cores that the tokenizer
            # thread and, in the service, the event loop need between two runs
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        return opts

    def _open(self, depth: int) -> Any:
        if depth not in self._sessions:
            # leased, with the export it reads, for as long as the session is open: no process evicts them meanwhile
            (path, *_), lease = GraphCache(self.root).hold(
                lambda: [self.build(depth), *(() if self.quantize else self.export_files(depth))], ATTEMPTS)
            self.leases.hold(depth, lease)
            self._sessions[depth] = self.ort.InferenceSession(str(path), self.options(),
                                                              providers=["CPUExecutionProvider"])
            if self.quantize:  # once per depth: how close int8 stays to float32 on this model (warned when not)
                self.fidelity[depth] = measure_fidelity(self, depth)
        return self._sessions[depth]

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, layers: Sequence[int], site: str
    ) -> torch.Tensor:
        """``[K, batch, tokens, hidden]`` from ONNX Runtime (see :meth:`Backend.forward`)."""
        names = list(dict.fromkeys(f"hidden_{i}" for i in layers))
        feed = {"input_ids": input_ids.numpy().astype(np.int64, copy=False),
                "attention_mask": attention_mask.numpy().astype(np.int64, copy=False)}
        got = dict(zip(names, self.session(layers).run(names, feed)))
        if len(layers) == 1:
            return torch.from_numpy(got[names[0]][None])
        return torch.from_numpy(np.stack([got[f"hidden_{i}"] for i in layers]))

__all__ = ["EXPORT_FORMAT", "OnnxBackend", "QUANTIZE_MODES", "cache_dir", "check_quantize", "cut_stage", "export",
           "measure_fidelity", "ort_available", "output_names", "quantize_graph", "require_ort", "truncated_copy"]
