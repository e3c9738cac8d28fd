"""``layerwise verify STORE``: check every byte of a store against its manifest (exit 0 intact, 1 damaged)."""

from __future__ import annotations

import typer

from .options import err_console, user_errors


def verify(
    store: str = typer.Argument(..., help="A store directory written by layerwise extract or merge."),
) -> None:
    """Check a store: every listed shard's size, header, sha256 and inner consistency.

    Prints one line per problem, naming the file. Exit code 0: intact; 1: damaged (rerun the extract command to
    repair it by resuming, or restore the named files from a copy); 2: not a store.
    """
    from ..store import verify_store

    with user_errors():
        report = verify_store(store)
    for problem in report.problems:
        print(f"{store}: {problem}")
    for note in report.notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if report.ok:
        shards, records = (f"{n:,} {what}{'s' if n != 1 else ''}" for n, what in
                           ((report.shards, "shard"), (report.records, "record")))
        err_console.print(f"{store}: intact ({shards}, {records})", highlight=False, soft_wrap=True)
        return
    err_console.print(f"{store}: damaged ({len(report.problems)} problem{'s' if len(report.problems) != 1 else ''}); "
                      f"rerun the extract command to repair it (a resume recomputes from the first damaged shard), "
                      f"or restore the named files from a copy", highlight=False, soft_wrap=True)
    raise typer.Exit(1)
