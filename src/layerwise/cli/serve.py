"""``layerwise serve``: the HTTP service (FastAPI + uvicorn) with dynamic batching."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..errors import LayerwiseError
from ..model.options import ModelOptions
from .options import err_console, extractor, model_flags, parse_layers, user_errors


@model_flags
def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to bind (default loopback only)."),
    port: int = typer.Option(8000, "--port", help="TCP port, 1..65535."),
    max_batch_tokens: int = typer.Option(16384, "--max-batch-tokens", help="Token budget of one merged batch."),
    max_texts: int = typer.Option(256, "--max-texts", help="Most texts in one request (more: 422)."),
    max_text_chars: int = typer.Option(20000, "--max-text-chars", help="Longest text in characters (longer: 422)."),
    max_body_bytes: int = typer.Option(4 << 20, "--max-body-bytes", help="Largest request body (larger: 413)."),
    max_response_bytes: int = typer.Option(
        64 << 20, "--max-response-bytes", help="Largest answer, estimated before any compute (larger: 413)."),
    max_queue_tokens: int = typer.Option(
        262144, "--max-queue-tokens", help="Most estimated tokens waiting; more: 429 with Retry-After."),
    max_request_tokens: int = typer.Option(
        131072, "--max-request-tokens", help="Most estimated tokens one request may run through the model (windows "
        "of long texts included); more: 413. A large request runs in turns with the others, a batch at a time."),
    cors_origin: Optional[List[str]] = typer.Option(
        None, "--cors-origin", help="A web origin (https://app.example, or '*') whose pages may call the service "
        "from a browser (CORS; repeatable). None by default: browsers keep other sites' pages out."),
    header_timeout: float = typer.Option(
        10.0, "--header-timeout", help="Seconds a client has to send a request's line and headers, from the "
        "connection's opening (or a later request's first byte); then 408 and close (an idle one: just close)."),
    body_timeout: float = typer.Option(
        30.0, "--body-timeout", help="Seconds a client has to send a request's whole body once its headers are in "
        "(a deadline, not an idle time); then 408 and close."),
    keep_alive_timeout: float = typer.Option(
        5.0, "--keep-alive-timeout", help="Seconds an idle connection is kept open after an answer."),
    send_timeout: float = typer.Option(
        30.0, "--send-timeout", help="Seconds a client may read nothing of an answer before it is dropped and the "
        "answer's memory freed (a slow reader that keeps reading is served)."),
    max_unsent_bytes: int = typer.Option(
        64 << 20, "--max-unsent-bytes", help="Most bytes of answers held for clients at once (being made, or waiting "
        "in send buffers); a request that would pass it: 503 with Retry-After. At least --max-response-bytes."),
    max_connections: int = typer.Option(
        1024, "--max-connections", help="Most open connections; one more is answered 503 (Retry-After: 1) and "
        "closed before its request is read."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
    alias: Optional[List[str]] = typer.Option(
        None, "--alias", help="NAME='layers=3;pool=mean': a model name that picks a spec (OpenAI clients set "
        "model=NAME); repeatable."),
    aliases_file: Optional[str] = typer.Option(
        None, "--aliases", help="A JSON or TOML file of aliases: {name: {field: value}}."),
    probe: Optional[List[str]] = typer.Option(
        None, "--probe", help="A layerwise probe output directory the explorer page shows (repeatable)."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", help="Require 'Authorization: Bearer KEY' on every route but /health (or set "
        "LAYERWISE_API_KEY)."),
    allowed_hosts: Optional[List[str]] = typer.Option(
        None, "--allowed-hosts", help="Host: names to answer (repeatable; default: loopback names when bound to "
        "loopback, any otherwise)."),
    warm: Optional[List[str]] = typer.Option(
        None, "--warm", help="Layers whose depth is prepared at start, besides the default request's (the last "
        "layer): repeatable, any layer spec ('3', '-4:', 'all'). GET /ready answers 200 once they are; requests are "
        "answered meanwhile."),
    *,
    model_options: ModelOptions,
) -> None:
    """Serve layerwise's API (POST /v1/encode), OpenAI's (POST /v1/embeddings, GET /v1/models) and TEI's (POST
    /embed, /, /embed_all, /tokenize, GET /info), /health, /ready, /metrics and OpenAPI docs at /docs.

    --max-memory is the server's memory ceiling: a request that would take the process past it is shed with 503 and
    Retry-After (default: what it holds at start plus 90% of what it may still take); the weights are fit under it
    too."""
    from ..serve import ConnectionLimits, Limits
    from ..serve import serve as run
    from ..serve.security import api_key_from, default_allowed_hosts

    with user_errors():
        if not 1 <= port <= 65535:
            raise LayerwiseError(f"--port {port} is not a TCP port; give one in 1..65535 (e.g. --port 8000)")
        limits = Limits(max_texts=max_texts, max_text_chars=max_text_chars, max_body_bytes=max_body_bytes,
                        max_batch_tokens=max_batch_tokens, max_response_bytes=max_response_bytes,
                        max_queue_tokens=max_queue_tokens, max_request_tokens=max_request_tokens,
                        max_unsent_bytes=max_unsent_bytes, max_memory=model_options.max_memory)
        connections = ConnectionLimits(header_timeout=header_timeout, body_timeout=body_timeout,
                                       keep_alive_timeout=keep_alive_timeout, max_connections=max_connections,
                                       send_timeout=send_timeout)
        origins = check_origins(cors_origin or [])  # said before the model loads
        named = _aliases(aliases_file, alias or [])
        ex = extractor(model_options)
        from ..serve import create_app

        key = api_key_from(api_key)
        hosts = default_allowed_hosts(host, allowed_hosts)
        from ..explore import Explorer
        from ..explore.probe_dir import read_probe_dir

        for folder in probe or []:
            read_probe_dir(folder)  # a wrong directory is said now, not in the browser
        explorer = Explorer(extractor=ex, probe_dirs=list(probe or []))
        app = create_app(ex, limits, explorer, aliases=named, api_key=key, allowed_hosts=hosts,
                         warm=[parse_layers(w) for w in warm or []],  # a bad alias or --warm: said now
                         cors_origins=origins)
    _say_serving(ex, host, port, key, named, app.state.service.ceilings)
    run(app, host=host, port=port, log_level=log_level, connections=connections)


def check_origins(origins: list[str]) -> list[str]:
    """``--cors-origin`` values: ``*`` or ``scheme://host[:port]`` (no path), else a :class:`LayerwiseError`."""
    from urllib.parse import urlsplit

    for origin in origins:
        parts = urlsplit(origin)
        if origin != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path
                              or parts.query or parts.fragment):
            raise LayerwiseError(f"--cors-origin {origin!r} is not a web origin; give scheme://host[:port] with no "
                                 f"path (e.g. --cors-origin https://app.example), or '*' for any")
    return origins


