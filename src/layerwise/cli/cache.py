"""``layerwise cache``: the graph cache's entries, sizes and last use, and ``--clear`` to empty it."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import typer

from .options import user_errors


def cache(
    clear: bool = typer.Option(False, "--clear", help="Remove every cached graph (and races.json)."),
    directory: Optional[str] = typer.Option(
        None, "--dir", help="The cache directory (default: $LAYERWISE_CACHE/onnx, else ~/.cache/layerwise/onnx)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON."),
) -> None:
    """List the graph cache (exported and converted graphs, least recently used first) with its size and limit; --clear
    empties it. It is trimmed to its limit (LAYERWISE_CACHE_LIMIT, default 3x the model's weights) after each build."""
    from rich.console import Console
    from rich.table import Table

    from ..model.backends.cache import LIMIT_FLOOR, LIMIT_TIMES, GraphCache
    from ..model.backends.ort import cache_dir
    from ..model.memory import human, parse_size

    with user_errors():
        root = cache_dir(directory)
        graphs = GraphCache(root)
        if clear:
            removed = graphs.clear()
            typer.echo(f"removed {len(removed)} cached graphs ({human(sum(e.bytes for e in removed))}) from {root}")
            return
        entries = graphs.entries()
        limit_text = os.environ.get("LAYERWISE_CACHE_LIMIT", "").strip()
        limit = (f"{human(parse_size(limit_text, 'LAYERWISE_CACHE_LIMIT'))} (LAYERWISE_CACHE_LIMIT)" if limit_text else
                 f"{LIMIT_TIMES}x the weights of the model being built, at least {human(LIMIT_FLOOR)}")
        total = sum(e.bytes for e in entries)
        if as_json:
            print(json.dumps({"directory": str(root), "bytes": total, "limit": limit, "entries": [
                {"name": e.name, "bytes": e.bytes, "last_used": time.strftime("%Y-%m-%dT%H:%M:%S",
                                                                               time.localtime(e.used)),
                 "files": [str(f) for f in e.files]} for e in entries]}, indent=2))
            return
        table = Table(title=f"layerwise graph cache {root}")
        for column in ("entry", "size", "last used"):
            table.add_column(column)
        for e in entries:
            table.add_row(e.name, human(e.bytes), time.strftime("%Y-%m-%d %H:%M", time.localtime(e.used)))
        console = Console()
        console.print(table)
        console.print(f"{len(entries)} entries, {human(total)}; limit {limit}", highlight=False)
