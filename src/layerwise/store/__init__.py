"""The feature store's on-disk format: layout, the writer of a store directory, the reader, exporters.

This package knows files only; it imports nothing that computes features. Extraction into a store (streaming,
resume, bad records, progress) is the engine's job: :func:`layerwise.extract` in :mod:`layerwise.extraction.engine`.

See :mod:`layerwise.store.layout` for the layout, :class:`StoreWriter` to write one, :func:`open_store` to read one
and :func:`export` to convert one.
"""

from ..errors import StoreCorruptError, StoreError, StoreFullError
from .export import EXPORT_FORMATS, export
from .layout import FORMAT_VERSION, STORE_DTYPES
from .merge import MergeSummary, check_parts, merge_stores
from .reader import FeatureStore, open_store
from .writer import StoreWriter

__all__ = [
    "EXPORT_FORMATS", "FORMAT_VERSION", "FeatureStore", "MergeSummary", "STORE_DTYPES", "StoreCorruptError",
    "StoreError", "StoreFullError",
    "StoreWriter", "check_parts", "export", "merge_stores", "open_store",
]
