"""``layerwise serve``: an HTTP service for layer features with dynamic batching, and its Python client."""

from .app import EncodeRequest, Limits, create_app
from .client import Client, ServiceError


def serve(extractor, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits | None = None,
          log_level: str = "info") -> None:
    """Run the service with uvicorn until interrupted (binds 127.0.0.1 unless told otherwise)."""
    import uvicorn

    uvicorn.run(create_app(extractor, limits), host=host, port=port, log_level=log_level)


__all__ = ["Client", "EncodeRequest", "Limits", "ServiceError", "create_app", "serve"]
