"""layerwise: every hidden layer of a BERT-family encoder as a first-class, fast, validated object.

Layer addressing: index 0 is the embeddings output, ``i`` in ``1..L`` the output of encoder layer ``i``,
negative indices count from the end (the Hugging Face ``hidden_states`` convention).

Example::

    >>> import layerwise as lw
    >>> ex = lw.Extractor()                                           # embedded all-MiniLM-L6-v2
    >>> ex.encode(["I love Paris"], layers="-4:", combine="concat", pool="max").shape
    (1, 1536)
"""

from . import heads, probe
from .capture import capture, record
from .combine import COMBINE_MODES, ScalarMix, combine
from .extractor import Extractor
from .families import SUPPORTED_MODEL_TYPES
from .layers import SITES, resolve_layers
from .loading import LoadedModel, ModelLoadError, default_model_path, load_model
from .pooling import POOL_MODES, WORD_POOL_MODES, AttentionPool, pool, pool_words
from .serve.client import Client
from .stack import LayerStack
from .store import ExtractError, FeatureStore, extract, open_store

__version__ = "0.1.0"

__all__ = [
    "AttentionPool",
    "Client",
    "COMBINE_MODES",
    "Extractor",
    "LayerStack",
    "LoadedModel",
    "ModelLoadError",
    "POOL_MODES",
    "SITES",
    "SUPPORTED_MODEL_TYPES",
    "ScalarMix",
    "ExtractError",
    "FeatureStore",
    "extract",
    "open_store",
    "WORD_POOL_MODES",
    "__version__",
    "capture",
    "heads",
    "probe",
    "combine",
    "default_model_path",
    "load_model",
    "pool",
    "pool_words",
    "record",
    "resolve_layers",
]
