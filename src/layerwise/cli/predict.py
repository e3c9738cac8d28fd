"""``layerwise predict MODEL_DIR FILE|-``: one JSON line per record (label and probabilities), streamed in order."""

from __future__ import annotations

import json
import sys
from typing import Optional

import typer

from ..model.options import ModelOptions
from .options import NoHeaderOpt, check_new_file, head_encoder, model_flags, user_errors


@model_flags
def predict(
    model_dir: str = typer.Argument(..., help="A model directory written by layerwise train."),
    data: str = typer.Argument(..., help="Texts: .txt (one per line), .jsonl, .csv, .tsv, .parquet, or - for stdin."),
    text_field: Optional[str] = typer.Option(
        None, "--text-column", "--text-field", help="Text column (default: text, else sentence)."
    ),
    fmt: Optional[str] = typer.Option(None, "--format", help="Input format when the suffix does not tell."),
    no_header: bool = NoHeaderOpt,
    output: Optional[str] = typer.Option(None, "--output", "-o", help="Write JSONL here instead of stdout."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the -o file if it exists."),
    batch_size: int = typer.Option(256, "--batch-size", help="Texts predicted (and written) at a time."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar and no one-time work lines (exports)."),
    *,
    model_options: ModelOptions,
) -> None:
    """Predict every record of FILE; bad records get {"line": N, "error": "..."} lines, order kept.

    The encoder is the one saved with the head; --model says where it is now if it moved (checked by its weights
    fingerprint), other model flags (--device ...) apply on top of the saved options."""
    from tqdm.auto import tqdm

    from ..corpus.readers import BadRecord, read_records
    from ..heads import load
    from ..notices import set_quiet

    set_quiet(quiet)  # the one-time work's lines (exports, the runtime that takes over) too

    with user_errors():
        if output:
            check_new_file(output, overwrite)
        clf = load(model_dir, model=head_encoder(model_dir, model_options))
        records = read_records(data, fmt, text_field=text_field, header=not no_header)
        out = open(output, "w", encoding="utf-8") if output else sys.stdout
        bar = tqdm(disable=quiet or not sys.stderr.isatty(), unit="rec", desc="predict", file=sys.stderr)
        try:
            pending: list = []

            def flush() -> None:
                good = [r for r in pending if not isinstance(r, BadRecord)]
                texts = [r.text for r in good]
                results = iter(zip(*next(clf.iter_predict(texts, batch_size=len(texts))))) if good else iter(())
                for r in pending:
                    if isinstance(r, BadRecord):
                        doc = {"line": r.line, "error": r.reason}
                    else:
                        label, probs = next(results)
                        doc = {"line": r.line, "label": label,
                               "probs": {n: round(float(p), 6) for n, p in zip(clf.labels, probs)}}
                    out.write(json.dumps(doc, ensure_ascii=False) + "\n")
                out.flush()
                bar.update(len(pending))
                pending.clear()

            for rec in records:
                pending.append(rec)
                if len(pending) >= batch_size:
                    flush()
            if pending:
                flush()
        finally:
            bar.close()
            if output:
                out.close()
