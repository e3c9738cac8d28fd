"""``layerwise export STORE --to hdf5|parquet|npy -o OUT``: files other tools read without layerwise; ``--to sae-lens``:
one layer of a token-activation store as SAELens's cached activations."""

from __future__ import annotations

from typing import Optional

import typer

from .options import err_console, user_errors

DEFAULT_SUFFIX = {"npy": "-npy", "hdf5": ".h5", "parquet": ".parquet"}  # npy: a directory, never named *.npy


def export(
    store: str = typer.Argument(..., help="A store directory written by layerwise extract."),
    to: str = typer.Option(..., "--to", help="npy (a directory of .npy files), hdf5 or parquet; sae-lens (a "
                           "token-activation store's --layer as SAELens's cached activations)."),
    output: Optional[str] = typer.Option(
        None, "--output", "-o",
        help="Output path (default: STORE-npy/, STORE.h5, STORE.parquet). An npy export is a directory; a name "
             "ending in .npy writes a sentence-level store as that one array (np.load(OUT)).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an earlier layerwise export there (never anything else)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print nothing but errors (no 'wrote ...' line)."),
    layer: int = typer.Option(-1, "--layer", help="--to sae-lens: the stored layer to export (-1: the last stored)."),
    hook_name: Optional[str] = typer.Option(
        None, "--hook-name", help="--to sae-lens: the column's hook name (default TransformerLens's name of the "
        "layer and site, e.g. blocks.7.hook_resid_post for layer 8 of the block site)."),
    dtype: str = typer.Option("float32", "--dtype", help="--to sae-lens: float32 or float16 (Arrow has no bfloat16)."),
) -> None:
    """Convert a store to npy, hdf5 or parquet (streamed, shard by shard), or a token-activation store's layer to
    SAELens's cached activations."""
    from ..notices import set_quiet
    from ..store import export as run_export

    set_quiet(quiet)
    if to == "sae-lens":
        from ..store.sae_lens import export_sae_lens, sae_lens_config

        with user_errors():
            out = export_sae_lens(store, output or store.rstrip("/") + "-sae-lens", layer=layer, hook=hook_name,
                                  dtype=dtype, overwrite=overwrite)
            said = sae_lens_config(out)
        if not quiet:
            err_console.print(f"wrote {out}: SAELens reads it with use_cached_activations=True, "
                              f"cached_activations_path='{out}', hook_name='{said['hook_name']}', "
                              f"context_size={said['context_size']}, d_in={said['d_in']}",
                              highlight=False, soft_wrap=True)
        return
    with user_errors():
        out = run_export(store, output or store.rstrip("/") + DEFAULT_SUFFIX.get(to, ""), to=to, overwrite=overwrite)
    if not quiet:
        where = (f" (one array: np.load('{out}'); the manifest beside it)" if out.suffix == ".npy" else
                 f" (a directory: np.load('{out / 'features.npy'}'))") if to == "npy" else ""
        err_console.print(f"wrote {out}{where}", highlight=False, soft_wrap=True)
