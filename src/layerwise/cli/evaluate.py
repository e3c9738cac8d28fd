"""``layerwise evaluate MODEL_DIR FILE``: accuracy, macro-F1, per-class scores and the confusion matrix."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ..model.options import ModelOptions
from .options import NoHeaderOpt, err_console, head_encoder, model_flags, user_errors


@model_flags
def evaluate(
    model_dir: str = typer.Argument(..., help="A model directory written by layerwise train."),
    data: str = typer.Argument(..., help="Labelled file (.tsv, .csv, .jsonl, .parquet) with text and label columns."),
    text_field: Optional[str] = typer.Option(
        None, "--text-column", "--text-field", help="Text column (default: text, else sentence)."
    ),
    label_field: str = typer.Option("label", "--label-column", "--label-field"),
    fmt: Optional[str] = typer.Option(None, "--format"),
    no_header: bool = NoHeaderOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the scores as JSON."),
    batch_size: int = typer.Option(256, "--batch-size"),
    *,
    model_options: ModelOptions,
) -> None:
    """Score a trained model on a labelled file."""
    from ..heads import classification_scores, format_scores, load
    from ..heads.data import encode_labels, read_labelled

    with user_errors():
        clf = load(model_dir, model=head_encoder(model_dir, model_options))
        gold = read_labelled(data, text_field=text_field, label_field=label_field, format=fmt, header=not no_header)
        encode_labels(gold.labels, clf.labels, f"{data!r}")  # unknown labels: a clear error before any compute
        pred = clf.predict(gold.texts, batch_size=batch_size)
        scores = classification_scores(gold.labels, pred, clf.labels)
        scores["skipped"] = gold.skipped
        scores["skipped_lines"] = gold.skipped_lines or []
    if gold.skipped:
        shown = ", ".join(map(str, scores["skipped_lines"][:10])) + (", ..." if gold.skipped > 10 else "")
        err_console.print(f"skipped {gold.skipped} bad or unlabelled record{'s' if gold.skipped > 1 else ''} of "
                          f"{data} (lines {shown}); scored {len(gold.texts)}", highlight=False, soft_wrap=True)
    print(json.dumps(scores, indent=2) if as_json else format_scores(scores))
