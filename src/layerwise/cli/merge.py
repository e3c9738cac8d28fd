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
    link: bool = typer.Option(
        False, "--link", help="Copy nothing: write a store at -o that lists the parts and reads them as one."
    ),
) -> None:
    """Check that the parts belong to one run (input, model, options, every index once) and write one store (or,
    with --link, a store that lists them); given one store of parts (a Ray run), compact it into one."""
    from ..store import link_parts, merge_stores

    with user_errors():
        summary = (link_parts if link else merge_stores)(parts, output, overwrite=overwrite)
    what = "linked" if link else "merged"
    err_console.print(
        f"{what} {summary.parts} parts: {summary.records:,} records, {summary.skipped:,} skipped, "
        f"{summary.shards} shard{'s' if summary.shards != 1 else ''} -> {output}"
    )
