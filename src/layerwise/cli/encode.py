"""``layerwise encode TEXT...``: vectors for a few texts as JSON, JSON lines or .npy (corpora: ``extract``)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, List, Optional

import typer

from ..encoding.precision import apply_calibration
from ..encoding.spec import EncodeSpec
from ..encoding.tokenize import check_texts
from ..encoding.vocab import FIXED_POOLS
from ..errors import LayerwiseError
from ..model.options import ModelOptions
from .options import (
    AddEosOpt,
    CalibrationOpt,
    CombineOpt,
    DimensionsOpt,
    LayersOpt,
    OutputDtypeOpt,
    PromptOpt,
    SiteOpt,
    WeightsOpt,
    check_new_file,
    err_console,
    extractor,
    model_flags,
    parse_layers,
    parse_weights,
    user_errors,
)

if TYPE_CHECKING:  # torch is imported by the commands that load a model, not by --help
    from ..encoding.reduce import Encoded
    from ..extractor import Extractor

FORMATS = ("json", "jsonl", "npy")


def parse_pool(text: str) -> str | None:
    """``--pool`` text (any case) -> a sentence pool, or ``None`` for ``none`` (one vector per token)."""
    mode = text.strip().lower()
    if mode == "none":
        return None
    if mode == "attention":
        raise LayerwiseError("--pool attention is learned and has no fixed weights; train a head with it "
                         f"(layerwise train --pool attention) or use one of: {', '.join(FIXED_POOLS)}, none")
    if mode not in FIXED_POOLS:
        raise LayerwiseError(f"unknown --pool {text!r}. Valid pool modes are: {', '.join(FIXED_POOLS)}, "
                         f"or none (one vector per token)")
    return mode


def read_stdin_lines(stream: IO[bytes]) -> list[str]:
    """One text per line of ``stream``, decoded as strict UTF-8; ``ValueError`` naming the first bad line."""
    out = []
    for n, raw in enumerate(stream, 1):
        try:
            out.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as exc:
            raise LayerwiseError(f"line {n} of stdin is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                             f"re-encode the input as UTF-8") from None
    return out


@model_flags
def encode(
    texts: List[str] = typer.Argument(..., help="Texts to encode; a lone '-' reads one text per line from stdin."),
    layers: str = LayersOpt,
    combine: str = CombineOpt,
    weights: Optional[str] = WeightsOpt,
    pool: str = typer.Option(
        "mean", "--pool", "-p", help="cls, pooler, mean, max, mean_max, last, or 'none' (one vector per token)."
    ),
    site: str = SiteOpt,
    skip_special: bool = typer.Option(False, "--skip-special", help="Leave special tokens out of the pool."),
    truncate: bool = typer.Option(
        False, "--truncate", help="Cut long texts at the model maximum instead of windowing."
    ),
    normalize: bool = typer.Option(False, "--normalize", help="L2-normalise sentence vectors (norm 1)."),
    fmt: str = typer.Option("json", "--format", "-f", help="json (one document), jsonl (a line per text) or npy."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write exactly this file instead of stdout."),
    batch_tokens: Optional[int] = typer.Option(
        None, "--batch-tokens", help="Token budget per forward batch (default 1024 on CPU, 16384 on CUDA)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q",
                               help="No progress bar, no model line and no one-time work lines (exports) on stderr."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the -o file if it exists."),
    output_dtype: str = OutputDtypeOpt,
    dimensions: Optional[int] = DimensionsOpt,
    calibration: Optional[Path] = CalibrationOpt,
    prompt: str = PromptOpt,
    add_eos: bool = AddEosOpt,
    *,
    model_options: ModelOptions,
) -> None:
    """Encode TEXTs with the chosen layers, combination and pooling; print JSON / JSON lines or write .npy.

    At token level (--pool none) the JSON formats also give each text's tokens and character offsets.
    """
    from ..notices import set_quiet

    set_quiet(quiet)  # the one-time work's lines (exports, the runtime that takes over) too
    with user_errors():
        if fmt not in FORMATS:
            raise LayerwiseError(f"unknown --format {fmt!r}. Valid formats are: {', '.join(FORMATS)}")
        if "-" in texts and texts != ["-"]:
            raise LayerwiseError("'-' (read texts from stdin) must be the only TEXT argument; pass texts or "
                                 "'-', not both")
        if output:
            check_new_file(output, overwrite)
        if texts == ["-"]:
            texts = read_stdin_lines(sys.stdin.buffer)
        pool_mode = parse_pool(pool)
        spec = EncodeSpec(layers=parse_layers(layers), site=site, combine=combine, weights=parse_weights(weights),
                          level="token" if pool_mode is None else "sentence", pool=pool_mode,
                          skip_special_tokens=skip_special, truncate=truncate, normalize=normalize, prompt=prompt,
                          add_eos=add_eos, output_dtype=output_dtype, dimensions=dimensions)
        if fmt == "npy" and pool_mode is None:
            raise LayerwiseError("--format npy needs one vector per text; use --pool mean|max|... or --format json")
        ex = extractor(model_options)
        spec = apply_calibration(spec, calibration, ex.calibrate).resolve(ex)
        if not quiet:
            lm = ex.loaded
            err_console.print(f"{lm.name}: {len(texts)} text{'' if len(texts) == 1 else 's'}, device {lm.device}, "
                              f"dtype {ex.backend.precision}, backend {ex.backend.name}",
                              highlight=False, soft_wrap=True)
        results = _encode(ex, texts, spec, batch_tokens, show=not quiet and sys.stderr.isatty())
        _write(ex, spec, pool_mode or "none", results, fmt, output)


def _encode(ex: Extractor, texts: list[str], spec: EncodeSpec, batch_tokens: int | None, show: bool) -> list[Encoded]:
    from tqdm.auto import tqdm

    with tqdm(total=len(texts), disable=not show, unit="text", desc="encode", leave=False, file=sys.stderr) as bar:
        out = []
        for res in ex.stream(check_texts(texts), spec, batch_tokens=batch_tokens):
            out.append(res)
            bar.update(1)
    return out


def _write(ex: Extractor, spec: EncodeSpec, pool: str, results: list[Encoded], fmt: str, output: str | None) -> None:
    """Write the results as one JSON document, JSON lines, or one ``[n, D]`` .npy array (exactly at ``output``)."""
    tokens = spec.level == "token"
    if fmt == "npy":
        import numpy as np

        arr = np.stack([r.features.numpy() for r in results])
        if output:
            with open(output, "wb") as fh:  # np.save(path) would append ".npy"
                np.save(fh, arr)
        else:
            buf = io.BytesIO()
            np.save(buf, arr)
            sys.stdout.buffer.write(buf.getvalue())
            sys.stdout.buffer.flush()  # a closed pipe fails here, inside user_errors, not at interpreter exit
        return
    rows = []
    for r in results:
        row: dict[str, Any] = {"index": r.index, "shape": list(r.features.shape), "vector": r.features.tolist()}
        if tokens:
            row["tokens"] = ex.tokenizer.convert_ids_to_tokens(r.tokens.ids)
            row["offsets"] = [list(o) for o in r.tokens.offsets]
        rows.append(row)
    if fmt == "jsonl":
        text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    else:
        doc: dict[str, Any] = {
            "model": ex.loaded.name, "layers": list(spec.layer_indices), "site": spec.site, "combine": spec.combine,
            "pool": pool, "spec": spec.to_dict(),
            "shape": [row["shape"] for row in rows] if tokens else [len(rows), *rows[0]["shape"]],
            "vectors": [row["vector"] for row in rows],
        }
        if tokens:
            doc["tokens"] = [row["tokens"] for row in rows]
            doc["offsets"] = [row["offsets"] for row in rows]
        text = json.dumps(doc, ensure_ascii=False) + "\n"
    if output:
        with open(output, "w", encoding="utf-8") as fh:
            fh.write(text)
    else:
        sys.stdout.write(text)
        sys.stdout.flush()  # a closed pipe fails here, inside user_errors, not at interpreter exit
