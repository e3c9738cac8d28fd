"""The sharded on-disk feature store: extraction (resumable), memory-mapped reading, export.

See :mod:`layerwise.store.shards` for the on-disk layout, :func:`extract` to write one,
:func:`open_store` to read one and :func:`export` to convert one.
"""

from .export import EXPORT_FORMATS, export
from .writer import LEVELS, ExtractError, ExtractSummary, extract
from .reader import FeatureStore, open_store

__all__ = ["EXPORT_FORMATS", "LEVELS", "ExtractError", "ExtractSummary", "FeatureStore", "export", "extract", "open_store"]
