"""``layerwise merge PART... -o OUT``: join the part stores of a sharded extraction into one store, or compact a
store of parts (a Ray run) into one."""

from __future__ import annotations

from typing import List

import typer

from .options import err_console, user_errors


def merge(
    parts: List[str] = typer.Argument(..., help="The part stores (extract --num-shards N --shard-index I), any order."),
    output: str = typer.Option(..., "--output", "-o", help="The merged store's directory."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a store made with other options at -o."),
) -> None:
    """Check that the parts belong to one run (input, model, options, every index once) and write one store."""
    from ..store import merge_stores

    with user_errors():
        summary = merge_stores(parts, output, overwrite=overwrite)
    err_console.print(
        f"merged {summary.parts} parts: {summary.records:,} records, {summary.skipped:,} skipped, "
        f"{summary.shards} shard{'s' if summary.shards != 1 else ''} -> {output}"
    )
