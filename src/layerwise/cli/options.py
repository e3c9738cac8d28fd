"""Options shared by several subcommands, and turning library errors into clean CLI errors."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import traceback
from typing import TYPE_CHECKING, Any, Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:
    from ..extractor import Extractor

ModelOpt = typer.Option(
    None, "--model", "-m", help="Local model directory or hub id (default: embedded all-MiniLM-L6-v2)."
)
DeviceOpt = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu).")
DtypeOpt = typer.Option(None, "--dtype", help="float32 (default), float16 or bfloat16 (meant for CUDA; slow on CPU).")
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
SiteOpt = typer.Option("block", "--site", help="block (= hidden_states), attention, intermediate or pre_ln.")
AllowPickleOpt = typer.Option(
    False,
    "--allow-pickle",
    help="Also load pickle checkpoints. RISK: unpickling can run arbitrary code; trusted files only.",
)
BackendOpt = typer.Option(
    None,
    "--backend",
    help="auto (default: ONNX Runtime for the block site where it equals PyTorch within 1e-5, else torch), torch, "
    "onnx (ONNX Runtime, CPU, block site; exported once and cached), keras (keras-hub backbone) or tf (TF Hub BERT "
    "SavedModel); a keras-hub preset defaults to keras, a SavedModel to tf. keras and tf need pip install "
    "'layerwise[tf]'.",
)
QuantizeOpt = typer.Option(
    None,
    "--quantize",
    help="none (default) or int8: dynamic int8 through ONNX Runtime (block site; faster, approximate: see "
    "benchmarks/README.md for its fidelity).",
)
TrustCodeOpt = typer.Option(
    False,
    "--trust-remote-code",
    help="Run modelling code shipped with a hub repo. RISK: it runs with your permissions.",
)

LayerModulesOpt = typer.Option(
    None,
    "--layer-modules",
    help="Module path of the model's layer list (e.g. model.layers) when it is not found by itself; verified at load.",
)
PaddingSideOpt = typer.Option(
    "right", "--padding-side", help="right (default) or left (decoder embedding models); both give the same states."
)

PromptOpt = typer.Option(
    "", "--prompt", help="Text put before every text (an instruction such as 'query: '); sentence/token level."
)
AddEosOpt = typer.Option(
    False, "--add-eos", help="Append the end-of-sequence token where the tokenizer does not (use with --pool last)."
)

err_console = Console(stderr=True)


def parse_layers(text: str) -> int | str:
    """CLI layer text -> spec: '-1' -> -1; everything else ('0,2,4', '-4:', 'all', '-0') is the library's grammar."""
    text = text.strip()
    return int(text) if re.fullmatch(r"-?\d+", text) and not re.fullmatch(r"-0+", text) else text


def parse_weights(text: Optional[str]) -> Optional[list[float]]:
    """'0.1,0.2,0.7' -> [0.1, 0.2, 0.7]; ``ValueError`` naming the bad item."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        try:
            out.append(float(part))
        except ValueError:
            raise ValueError(f"--weights item {part!r} is not a number; give e.g. --weights 0.25,0.25,0.5") from None
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

    User errors, ``ValueError`` (bad input or options; the library's ``ModelLoadError`` and ``ExtractError`` are
    ValueErrors) and ``OSError`` (missing file, permissions, disk full), exit 2. Anything else is a bug in layerwise:
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
    except (ValueError, OSError) as exc:
        _show(exc, f"[red]error:[/red] {escape(str(exc))}")
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


def extractor(
    model: Optional[str],
    device: Optional[str],
    dtype: Optional[str],
    allow_pickle: bool,
    trust_remote_code: bool,
    **kwargs: Any,
) -> Extractor:
    """The :class:`~layerwise.Extractor` a subcommand asked for (the module is imported lazily)."""
    from ..extractor import Extractor

    return Extractor(
        model, device=device, dtype=dtype, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, **kwargs
    )


def check_new_file(path: str, overwrite: bool, option: str = "-o") -> None:
    """Refuse to write over an existing file unless ``overwrite``; a directory is always refused.

    Raises:
        ValueError: naming the path and the way out (another path, or ``--overwrite``).
    """
    if os.path.isdir(path):
        raise ValueError(f"{option} {path!r} is a directory; give a file path")
    if os.path.exists(path) and not overwrite:
        raise ValueError(f"{option} {path!r} exists; layerwise does not replace files: pass --overwrite to replace "
                         f"it, or choose another path")
