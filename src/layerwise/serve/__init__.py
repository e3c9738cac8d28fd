"""``layerwise serve``: an HTTP service for layer features with dynamic batching (FastAPI + uvicorn).

Its Python client, :class:`layerwise.Client`, lives in :mod:`layerwise.client` (standard library only), so
``import layerwise`` never loads the web stack.
"""

from ..client import Client, ServiceError
from ..extractor import Extractor
from .app import EncodeRequest, Limits, create_app


def serve(extractor: Extractor, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          log_level: str = "info") -> None:
    """Run the service with uvicorn until interrupted (binds 127.0.0.1 unless told otherwise)."""
    import uvicorn

    uvicorn.run(create_app(extractor, limits), host=host, port=port, log_level=log_level)


__all__ = ["Client", "EncodeRequest", "Limits", "ServiceError", "create_app", "serve"]
