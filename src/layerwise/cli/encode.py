"""``layerwise encode TEXT...``: vectors for a few texts as JSON, JSON lines or .npy (corpora: ``extract``)."""

from __future__ import annotations

import io
import json
import os
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


def read_stdin_lines(stream: IO[bytes], where: str = "stdin") -> list[str]:
    """One text per line of ``stream``, decoded as strict UTF-8; ``ValueError`` naming the first bad line of
    ``where`` (``stdin``, or the file's name)."""
    out = []
    for n, raw in enumerate(stream, 1):
        try:
            out.append(raw.decode("utf-8").rstrip("\r\n"))
        except UnicodeDecodeError as exc:
            raise LayerwiseError(f"line {n} of {where} is not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                             f"re-encode the input as UTF-8") from None
    return out


def read_texts(texts: list[str], file: str | None, as_text: bool) -> list[str]:
    """The texts of one ``encode`` call: the TEXT arguments, or the lines of ``--file`` (``-`` and a lone TEXT ``-``:
    stdin).

    A TEXT that names an existing file is refused (unless ``as_text``): ``layerwise encode texts.txt`` would
    otherwise encode the characters of the name.

    Raises:
        LayerwiseError: both or neither of TEXT and ``--file``, ``-`` beside other texts, a TEXT that is a file path, a
            ``--file`` that is missing, a directory or not UTF-8 (naming the line).
    """
    if file is not None:
        if texts:
            raise LayerwiseError(f"give TEXT arguments or --file {file}, not both")
        if file == "-":
            return read_stdin_lines(sys.stdin.buffer)
        path = Path(file)
        if path.is_dir():
            raise LayerwiseError(f"--file {file!r} is a directory; give a text file (one text a line), or use "
                                 f"layerwise extract for a corpus directory")
        if not path.is_file():
            raise LayerwiseError(f"--file {file!r} does not exist; give a text file with one text a line, or - for "
                                 f"stdin")
        with path.open("rb") as fh:
            return read_stdin_lines(fh, repr(file))
    if not texts:
        raise LayerwiseError("nothing to encode: give TEXT arguments, --file PATH (one text a line) or --file - "
                             "(stdin)")
    if "-" in texts:
        if texts != ["-"]:
            raise LayerwiseError("'-' (read texts from stdin) must be the only TEXT argument; pass texts or "
                                 "'-', not both")
        return read_stdin_lines(sys.stdin.buffer)
    if not as_text:
        for text in texts:
            if os.path.isfile(text):
                raise LayerwiseError(
                    f"TEXT {text!r} is the name of an existing file, and encode takes texts, not files: to encode "
                    f"its lines give --file {text}; to encode the words {text!r} themselves add --as-text")
    return texts


@model_flags
def encode(
    texts: Optional[List[str]] = typer.Argument(
        None, metavar="TEXT", help="Texts to encode (a lone '-' reads one text per line from stdin). A file's lines: "
        "--file."),
    file: Optional[str] = typer.Option(
        None, "--file", metavar="PATH", help="Encode the lines of this UTF-8 text file, one text a line ('-': "
        "stdin); for a corpus (jsonl, csv, parquet, CoNLL) and a store on disk use layerwise extract."),
    as_text: bool = typer.Option(
        False, "--as-text", help="Encode each TEXT as given even where it names an existing file (refused otherwise, "
        "as a forgotten --file)."),
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

    Texts come from the arguments, or one a line from --file PATH (--file - or a lone TEXT -: stdin). A TEXT that names
    an existing file is refused with the fix (--file, or --as-text to encode the name itself). At token level (--pool
    none) the JSON formats also give each text's tokens and character offsets.
    """
    from ..notices import set_quiet

    set_quiet(quiet)  # the one-time work's lines (exports, the runtime that takes over) too
    with user_errors():
        if fmt not in FORMATS:
            raise LayerwiseError(f"unknown --format {fmt!r}. Valid formats are: {', '.join(FORMATS)}")
        if output:
            check_new_file(output, overwrite)
        texts = read_texts(list(texts or []), file, as_text)
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
