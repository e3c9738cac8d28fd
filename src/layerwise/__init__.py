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

``import layerwise`` loads no torch: every public name is imported on first use (``lw.Extractor`` loads torch and
transformers' tokenizers; ``lw.open_store`` reads a store with numpy alone), and the service (``layerwise.serve``),
training (``lw.heads``), probing (``lw.probe``) and their web, plotting and learning stacks load when first used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import (
    ExportError,
    ExtractError,
    InputError,
    LayerwiseError,
    MappingError,
    MissingExtraError,
    ModelLoadError,
    ServiceError,
    SpecError,
    StoreCorruptError,
    StoreError,
    StoreFullError,
)
from .version import __version__

# public name -> the module that defines it; imported on first use (PEP 562), so ``import layerwise`` stays light
_LAZY = {
    "AttentionPool": ".encoding.pooling",
    "COMBINE_MODES": ".encoding.vocab",
    "Client": ".client",
    "EncodeSpec": ".encoding.spec",
    "ExportResult": ".cut.export",
    "Encoded": ".encoding.reduce",
    "ExtractOptions": ".extraction.options",
    "ExtractSummary": ".extraction.engine",
    "Extractor": ".extractor",
    "FeatureStore": ".store.reader",
    "ActivationStore": ".store.activations",
    "ActivationSummary": ".extraction.activations",
    "LEVELS": ".encoding.vocab",
    "LayerAttention": ".encoding.combine",
    "LayerMap": ".model.layermap",
    "LayerStack": ".encoding.stack",
    "LoadedModel": ".model.loaded",
    "ModelOptions": ".model.options",
    "POOL_MODES": ".encoding.vocab",
    "Positions": ".model.positions",
    "ReadOptions": ".corpus.readers",
    "SITES": ".encoding.vocab",
    "SUPPORTED_MODEL_TYPES": ".model.families",
    "ScalarMix": ".encoding.combine",
    "WORD_POOL_MODES": ".encoding.vocab",
    "capture": ".model.capture",
    "combine": ".encoding.combine",
    "default_model_path": ".model.loading",
    "export_model": ".cut.export",
    "extract": ".extraction.engine",
    "extract_activations": ".extraction.activations",
    "export_sae_lens": ".store.sae_lens",
    "open_activations": ".store.activations",
    "load_model": ".model.loading",
    "open_store": ".store.reader",
    "verify_store": ".store.integrity",
    "pool": ".encoding.pooling",
    "pool_words": ".encoding.pooling",
    "record": ".model.capture",
    "resolve_layers": ".encoding.layers",
}
# subpackages reached as attributes: lw.heads, lw.probe (training stacks), lw.explore (web stack), lw.ray
_SUBPACKAGES = {"explore": ".explore", "heads": ".heads", "probe": ".probe", "ray": ".extraction.ray"}

if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from . import explore, heads, probe
    from .client import Client
    from .corpus.readers import ReadOptions
    from .cut.export import ExportResult, export_model
    from .encoding.combine import LayerAttention, ScalarMix, combine
    from .encoding.layers import resolve_layers
    from .encoding.pooling import AttentionPool, pool, pool_words
    from .encoding.reduce import Encoded
    from .encoding.spec import EncodeSpec
    from .encoding.stack import LayerStack
    from .encoding.vocab import COMBINE_MODES, LEVELS, POOL_MODES, SITES, WORD_POOL_MODES
    from .extraction import ray
    from .extraction.activations import ActivationSummary, extract_activations
    from .extraction.engine import ExtractSummary, extract
    from .extraction.options import ExtractOptions
    from .extractor import Extractor
    from .model.capture import capture, record
    from .model.families import SUPPORTED_MODEL_TYPES
    from .model.layermap import LayerMap
    from .model.loaded import LoadedModel
    from .model.loading import default_model_path, load_model
    from .model.options import ModelOptions
    from .model.positions import Positions
    from .store.activations import ActivationStore, open_activations
    from .store.integrity import verify_store
    from .store.reader import FeatureStore, open_store
    from .store.sae_lens import export_sae_lens


def __getattr__(name: str) -> Any:
    """Import a public name (or a subpackage: ``lw.heads``, ``lw.probe``, ``lw.explore``, ``lw.ray``) on first use."""
    if name in _SUBPACKAGES:
        value = importlib.import_module(_SUBPACKAGES[name], __name__)
    elif name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    else:
        raise AttributeError(f"module 'layerwise' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


__all__ = [
    "explore",
    "heads",
    "probe",
    "ray",
    "ActivationStore",
    "ActivationSummary",
    "AttentionPool",
    "COMBINE_MODES",
    "Client",
    "EncodeSpec",
    "Encoded",
    "ExportError",
    "ExportResult",
    "ExtractError",
    "ExtractOptions",
    "ExtractSummary",
    "InputError",
    "Extractor",
    "FeatureStore",
    "LEVELS",
    "LayerAttention",
    "LayerMap",
    "LayerStack",
    "LayerwiseError",
    "LoadedModel",
    "MappingError",
    "MissingExtraError",
    "ModelLoadError",
    "ModelOptions",
    "POOL_MODES",
    "Positions",
    "ReadOptions",
    "SITES",
    "SUPPORTED_MODEL_TYPES",
    "ScalarMix",
    "ServiceError",
    "SpecError",
    "StoreCorruptError",
    "StoreError",
    "StoreFullError",
    "WORD_POOL_MODES",
    "__version__",
    "capture",
    "combine",
    "default_model_path",
    "export_model",
    "extract",
    "extract_activations",
    "export_sae_lens",
    "load_model",
    "open_activations",
    "open_store",
    "pool",
    "pool_words",
    "record",
    "resolve_layers",
    "verify_store",
]
