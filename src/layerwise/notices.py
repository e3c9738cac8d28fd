"""What layerwise says on stderr about its one-time work: an export or conversion and its time, the runtime that takes
over a depth and why. Said once, as ``layerwise: ...`` lines, so a slow first call is never silent.

Silenced by :func:`set_quiet` (the CLI's ``-q``/``--quiet``) or ``LAYERWISE_QUIET=1``; each line also goes to the
``layerwise`` logger at INFO, for applications that collect logs.

Example::

    >>> notice("exported bert (layers 0..6) to ONNX in 3.1 s")   # doctest: +SKIP
    layerwise: exported bert (layers 0..6) to ONNX in 3.1 s
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("layerwise")
_quiet = False


def set_quiet(quiet: bool = True) -> None:
    """Say nothing on stderr from now on (``True``), or again (``False``)."""
    global _quiet
    _quiet = quiet


def quiet() -> bool:
    """Whether notices are silenced (:func:`set_quiet`, or ``LAYERWISE_QUIET`` set to anything but ``0``/empty)."""
    return _quiet or os.environ.get("LAYERWISE_QUIET", "0") not in ("", "0")


def notice(message: str) -> None:
    """Say ``message`` on stderr as ``layerwise: message`` (unless quiet), and log it at INFO."""
    log.info(message)
    if not quiet():
        print(f"layerwise: {message}", file=sys.stderr, flush=True)


__all__ = ["notice", "quiet", "set_quiet"]
