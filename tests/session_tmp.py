"""The test session's own temporary folder, named with the session's process id: the exported-graph cache
(``LAYERWISE_CACHE``) and the pip-built environments (:mod:`prebuilt`) live in it, and it is removed when the
session ends. A session that was killed (``kill -9``, a crash, CI's time limit) cannot remove its own: the next
session removes every such folder whose process is gone (:func:`sweep`), so killed runs do not fill the disk
(in November 2026 they had left 29 GB in /tmp)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from layerwise.model.backends.filelock import pid_alive

PREFIX = "layerwise-tests-"


def sweep(parent: Path | None = None) -> list[Path]:
    """Remove the session folders under ``parent`` (the temp dir) whose session's process is gone; the removed."""
    removed = []
    for folder in Path(parent or tempfile.gettempdir()).glob(PREFIX + "*"):
        pid = folder.name[len(PREFIX):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


sweep()
ROOT = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))


def clean() -> None:
    """Remove this session's folder (the session's end)."""
    shutil.rmtree(ROOT, ignore_errors=True)
