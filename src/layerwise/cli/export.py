"""``layerwise export STORE --to hdf5|parquet|npy -o OUT``: files other tools read without layerwise."""

from __future__ import annotations

from typing import Optional

import typer

from .options import err_console, user_errors


def export(
    store: str = typer.Argument(..., help="A store directory written by layerwise extract."),
    to: str = typer.Option(..., "--to", help="npy (a directory of .npy files), hdf5 or parquet."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Output path (default: STORE.npy/.h5/.parquet)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an earlier layerwise export there (never anything else)."
    ),
) -> None:
    """Convert a store to npy, hdf5 or parquet (streamed, shard by shard)."""
    from ..store import export as run_export

    with user_errors():
        default = {"npy": ".npy", "hdf5": ".h5", "parquet": ".parquet"}.get(to, "")
        out = run_export(store, output or store.rstrip("/") + default, to=to, overwrite=overwrite)
    err_console.print(f"wrote {out}", highlight=False)
