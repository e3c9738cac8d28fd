"""``layerwise encode TEXT...``: vectors for a few texts as JSON or .npy (corpora: ``layerwise extract``)."""

from __future__ import annotations

import io
import json
import sys
from typing import List, Optional

import numpy as np
import typer

from ..spec import EncodeSpec
from .options import (
    AllowPickleOpt,
    BackendOpt,
    DeviceOpt,
    DtypeOpt,
    LayersOpt,
    ModelOpt,
    SiteOpt,
    TrustCodeOpt,
    extractor,
    parse_layers,
    parse_weights,
    user_errors,
)

FORMATS = ("json", "npy")


def encode(
    texts: List[str] = typer.Argument(..., help="Texts to encode; '-' reads one text per line from stdin."),
    layers: str = LayersOpt,
    combine: str = typer.Option(
        "concat",
        "--combine",
        "-c",
        help="concat, sum, mean, weighted (--weights) or stack; the learned scalar_mix/attention: layerwise train.",
    ),
    weights: Optional[str] = typer.Option(
        None, "--weights", help="Comma-separated layer weights for --combine weighted."
    ),
    pool: str = typer.Option("mean", "--pool", "-p", help="cls, pooler, mean, max, mean_max, last, or none (tokens)."),
    site: str = SiteOpt,
    skip_special: bool = typer.Option(False, "--skip-special", help="Leave special tokens out of the pool."),
    truncate: bool = typer.Option(
        False, "--truncate", help="Cut long texts at the model maximum instead of windowing."
    ),
    fmt: str = typer.Option("json", "--format", "-f", help="json or npy."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write here instead of stdout."),
    model: Optional[str] = ModelOpt,
    device: Optional[str] = DeviceOpt,
    dtype: Optional[str] = DtypeOpt,
    allow_pickle: bool = AllowPickleOpt,
    trust_remote_code: bool = TrustCodeOpt,
    backend: str = BackendOpt,
) -> None:
    """Encode TEXTs with the chosen layers, combination and pooling; print JSON or write .npy."""
    with user_errors():
        if fmt not in FORMATS:
            raise ValueError(f"unknown --format {fmt!r}. Valid formats are: {', '.join(FORMATS)}")
        if texts == ["-"]:
            texts = [line.rstrip("\n") for line in sys.stdin]
        pool_mode = None if pool == "none" else pool
        w = parse_weights(weights)
        ex = extractor(model, device, dtype, allow_pickle, trust_remote_code, backend=backend)
        out = ex.encode(texts, layers=parse_layers(layers), combine=combine, pool=pool_mode, site=site, weights=w,
                        skip_special_tokens=skip_special, truncate=truncate)
        if fmt == "json":
            vectors = [v.tolist() for v in out] if pool_mode is None else out.tolist()
            resolved = EncodeSpec(layers=parse_layers(layers), site=site, level="token").resolve(ex)
            doc = {
                "model": ex.loaded.name,
                "layers": list(resolved.layer_indices),
                "site": site, "combine": combine, "pool": pool,
                "shape": [[*v.shape] for v in out] if pool_mode is None else list(out.shape),
                "vectors": vectors,
            }
            text = json.dumps(doc)
            if output:
                with open(output, "w", encoding="utf-8") as fh:
                    fh.write(text + "\n")
            else:
                print(text)
            return
        if pool_mode is None:
            raise ValueError("--format npy needs one vector per text; use --pool mean|max|... or --format json")
        if output:
            np.save(output, out)
        else:
            buf = io.BytesIO()
            np.save(buf, out)
            sys.stdout.buffer.write(buf.getvalue())
