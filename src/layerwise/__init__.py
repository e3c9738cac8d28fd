"""layerwise: every hidden layer of a transformer (any architecture, any PyTorch module) as a first-class, fast,
validated object.

Layer addressing: index 0 is the embeddings output, ``i`` in ``1..L`` the output of encoder layer ``i``,
negative indices count from the end (the Hugging Face ``hidden_states`` convention).

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor()                                           # embedded all-MiniLM-L6-v2
    >>> ex.encode(["I love Paris"], layers="-4:", combine="concat", pool="max").shape
    (1, 1536)
    >>> spec = lw.EncodeSpec(layers="-4:", level="word")              # the same description everywhere
    >>> [r.features.shape for r in ex.stream([["EU", "rejects", "German", "call"]], spec)]
    [torch.Size([4, 1536])]

``import layerwise`` loads torch and transformers' tokenizers only; the service (``layerwise.serve``), training
(``lw.heads``), probing (``lw.probe``) and their web, plotting and learning stacks load when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

from .capture import capture, record
from .client import Client
from .combine import COMBINE_MODES, LayerAttention, ScalarMix, combine
from .discovery import MappingError
from .engine import ExtractError, ExtractOptions, ExtractSummary, extract
from .extractor import Extractor
from .families import SUPPORTED_MODEL_TYPES
from .layermap import LayerMap
from .layers import SITES, resolve_layers
from .loading import LoadedModel, ModelLoadError, default_model_path, load_model
from .pipeline import Encoded
from .pooling import POOL_MODES, WORD_POOL_MODES, AttentionPool, pool, pool_words
from .positions import Positions
from .readers import ReadOptions
from .spec import LEVELS, EncodeSpec
from .stack import LayerStack
from .store import FeatureStore, open_store
from .version import __version__

_SUBPACKAGES = {"explore": ".explore", "heads": ".heads", "probe": ".probe", "ray": ".engines.ray"}


def __getattr__(name: str) -> Any:
    """``lw.heads``, ``lw.probe`` (training stacks) and ``lw.explore`` (web stack) are imported on first use, keeping
    ``import layerwise`` light."""
    if name in _SUBPACKAGES:
        return importlib.import_module(_SUBPACKAGES[name], __name__)
    raise AttributeError(f"module 'layerwise' has no attribute {name!r}")


__all__ = [
    "AttentionPool",
    "COMBINE_MODES",
    "Client",
    "EncodeSpec",
    "Encoded",
    "ExtractError",
    "ExtractOptions",
    "ExtractSummary",
    "Extractor",
    "FeatureStore",
    "LEVELS",
    "LayerAttention",
    "LayerMap",
    "LayerStack",
    "LoadedModel",
    "MappingError",
    "ModelLoadError",
    "POOL_MODES",
    "Positions",
    "ReadOptions",
    "SITES",
    "SUPPORTED_MODEL_TYPES",
    "ScalarMix",
    "WORD_POOL_MODES",
    "__version__",
    "capture",
    "combine",
    "default_model_path",
    "explore",
    "extract",
    "heads",
    "load_model",
    "open_store",
    "pool",
    "pool_words",
    "probe",
    "record",
    "resolve_layers",
]
