"""``layerwise cache``: the graph cache's entries (size, last use, the processes holding them), the temporary files of
builds and of dead processes, and the total on disk; ``--clear`` empties it of all but what live processes hold."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import typer

from .options import user_errors


def _when(seconds: float, fmt: str = "%Y-%m-%d %H:%M") -> str:
    return time.strftime(fmt, time.localtime(seconds))


def cache(
    clear: bool = typer.Option(False, "--clear", help="Remove every cached graph that no running process holds, "
                                                      "races.json, and the temporary files of dead processes."),
    directory: Optional[str] = typer.Option(
        None, "--dir", help="The cache directory (default: $LAYERWISE_CACHE/onnx, else ~/.cache/layerwise/onnx)."),
    as_json: bool = typer.Option(False, "--json", help="Print the entries as JSON."),
) -> None:
    """List the graph cache (exported and compiled graphs, least recently used first, with the processes holding them),
    the temporary files of builds (those of dead processes counted apart) and the total on disk, with the limit;
    --clear empties it. It is trimmed to its limit (LAYERWISE_CACHE_LIMIT, default 5x the model's weights) after each
    build, never evicting a graph a running process holds."""
    from rich.console import Console
    from rich.table import Table

    from ..model.backends.cache import LIMIT_FLOOR, LIMIT_TIMES, GraphCache
    from ..model.backends.ort import cache_dir
    from ..model.memory import human, parse_size

    with user_errors():
        root = cache_dir(directory)
        graphs = GraphCache(root)
        if clear:
            cleared = graphs.clear()
            left = human(sum(t.bytes for t in cleared.temps))
            typer.echo(f"removed {len(cleared.entries)} cached graphs ({human(sum(e.bytes for e in cleared.entries))}) "
                       f"and {len(cleared.temps)} temporary files of dead processes ({left}) from {root}")
            if cleared.in_use:
                pids = sorted({p for e in cleared.in_use for p in e.holders})
                typer.echo(f"kept {len(cleared.in_use)} in use by running processes ({', '.join(map(str, pids))}): "
                           f"{human(sum(e.bytes for e in cleared.in_use))}")
            return
        survey = graphs.survey()
        limit_text = os.environ.get("LAYERWISE_CACHE_LIMIT", "").strip()
        limit = (f"{human(parse_size(limit_text, 'LAYERWISE_CACHE_LIMIT'))} (LAYERWISE_CACHE_LIMIT)" if limit_text else
                 f"{LIMIT_TIMES}x the weights of the model being built, at least {human(LIMIT_FLOOR)}")
        entries_bytes = sum(e.bytes for e in survey.entries)
        dead = [t for t in survey.temps if t.dead]
        if as_json:
            print(json.dumps({
                "directory": str(root), "bytes": survey.bytes, "entries_bytes": entries_bytes, "limit": limit,
                "entries": [{"name": e.name, "bytes": e.bytes, "last_used": _when(e.used, "%Y-%m-%dT%H:%M:%S"),
                             "held_by": e.holders, "files": [str(f) for f in e.files]} for e in survey.entries],
                "temporary": [{"path": str(t.path), "bytes": t.bytes, "pid": t.pid, "dead": t.dead}
                              for t in survey.temps],
                "dead_bytes": sum(t.bytes for t in dead),
                "kept": [str(p) for p in survey.kept], "other": [str(p) for p in survey.others],
            }, indent=2))
            return
        table = Table(title=f"layerwise graph cache {root}")
        for column in ("entry", "size", "last used", "held by"):
            table.add_column(column)
        for e in survey.entries:
            table.add_row(e.name, human(e.bytes), _when(e.used), ", ".join(map(str, e.holders)) or "-")
        for t in survey.temps:
            owner = "an earlier version" if t.pid is None else f"process {t.pid}"
            state = f"left by {owner}, dead" if t.dead else f"being written by {owner}"
            table.add_row(t.path.name, human(t.bytes), "-", state)
        console = Console()
        console.print(table)
        parts = [f"{len(survey.entries)} entries, {human(entries_bytes)}"]
        if dead:
            parts.append(f"{len(dead)} temporary files of dead processes, {human(sum(t.bytes for t in dead))} "
                         f"(removed by --clear and the next build)")
        if survey.kept or survey.others:
            parts.append(f"{len(survey.kept) + len(survey.others)} other files "
                         f"({', '.join(p.name for p in [*survey.kept, *survey.others][:3])})")
        console.print(f"{'; '.join(parts)}; {human(survey.bytes)} on disk; limit {limit}", highlight=False)
