"""``layerwise`` command: each subcommand lives in its own module, imported only when that command runs (or its own
``--help`` is asked), so ``layerwise --help`` imports no model code (no torch, no transformers)."""

from __future__ import annotations

import importlib
from typing import Any

import typer
from typer.core import TyperCommand, TyperGroup

from ..version import __version__
from .options import DEBUG_ENV, set_debug

# name -> (module, function, the line `layerwise --help` shows: the start of the command's own docstring)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("demo", "demo", "Encode the bundled sample sentences with every layer and print a per-layer summary."),
    "encode": ("encode", "encode", "Encode TEXTs with the chosen layers, combination and pooling; print JSON / JSON "
                                   "lines or write .npy."),
    "extract": ("extract", "extract", "Extract features for every record of INPUT into the store OUTPUT; rerun the "
                                      "same command to resume."),
    "inspect": ("inspect", "inspect", "Print a store's provenance, counts, sizes and a few records."),
    "verify": ("verify", "verify", "Check a store: every listed shard's size, header, sha256 and inner consistency."),
    "recover": ("recover", "recover", "Rebuild a store's manifest.json from its shards (their store id, index, line "
                                      "range, run description, seal)."),
    "merge": ("merge", "merge", "Check that the parts belong to one run (input, model, options, every index once) "
                                "and write one store"),
    "export": ("export", "export", "Convert a store to npy, hdf5 or parquet (streamed, shard by shard)."),
    "export-model": ("export_model", "export_model", "Write layer K of MODEL as a Hugging Face directory that is "
                                                     "also a sentence-transformers model"),
    "train": ("train", "train", "Train a classifier on hidden layers; prints one line per epoch and the final "
                                "dev/test scores."),
    "evaluate": ("evaluate", "evaluate", "Score a trained model on a labelled file."),
    "predict": ("predict", "predict", "Predict every record of FILE; bad records get {\"line\": N, \"error\": "
                                      "\"...\"} lines, order kept."),
    "probe": ("probe", "probe", "Which layer knows what: one probe per layer and per strategy, from features "
                                "extracted once."),
    "serve": ("serve", "serve", "Serve layerwise's API (POST /v1/encode), OpenAI's (POST /v1/embeddings, GET "
                                "/v1/models) and TEI's"),
    "cache": ("cache", "cache", "List the graph cache (exported and converted graphs, least recently used first) "
                                "with its size and limit"),
    "explore": ("explore", "explore", "Open the layer explorer at http://127.0.0.1:8765 (works offline: nothing is "
                                      "fetched from the network)."),
}


def command(name: str) -> Any:
    """The click command of subcommand ``name`` (its module imported now)."""
    module, function, _ = COMMANDS[name]
    found = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    one.command(name)(found)
    return typer.main.get_command(one)


class Commands(TyperGroup):
    """The subcommands of :data:`COMMANDS`, each imported when it is looked up to run; the group's own help lists
    them from the table, importing none."""

    listing = False

    def list_commands(self, ctx: Any) -> list[str]:
        """Every subcommand's name, in the table's order."""
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """Subcommand ``cmd_name`` (``None`` when there is none): a stand-in with its help line while the group's
        help is written, else the command itself."""
        if cmd_name not in COMMANDS:
            return None
        if self.listing:
            return TyperCommand(cmd_name, short_help=COMMANDS[cmd_name][2])
        return command(cmd_name)

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """The group's help, listing the subcommands from the table."""
        self.listing = True
        try:
            super().format_help(ctx, formatter)
        finally:
            self.listing = False


def _version(value: bool) -> None:
    if value:
        typer.echo(f"layerwise {__version__}")
        raise typer.Exit(0)


app = typer.Typer(
    name="layerwise",
    cls=Commands,
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


if __name__ == "__main__":  # pragma: no cover
    app()
