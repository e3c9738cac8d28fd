"""Who may call the service: an API key (Bearer) on every route but ``/health`` and ``/ready``, and a ``Host:``
allowlist against DNS rebinding (a web page in the user's browser reaching a server on their loopback through a name
it controls).

``layerwise serve`` binds 127.0.0.1 and allows only loopback names unless told otherwise; ``--api-key`` (or
``LAYERWISE_API_KEY``) turns on the key, as TEI's ``--api-key`` does; binding beyond loopback without a key prints a
warning.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from .errors import error_response

API_KEY_ENV = "LAYERWISE_API_KEY"
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")
OPEN_ROUTES = ("/health", "/ready")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the service on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(host: str, given: list[str] | None) -> list[str]:
    """The ``Host:`` names to answer: ``given``; else loopback names for a loopback bind, else any (``*``)."""
    if given:
        return list(given)
    return list(LOOPBACK_NAMES) if is_loopback(host) else ["*"]


def api_key_from(given: str | None) -> str | None:
    """The API key: ``given``, else ``$LAYERWISE_API_KEY``, else none."""
    return given or os.environ.get(API_KEY_ENV) or None


class ApiKey:
    """ASGI middleware: 401 (in the route's protocol shape) unless ``Authorization: Bearer KEY``."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("path") in OPEN_ROUTES:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key):
            return await self.app(scope, receive, send)
        message = ("missing or wrong API key: send the header 'Authorization: Bearer <key>' (the openai client: "
                   "api_key=<key>; huggingface_hub: token=<key>)")
        response = error_response(scope, 401, message, headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


__all__ = ["API_KEY_ENV", "ApiKey", "api_key_from", "default_allowed_hosts", "is_loopback"]
