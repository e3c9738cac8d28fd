"""The feature store's on-disk format: layout, the writer of a store directory, the reader, exporters.

This package knows files only; it imports nothing that computes features. Extraction into a store (streaming,
resume, bad records, progress) is the engine's job: :func:`layerwise.extract` in :mod:`layerwise.extraction.engine`.

See :mod:`layerwise.store.layout` for the layout, :mod:`layerwise.store.manifest` for the manifest (the single
source of truth about a store's shards), :mod:`layerwise.store.integrity` for the checks, :class:`StoreWriter` to
write one, :func:`open_store` to read one, :func:`verify_store` to check every byte and :func:`export` to convert
one.
"""

from ..errors import StoreCorruptError, StoreError, StoreFullError
from .export import EXPORT_FORMATS, export
from .integrity import VerifyReport, verify_store
from .layout import FORMAT_VERSION, STORE_DTYPES
from .merge import MergeSummary, check_parts, link_parts, merge_stores
from .reader import FeatureStore, StoreWarning, open_store
from .writer import StoreWriter

__all__ = [
    "EXPORT_FORMATS", "FORMAT_VERSION", "FeatureStore", "MergeSummary", "STORE_DTYPES", "StoreCorruptError",
    "StoreError", "StoreFullError", "StoreWarning", "StoreWriter", "VerifyReport", "check_parts", "export",
    "link_parts", "merge_stores", "open_store", "verify_store",
]
