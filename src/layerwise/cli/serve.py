"""``layerwise serve``: the HTTP service (FastAPI + uvicorn) with dynamic batching."""

from __future__ import annotations

import typer

from ..errors import LayerwiseError
from ..model.options import ModelOptions
from .options import err_console, extractor, model_flags, user_errors


@model_flags
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (default loopback only)."),
    port: int = typer.Option(8000, "--port", help="TCP port, 1..65535."),
    max_batch_tokens: int = typer.Option(16384, "--max-batch-tokens", help="Token budget of one merged batch."),
    max_texts: int = typer.Option(256, "--max-texts", help="Most texts in one request (more: 422)."),
    max_text_chars: int = typer.Option(20000, "--max-text-chars", help="Longest text in characters (longer: 422)."),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", help="Largest request body (larger: 413)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    *,
    model_options: ModelOptions,
) -> None:
    """Serve POST /v1/encode, GET /v1/model, /health, /metrics and OpenAPI docs at /docs."""
    from ..serve import Limits
    from ..serve import serve as run

    with user_errors():
        if not 1 <= port <= 65535:
            raise LayerwiseError(f"--port {port} is not a TCP port; give one in 1..65535 (e.g. --port 8000)")
        limits = Limits(max_texts=max_texts, max_text_chars=max_text_chars, max_body_bytes=max_body_bytes,
                        max_batch_tokens=max_batch_tokens)
        ex = extractor(model_options)
    err_console.print(f"layerwise serving {ex!r} on http://{host}:{port} (docs at /docs)", highlight=False)
    run(ex, host=host, port=port, limits=limits, log_level=log_level)
