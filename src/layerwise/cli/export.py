"""``layerwise export STORE --to hdf5|parquet|npy -o OUT``: files other tools read without layerwise."""

from __future__ import annotations

from typing import Optional

import typer

from .options import err_console, user_errors

DEFAULT_SUFFIX = {"npy": "-npy", "hdf5": ".h5", "parquet": ".parquet"}  # npy: a directory, never named *.npy


def export(
    store: str = typer.Argument(..., help="A store directory written by layerwise extract."),
    to: str = typer.Option(..., "--to", help="npy (a directory of .npy files), hdf5 or parquet."),
    output: Optional[str] = typer.Option(
        None, "--output", "-o",
        help="Output path (default: STORE-npy/, STORE.h5, STORE.parquet). An npy export is a directory; a name "
             "ending in .npy writes a sentence-level store as that one array (np.load(OUT)).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an earlier layerwise export there (never anything else)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors (no 'wrote ...' line)."),
) -> None:
    """Convert a store to npy, hdf5 or parquet (streamed, shard by shard)."""
    from ..notices import set_quiet
    from ..store import export as run_export

    set_quiet(quiet)
    with user_errors():
        out = run_export(store, output or store.rstrip("/") + DEFAULT_SUFFIX.get(to, ""), to=to, overwrite=overwrite)
    if not quiet:
        where = (f" (one array: np.load('{out}'); the manifest beside it)" if out.suffix == ".npy" else
                 f" (a directory: np.load('{out / 'features.npy'}'))") if to == "npy" else ""
        err_console.print(f"wrote {out}{where}", highlight=False, soft_wrap=True)
