"""Options shared by several subcommands, and turning library errors into clean CLI errors."""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

import typer
from rich.console import Console
from rich.markup import escape

ModelOpt = typer.Option(None, "--model", "-m", help="Local model directory or hub id (default: embedded all-MiniLM-L6-v2).")
DeviceOpt = typer.Option(None, "--device", help="cpu, cuda, cuda:1 ... (default: cuda when available, else cpu).")
DtypeOpt = typer.Option(None, "--dtype", help="float32 (default), float16 or bfloat16 (meant for CUDA; slow on CPU).")
LayersOpt = typer.Option("-1", "--layers", "-l", help="Layer spec: -1, 0, '-4:', '1:5', 'all', '0,2,4,6', 'second_to_last'.")
SiteOpt = typer.Option("block", "--site", help="block (= hidden_states), attention, intermediate or pre_ln.")
AllowPickleOpt = typer.Option(
    False, "--allow-pickle", help="Also load pickle checkpoints. RISK: unpickling can run arbitrary code; trusted files only."
)
BackendOpt = typer.Option("torch", "--backend", help="torch (default) or onnx (ONNX Runtime, CPU, block site; exported once and cached).")
TrustCodeOpt = typer.Option(
    False, "--trust-remote-code", help="Run modelling code shipped with a hub repo. RISK: it runs with your permissions."
)

err_console = Console(stderr=True)


def parse_layers(text: str):
    """CLI layer text -> spec: '0,2,4' -> [0, 2, 4]; '-1' -> -1; slices and names stay strings."""
    text = text.strip()
    if "," in text:
        return [_int_or_text(p) for p in text.split(",") if p.strip()]
    return _int_or_text(text)


def _int_or_text(part: str):
    part = part.strip()
    return int(part) if re.fullmatch(r"-?\d+", part) else part


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


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Show ValueError/TypeError/OSError as one red line and exit 2, without a traceback."""
    try:
        yield
    except (ValueError, TypeError, OSError, KeyError) as exc:
        err_console.print(f"[red]error:[/red] {escape(str(exc))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


def extractor(model: Optional[str], device, dtype, allow_pickle: bool, trust_remote_code: bool, **kwargs):
    from ..extractor import Extractor

    return Extractor(
        model, device=device, dtype=dtype, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code, **kwargs
    )
