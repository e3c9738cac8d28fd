"""``layerwise`` command: each subcommand lives in its own module, imported only when that command runs (or its own
``--help`` is asked), so ``layerwise --help`` imports no model code (no torch, no transformers)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Sequence, Union, get_args, get_origin

import typer
from rich.markup import escape
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from ..version import __version__
from .options import DEBUG_ENV, quiet_flag, set_debug

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
    "cache": ("cache", "cache", "List the graph cache (exported and compiled graphs, least recently used first, "
                                "with the processes holding them), the temporary files of builds"),
    "explore": ("explore", "explore", "Open the layer explorer at http://127.0.0.1:8765 (works offline: nothing is "
                                      "fetched from the network)."),
}


# the value names the help shows for an option's type (click's words, not Python's annotations)
METAVARS: dict[Any, str] = {str: "TEXT", int: "INTEGER", float: "FLOAT", Path: "PATH"}


def metavar(param: Any) -> str:
    """What ``--help`` shows after an option: nothing for a flag, else its value's kind in click's words (``TEXT``,
    ``INTEGER``, ``FLOAT``, ``PATH``); an argument's own name in capitals (``TEXT``, ``STORE``)."""
    if isinstance(param, TyperArgument):
        return str(param.name).upper()
    if getattr(param, "is_flag", False):
        return ""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None:  # typer before its type descriptors: click's own name of the type
        return str(getattr(param.type, "name", "text")).upper()
    kind = descriptor.annotation
    if get_origin(kind) is Union:  # Optional[X]: X
        kind = next(arg for arg in get_args(kind) if arg is not type(None))
    if get_origin(kind) is list:  # a repeatable option: one value each time it is given
        kind = get_args(kind)[0]
    return METAVARS.get(kind, "TEXT")


class NamedArgument(TyperArgument):
    """An argument whose help row is its name alone (``TEXT...``, ``STORE``): typer would add ``<str>``."""

    def display_type_rich(self, ctx: Any) -> str | None:
        """Nothing: the argument's name says what it takes."""
        return None


def name_values(params: list[Any]) -> None:
    """Give each option and argument of ``params`` the value name its help shows (:func:`metavar`), where it has
    none, and arguments a help row without typer's type."""
    for param in params:
        if isinstance(param, (TyperOption, TyperArgument)) and param.metavar is None:
            param.metavar = metavar(param)
        if type(param) is TyperArgument:
            param.__class__ = NamedArgument  # the same argument, its help row without typer's <str>


def bare_help_option(option: Any) -> Any:
    """``--help`` as its help shows it: a flag, without typer's ``<bool>``."""
    if option is not None and option.metavar is None:
        option.metavar = ""
    return option


class Command(TyperCommand):
    """A subcommand whose help reads as written.

    The help is rendered by rich, which would take ``[openvino]`` in "pip install 'layerwise[openvino]'" for a style
    tag and drop it: every help text is escaped while the help is written. Options show their value's kind
    (``--layers TEXT``, a flag nothing) rather than a Python annotation, and the usage line names arguments as click
    does (``PARTS...``, ``[STORE]``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name_values(self.params)

    def get_help_option(self, ctx: Any) -> Any:
        """The ``--help`` flag (shown without a value)."""
        return bare_help_option(super().get_help_option(ctx))

    def format_help(self, ctx: Any, formatter: Any) -> None:
        """The help, its texts escaped for rich's markup while it is written (``.help`` keeps the plain text that
        the docs' CLI reference reads)."""
        if self.rich_markup_mode != "rich":
            return super().format_help(ctx, formatter)
        items: list[Any] = [self, *self.params]
        texts = [(item, item.help) for item in items if getattr(item, "help", None)]
        for item, text in texts:
            item.help = escape(text)
        try:
            return super().format_help(ctx, formatter)
        finally:
            for item, text in texts:
                item.help = text

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        """``[OPTIONS]`` and the arguments: ``PARTS...`` (required, repeatable), ``[STORE]`` (optional), ``[TEXT]...``
        (optional, repeatable)."""
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument):
                name = param.metavar or str(param.name).upper()
                piece = name if param.required else f"[{name}]"
                pieces.append(piece + ("..." if param.nargs != 1 else ""))
        return pieces


def command(name: str) -> Any:
    """The click command of subcommand ``name`` (its module imported now)."""
    module, function, _ = COMMANDS[name]
    found = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    one = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode="rich")
    one.command(name, cls=Command)(quiet_flag(found))  # -q on every command
    return typer.main.get_command(one)


class Commands(TyperGroup):
    """The subcommands of :data:`COMMANDS`, each imported when it is looked up to run; the group's own help lists
    them from the table, importing none."""

    listing = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        name_values(self.params)  # the global flags: --debug, not --debug <bool>

    def get_help_option(self, ctx: Any) -> Any:
        """The ``--help`` flag (shown without a value)."""
        return bare_help_option(super().get_help_option(ctx))

    def list_commands(self, ctx: Any) -> list[str]:
        """Every subcommand's name, in the table's order."""
        return list(COMMANDS)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        """Subcommand ``cmd_name`` (``None`` when there is none): a stand-in with its help line while the group's
        help is written, else the command itself."""
        if cmd_name not in COMMANDS:
            return None
        if self.listing:
            return TyperCommand(cmd_name, short_help=escape(COMMANDS[cmd_name][2]))
        return command(cmd_name)

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        """Run the command line; a usage error (a bad option, a missing argument, a bad value) is one
        ``error: ...`` line on stderr naming the help to read, exit code 2, as every other user error."""
        import sys

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, windows_expand_args, **extra)
        except typer.Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        except Exception as exc:  # click's own errors (typer runs on its copy of click): known by what they carry
            status = getattr(exc, "exit_code", None)
            if not (hasattr(exc, "format_message") and isinstance(status, int)):
                raise
            kinds = {kind.__name__ for kind in type(exc).__mro__}
            if "NoArgsIsHelpError" in kinds:  # no arguments at all: typer has shown the help
                sys.exit(status)
            if "UsageError" in kinds:
                ctx = getattr(exc, "ctx", None)
                where = ctx.command_path if ctx is not None else "layerwise"
                print(f"error: {exc.format_message().rstrip('.')}; see '{where} --help'", file=sys.stderr)
            else:
                print(f"error: {exc.format_message()}", file=sys.stderr)
            sys.exit(status)
        sys.exit(code if isinstance(code, int) else 0)

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
    rich_markup_mode="rich",
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
