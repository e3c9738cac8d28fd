"""Options shared by several subcommands, and turning library errors into clean CLI errors."""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import re
import sys
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence, get_type_hints

import typer
from rich.console import Console
from rich.markup import escape

from ..errors import LayerwiseError

if TYPE_CHECKING:
    from ..extractor import Extractor
    from ..model.options import ModelOptions

LayersOpt = typer.Option(
    "-1", "--layers", "-l", help="Layer spec: -1, 0, '-4:', '1:5', 'all', '0,2,4,6', 'second_to_last'."
)
CombineOpt = typer.Option(
    "concat",
    "--combine",
    "-c",
    help="concat, sum, mean, weighted (--weights) or stack; the learned scalar_mix/attention: layerwise train.",
)
WeightsOpt = typer.Option(None, "--weights", help="Comma-separated layer weights for --combine weighted.")
SiteOpt = typer.Option(
    "block", "--site", help="block (= hidden_states), raw, attention, intermediate or pre_ln (Extractor.describe())."
)

# The model flags, declared once: every command that loads a model gets all of them (``@model_flags``) and receives
# one ModelOptions. (name, type, default, flags, help), in ModelOptions' field order.
MODEL_FLAGS: tuple[tuple[str, Any, Any, tuple[str, ...], str], ...] = (
    ("model", Optional[str], None, ("--model", "-m"),
     "Local model directory or hub id (default: embedded all-MiniLM-L6-v2)."),
    ("device", Optional[str], None, ("--device",), "cpu, cuda, cuda:1 ... (default: cuda when available, else cpu)."),
    ("compute_dtype", Optional[str], None, ("--compute-dtype",),
     "How the model runs: float32 (default), float16 or bfloat16 (CUDA, or a CPU with native bf16; warned about "
     "elsewhere)."),
    ("backend", Optional[str], None, ("--backend",),
     "auto (default: the fastest of ONNX Runtime, OpenVINO and torch for the block site among those equal to "
     "PyTorch within 1e-5, timed once per machine; else torch), torch, onnx (ONNX Runtime, CPU, block site; exported "
     "once and cached), openvino (OpenVINO, CPU, block site; float32, or its bf16 hint with --compute-dtype "
     "bfloat16), keras (keras-hub backbone) or tf (TF Hub BERT SavedModel); a keras-hub preset defaults to keras, a "
     "SavedModel to tf. openvino needs pip install 'layerwise[openvino]', keras and tf 'layerwise[tf]'."),
    ("quantize", Optional[str], None, ("--quantize",),
     "none (default), int8 or int8-full (block site; faster, approximate). int8: int8 weights on OpenVINO where "
     "layerwise[openvino] is installed, else ONNX Runtime's dynamic int8; int8-full: weights and activations in int8 "
     "on OpenVINO, calibrated (--quantize-calibration), the fastest and least exact; see benchmarks/README.md."),
    ("quantize_calibration", Optional[str], None, ("--quantize-calibration",),
     "--quantize int8-full: a text file (one text a line) to calibrate on, like the texts you will encode "
     "(default: a bundled neutral sample of 256 texts)."),
    ("padding_side", str, "right", ("--padding-side",),
     "right (default) or left (decoder embedding models); both give the same states."),
    ("layer_modules", Optional[str], None, ("--layer-modules",),
     "Module path of the model's layer list (e.g. model.layers) when it is not found by itself; verified at load."),
    ("max_length", Optional[int], None, ("--max-length",),
     "Window length in tokens, special tokens included (default: the model's; longer texts are windowed)."),
    ("stride", Optional[int], None, ("--stride",), "Overlap of consecutive windows in tokens (default: a quarter)."),
    ("allow_pickle", bool, False, ("--allow-pickle",),
     "Also load pickle checkpoints. RISK: unpickling can run arbitrary code; trusted files only."),
    ("trust_remote_code", bool, False, ("--trust-remote-code",),
     "Run modelling code shipped with a hub repo. RISK: it runs with your permissions."),
    ("revision", Optional[str], None, ("--revision",), "Hub revision (branch, tag or commit) of a hub id."),
    ("tokenizer", Optional[str], None, ("--tokenizer",),
     "--backend tf: a directory with the SavedModel's Hugging Face tokenizer."),
    ("onnx_cache", Optional[str], None, ("--onnx-cache",),
     "Where exported ONNX graphs are cached (default: $LAYERWISE_CACHE/onnx)."),
    ("max_layer", Optional[int], None, ("--max-layer",),
     "The deepest layer this model will run (-1: the last): its blocks load at once and deeper requests are "
     "refused (a hard memory bound). Default: blocks load when a layer first needs them."),
    ("max_memory", Optional[str], None, ("--max-memory",),
     "A memory budget for the weights (4GB, 512MiB): layers whose blocks exceed it run block by block over chunks "
     "of records, each block read from the checkpoint once per chunk (a throughput mode)."),
)
MODEL_FLAG_NAMES = tuple(name for name, *_ in MODEL_FLAGS)


