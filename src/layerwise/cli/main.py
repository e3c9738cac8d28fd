"""``layerwise`` command: subcommands are registered from their own modules."""

from __future__ import annotations

import typer

from ..version import __version__
from . import (
    demo,
    encode,
    evaluate,
    explore,
    export,
    export_model,
    extract,
    inspect,
    merge,
    predict,
    probe,
    serve,
    train,
    verify,
)
from .options import DEBUG_ENV, set_debug


def _version(value: bool) -> None:
    if value:
        typer.echo(f"layerwise {__version__}")
        raise typer.Exit(0)


app = typer.Typer(
    name="layerwise",
    help="Every hidden layer of a transformer encoder as features. Layer 0 is the embeddings; -1 the last layer.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback(invoke_without_command=False)
def global_options(
    ctx: typer.Context,
    debug: bool = typer.Option(
        False, "--debug", help=f"Print the full traceback of any error (before the command: layerwise --debug "
                               f"extract ...). Same as {DEBUG_ENV}=1.",
    ),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """Global options, given before the subcommand."""
    set_debug(ctx, debug)


app.command("demo")(demo.demo)
app.command("encode")(encode.encode)
app.command("extract")(extract.extract)
app.command("inspect")(inspect.inspect)
app.command("verify")(verify.verify)
app.command("merge")(merge.merge)
app.command("export")(export.export)
app.command("export-model")(export_model.export_model)
app.command("train")(train.train)
app.command("evaluate")(evaluate.evaluate)
app.command("predict")(predict.predict)
app.command("probe")(probe.probe)
app.command("serve")(serve.serve)
app.command("explore")(explore.explore)

if __name__ == "__main__":  # pragma: no cover
    app()
