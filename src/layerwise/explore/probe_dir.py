"""A ``layerwise probe`` output directory, read for the explorer's probe view.

The directory holds ``results.json`` (written by :func:`layerwise.probe.report.write_all`): every probe's dev (and
test) score with its spread over restarts, the linear-CKA similarity between layers, the options and provenance.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import LayerwiseError

REQUIRED = ("task_title", "metric_name", "rows", "cka")


def read_probe_dir(path: str | os.PathLike) -> dict:
    """The probe view's data: title, metric, rows (single layers and strategies), CKA, options, provenance.

    Raises:
        ValueError: not a directory written by ``layerwise probe`` (no or an unreadable ``results.json``).
    """
    folder = Path(path).expanduser()
    results = folder / "results.json"
    if not results.is_file():
        raise LayerwiseError(f"{os.fspath(path)!r} is not a layerwise probe output directory (no results.json); "
                         f"make one with: layerwise probe TRAIN --dev DEV -o DIR")
    try:
        data = json.loads(results.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise LayerwiseError(f"cannot read {results}: {exc}") from exc
    missing = [k for k in REQUIRED if k not in data]
    if missing:
        raise LayerwiseError(f"{results} lacks {', '.join(missing)}: not written by layerwise probe")
    rows = data["rows"]
    layers = [r for r in rows if r.get("kind") == "layer"]
    return {
        "name": folder.resolve().name, "title": data["task_title"], "metric": data["metric_name"],
        "restarts": data.get("restarts", 1), "rows": rows, "cka": data["cka"],
        "cka_labels": ["emb" if r["layers"][0] == 0 else str(r["layers"][0]) for r in layers]
        if len(layers) == len(data["cka"]) else [str(i) for i in range(len(data["cka"]))],
        "options": data.get("options", {}), "provenance": data.get("provenance", {}),
    }


__all__ = ["read_probe_dir"]