def model_flags(command: Callable[..., Any]) -> Callable[..., Any]:
    """Give a typer command every model flag of :data:`MODEL_FLAGS`; it receives them as one
    ``model_options: ModelOptions`` argument (built, and checked, before the command runs)."""
    hints = get_type_hints(command)
    own = inspect.signature(command).parameters.values()
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in own if p.name != "model_options"]
    flags = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=kind,
                               default=typer.Option(default, *names, help=text))
             for name, kind, default, names, text in MODEL_FLAGS]

    @functools.wraps(command)
    def run(*args: Any, **kwargs: Any) -> Any:
        given = {name: kwargs.pop(name) for name in MODEL_FLAG_NAMES}
        from ..model.options import ModelOptions

        with user_errors():
            options = ModelOptions.of(given.pop("model"), **given)
        return command(*args, model_options=options, **kwargs)

    run.__signature__ = inspect.Signature([*params, *flags], return_annotation=None)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in [*params, *flags]}
    del run.__wrapped__  # typer reads the signature above, not the command's own
    return run


QUIET_HELP = "Say nothing but the results and errors: no progress, no notes, no one-time work lines."


def quiet_flag(command: Callable[..., Any]) -> Callable[..., Any]:
    """``command`` with ``-q/--quiet`` (:data:`QUIET_HELP`), unless it declares its own ``quiet``: the flag silences
    :mod:`layerwise.notices` and the plain progress lines for the run (``LAYERWISE_QUIET``'s effect)."""
    signature = inspect.signature(command)
    if "quiet" in signature.parameters:
        return command
    hints = get_type_hints(command)
    params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in signature.parameters.values()]
    flag = inspect.Parameter("quiet", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                             default=typer.Option(False, "--quiet", "-q", help=QUIET_HELP))

    @functools.wraps(command)
    def run(*args: Any, quiet: bool = False, **kwargs: Any) -> Any:
        from ..notices import set_quiet

        if quiet:
            set_quiet(True)
        return command(*args, **kwargs)

    run.__signature__ = inspect.Signature([*params, flag], return_annotation=None)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in [*params, flag]}
    del run.__wrapped__  # typer reads the signature above
    return run


NoHeaderOpt = typer.Option(
    False, "--no-header", help="CSV/TSV without a header row: name columns by position (--text-column 2).")
OutputDtypeOpt = typer.Option(
    "float32", "--output-dtype", help="Precision of the features returned or stored: float32, float16, int8, uint8 "
    "(both need --calibration), binary or ubinary (sign bits, 8 to a byte). The model runs in --compute-dtype."
)
DimensionsOpt = typer.Option(
    None, "--dimensions", min=1, help="Keep the leading N values of each vector (Matryoshka models), before "
    "--normalize and --output-dtype."
)
CalibrationOpt = typer.Option(
    None, "--calibration", help="--output-dtype int8/uint8: a text file (one text a line) whose features give each "
    "value's range, or a JSON of {\"min\": [...], \"max\": [...]} (or a spec holding 'calibration')."
)
PromptOpt = typer.Option(
    "", "--prompt", help="Text put before every text (an instruction such as 'query: '); sentence/token level."
)
AddEosOpt = typer.Option(
    False, "--add-eos", help="Append the end-of-sequence token where the tokenizer does not (use with --pool last)."
)

err_console = Console(stderr=True)


def parse_layers(text: str) -> int | str:
    """CLI layer text -> spec: '-1' -> -1; everything else ('0,2,4', '-4:', 'all', '-0') is the library's grammar.

    A list written as Python or JSON writes it, ``[0,3]`` or ``[0, 3]``, is read as ``0,3`` (the brackets dropped); any
    other bracket is refused with the command line's form."""
    text = text.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    if "[" in text or "]" in text:
        raise LayerwiseError(f"--layers {text!r} holds a bracket; write the layers as a comma-separated list without "
                             f"brackets, e.g. --layers 0,3 (or a slice, --layers -4:)")
    return int(text) if re.fullmatch(r"-?\d+", text) and not re.fullmatch(r"-0+", text) else text


def check_flag(flag: str, value: str, valid: Sequence[str]) -> str:
    """``value`` when it is one of ``valid``, else a :class:`~layerwise.LayerwiseError` naming the flag, the value and
    the valid values (``unknown --head 'mpl'. Valid values are: linear, mlp, per_layer``)."""
    if value not in valid:
        raise LayerwiseError(f"unknown {flag} {value!r}. Valid values are: {', '.join(valid)}")
    return value


