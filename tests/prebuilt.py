"""Environments that some tests build with pip (Infinity's, the demo's), started in a background thread as soon as
the session has collected those tests, so that their minutes of package installation overlap the rest of the suite
instead of adding to it. One build at a time; a test waits for its own (:func:`wait`), and gets what the build
returned or raised, as if it had built it itself."""

from __future__ import annotations

import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import session_tmp

_POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="layerwise-prebuild")
_BUILDS: dict[str, Future] = {}
_ROOT = session_tmp.ROOT / "prebuilt"


def start(name: str, build: Callable[[Path], Any]) -> None:
    """Queue ``build(directory)`` (a new directory of its own) under ``name``, once."""
    if name not in _BUILDS:
        directory = _ROOT / name
        directory.mkdir(parents=True)
        _BUILDS[name] = _POOL.submit(build, directory)


def wait(name: str, build: Callable[[Path], Any]) -> Any:
    """What ``build`` returned for ``name`` (queued now if it was not), waiting for it."""
    start(name, build)
    return _BUILDS[name].result()


def clean() -> None:
    """Wait for the builds still running, then remove their directories (the session's end)."""
    _POOL.shutdown(wait=True, cancel_futures=True)
    shutil.rmtree(_ROOT, ignore_errors=True)
