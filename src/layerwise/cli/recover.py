"""``layerwise recover STORE``: rebuild a deleted or damaged manifest from the store's shards and say what they
prove."""

from __future__ import annotations

import typer

from .options import err_console, user_errors


def recover(
    store: str = typer.Argument(..., help="A store directory whose manifest.json is missing or damaged."),
) -> None:
    """Rebuild a store's manifest.json from its shards (their store id, index, line range, run description, seal).

    Prints the new manifest's contents, what the shards proved, what they could not prove (whether the run had
    finished: rerun the extract command to finish it) and each shard file left out, with why. Exit code 0: rebuilt;
    2: nothing to recover (a readable manifest), not a store directory, or no shard proves itself.
    """
    from ..store.recover import recover_store

    with user_errors():
        report = recover_store(store)
    say = err_console.print
    say(f"recovered: {report.summary()}", highlight=False, soft_wrap=True)
    for line in report.proven:
        say(f"proven: {line}", highlight=False, soft_wrap=True)
    for line in report.not_proven:
        say(f"[yellow]not proven:[/yellow] {line}", highlight=False, soft_wrap=True)
    for line in report.left_out:
        say(f"[yellow]not listed:[/yellow] {line}", highlight=False, soft_wrap=True)