def parse_weights(text: Optional[str]) -> Optional[list[float]]:
    """'0.1,0.2,0.7' -> [0.1, 0.2, 0.7]; ``ValueError`` naming the bad item."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        try:
            out.append(float(part))
        except ValueError:
            raise LayerwiseError(
                f"--weights item {part!r} is not a number; give e.g. --weights 0.25,0.25,0.5") from None
    return out


DEBUG_ENV = "LAYERWISE_DEBUG"
_state = {"debug": False}  # the global --debug flag of the running invocation (set by the app's callback)
# typer's own exceptions pass through user_errors: Exit and Abort are control flow (both RuntimeErrors), and usage
# errors (BadParameter and its ClickException base) are reported by typer. The base is looked up by name because
# recent typer versions vendor click as ``typer._click``.
_PASS_THROUGH: tuple[type[BaseException], ...] = (typer.Exit, typer.Abort) + tuple(
    c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException" and issubclass(c, BaseException)
)


def set_debug(ctx: typer.Context, debug: bool) -> None:
    """Record the global ``--debug`` flag for this invocation; it is cleared again when the invocation ends."""
    _state["debug"] = debug
    ctx.call_on_close(lambda: _state.update(debug=False))


def debug_enabled() -> bool:
    """``layerwise --debug ...`` was given, or ``LAYERWISE_DEBUG`` is set (to anything but ``0``, ``false``, ``no``)."""
    if _state["debug"]:
        return True
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn exceptions into one red ``error:`` line on stderr.

    User errors exit 2: the library's :class:`~layerwise.LayerwiseError` family (every error layerwise raises on
    purpose), other ``ValueError`` (bad input or options) and ``OSError`` (missing file, permissions, disk full).
    Anything else is a bug in layerwise:
    the line says so and the exit status is 1. With ``layerwise --debug`` or ``LAYERWISE_DEBUG=1`` the traceback of
    either kind is printed first.
    """
    try:
        yield
    except _PASS_THROUGH:
        raise
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        _silence_stdout()
        raise typer.Exit(0) from None
    except (LayerwiseError, ValueError, OSError) as exc:
        text = getattr(exc, "flag_message", None) or str(exc)  # a SpecError in the command line's words
        _show(exc, f"[red]error:[/red] {escape(text)}")
        raise typer.Exit(2) from None
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if debug_enabled():
            hint = "please report it with the traceback above."
        else:
            hint = (f"rerun with --debug (layerwise --debug COMMAND ...) or {DEBUG_ENV}=1 to see the traceback, "
                    "and please report it.")
        _show(exc, f"[red]error:[/red] unexpected {escape(text)}. This is a bug in layerwise; {hint}")
        raise typer.Exit(1) from None


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail on the closed pipe again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (a test runner's buffer)
        pass


def _show(exc: BaseException, line: str) -> None:
    if debug_enabled():
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()
    err_console.print(line, highlight=False, soft_wrap=True)


def given_options(options: ModelOptions) -> dict[str, Any]:
    """The fields of ``options`` that differ from their defaults (the model flags a user gave)."""
    from ..model.options import ModelOptions

    default = ModelOptions().to_dict()
    return {k: v for k, v in options.to_dict().items() if v != default[k]}


def head_encoder(model_dir: str, options: ModelOptions) -> ModelOptions | str | None:
    """What ``heads.load(model_dir, model=...)`` gets from a command's model flags: nothing (the head's saved
    options), the encoder's new place (``--model`` alone), or the saved options with the given flags applied."""
    given = given_options(options)
    if not given:
        return None
    config = os.path.join(model_dir, "config.json")
    if set(given) == {"model"} or not os.path.isfile(config):  # heads.load says what is wrong with the directory
        return str(given["model"]) if "model" in given else None
    from ..heads import HeadConfig

    return HeadConfig.from_json(config).options.replace(**given)


def extractor(options: ModelOptions, batch_tokens: Optional[int] = None) -> Extractor:
    """The :class:`~layerwise.Extractor` of a subcommand's model flags (the module is imported lazily)."""
    from ..extractor import Extractor

    return Extractor.from_options(options, batch_tokens=batch_tokens)


def check_new_file(path: str, overwrite: bool, option: str = "-o") -> None:
    """Refuse to write over an existing file unless ``overwrite``; a directory is always refused.

    Raises:
        ValueError: naming the path and the way out (another path, or ``--overwrite``).
    """
    if os.path.isdir(path):
        raise LayerwiseError(f"{option} {path!r} is a directory; give a file path")
    if os.path.exists(path) and not overwrite:
        raise LayerwiseError(f"{option} {path!r} exists; layerwise does not replace files: pass --overwrite to replace "
                         f"it, or choose another path")