def _aliases(aliases_file: str | None, given: list[str]) -> dict[str, dict]:
    """The aliases of ``--aliases FILE`` and of each ``--alias NAME='...'`` (later ones win)."""
    from ..serve.aliases import load_aliases, parse_alias

    named = load_aliases(aliases_file) if aliases_file else {}
    for text in given:
        name, fields = parse_alias(text)
        named[name] = fields
    return named


def _say_serving(ex, host: str, port: int, key: str | None, named: dict[str, dict], ceilings=None) -> None:
    """What is served where, the aliases, the memory ceiling, and the warnings a user must see before the first
    request: no API key beyond loopback, weights streamed block by block, a ceiling already passed."""
    from ..model.memory import human, resident_bytes
    from ..serve.security import is_loopback

    if not is_loopback(host) and not key:
        err_console.print(f"[bold yellow]warning:[/bold yellow] serving on {host} without an API key: anyone who can "
                          f"reach this machine can use the model. Pass --api-key (or set LAYERWISE_API_KEY), or bind "
                          f"127.0.0.1", highlight=False, soft_wrap=True)
    err_console.print(f"layerwise serving {ex!r} on http://{host}:{port} (docs at /docs)", highlight=False)
    for name, fields in named.items():
        err_console.print(f"alias {name}: {fields}", highlight=False)
    if ceilings is not None and ceilings.max_memory:
        rss = resident_bytes()
        err_console.print(f"memory ceiling {human(ceilings.max_memory)} ({ceilings.source}); {human(rss)} resident "
                          f"now; answers held for clients at most {human(ceilings.max_unsent_bytes)}", highlight=False,
                          soft_wrap=True)
        if rss >= ceilings.max_memory:
            err_console.print(f"[bold yellow]warning:[/bold yellow] the server already holds {human(rss)}, at or "
                              f"over --max-memory {human(ceilings.max_memory)}: every request will be shed with 503; "
                              f"raise --max-memory", highlight=False, soft_wrap=True)
    weights = ex.describe()["weights"]
    if weights.get("streamed"):
        err_console.print(f"[bold yellow]note:[/bold yellow] the weights exceed --max-memory "
                          f"({weights['max_memory']:,} bytes): requests for layers whose blocks do not fit run block "
                          f"by block, reading each block from the checkpoint per request batch. This is a throughput "
                          f"mode: expect seconds per request; raise --max-memory or bound --max-layer for latency",
                          highlight=False, soft_wrap=True)
