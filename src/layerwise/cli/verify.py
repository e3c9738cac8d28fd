"""``layerwise verify STORE [--repair]``: check every byte of a store against its manifest (exit 0 intact, 1
damaged); ``--repair`` fixes what needs no model run."""

from __future__ import annotations

import typer

from .options import err_console, user_errors


def _advice(store: str) -> str:
    """What to do about a damaged store: ``--repair`` when that fixes it without a model, else the resume."""
    from ..errors import StoreError
    from ..store.repair import repair_store

    try:
        plan = repair_store(store, dry_run=True)
    except StoreError:
        return ("rerun the extract command to repair it (a resume checks every shard and recomputes from the first "
                "damaged one), or restore the named files from a copy")
    if plan.complete and plan.fixed:
        return f"layerwise verify --repair {store} fixes it without a model run ({'; '.join(plan.fixed)})"
    return (f"rerun the extract command to repair it ({plan.needs_model[-1] if plan.needs_model else 'a resume'}; "
            f"it checks every shard and recomputes from the first damaged one), or restore the named files from a copy")


def verify(
    store: str = typer.Argument(..., help="A store directory written by layerwise extract or merge."),
    repair: bool = typer.Option(
        False, "--repair",
        help="Fix what needs no model run (a listing the shards contradict, finished shards not yet listed, a dead "
             "writer's lock and temporary files), then check again; say what needs the extract command.",
    ),
) -> None:
    """Check a store: every listed shard's size, header, sha256 and inner consistency.

    Prints one line per problem, naming the file (-q: nothing else). Exit code 0: intact; 1: damaged (``--repair``
    fixes what the shards still prove without a model run; a shard whose bytes changed is recomputed by rerunning the
    extract command, whose resume checks every shard); 2: not a store.
    """
    from ..store import verify_store
    from ..store.activations import is_activation_store

    if is_activation_store(store):
        activations(store)
        return
    with user_errors():
        if repair:
            from ..store.repair import repair_store

            done = repair_store(store)
            for line in done.fixed:
                err_console.print(f"[yellow]repaired:[/yellow] {line}", highlight=False, soft_wrap=True)
            if not done.fixed:
                err_console.print("nothing to repair without a model run", highlight=False, soft_wrap=True)
        report = verify_store(store)
    for problem in report.problems:
        print(f"{store}: {problem}")
    from ..notices import quiet

    for note in [] if quiet() else report.notes:
        err_console.print(f"note: {note}", highlight=False, soft_wrap=True)
    if report.ok and quiet():  # -q: the exit status says it
        return
    if report.ok:
        shards, records = (f"{n:,} {what}{'s' if n != 1 else ''}" for n, what in
                           ((report.shards, "shard"), (report.records, "record")))
        by = f"; computed by {', '.join(report.runtimes)}" if report.runtimes else ""
        err_console.print(f"{store}: intact ({shards}, {records}){by}", highlight=False, soft_wrap=True)
        return
    err_console.print(f"{store}: damaged ({len(report.problems)} problem{'s' if len(report.problems) != 1 else ''}); "
                      f"{_advice(store)}", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def activations(store: str) -> None:
    """``verify`` of a token-activation store: every listed shard's sha256 (exit 1 when one differs)."""
    from ..notices import quiet
    from ..store.activations import ActivationStore

    with user_errors():
        acts = ActivationStore(store)
        problems = acts.verify()
    for problem in problems:
        print(f"{store}: {problem}")
    if problems:
        err_console.print(f"{store}: damaged ({len(problems)} problem{'s' if len(problems) != 1 else ''}); rerun the "
                          f"extract command to recompute from the first damaged shard", highlight=False, soft_wrap=True)
        raise typer.Exit(1)
    if not quiet():
        runtime = (acts.manifest.get("runtime") or {}).get("name", "-")
        err_console.print(f"{store}: intact ({len(acts.entries):,} shards, {acts.num_contexts:,} contexts, "
                          f"{acts.num_tokens:,} tokens); computed by {runtime}", highlight=False, soft_wrap=True)
