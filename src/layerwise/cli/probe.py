"""``layerwise probe``: train a probe on every layer and on the layer strategies; tables, plots and a report."""

from __future__ import annotations

from typing import Optional

import typer

from ..model.options import ModelOptions
from .options import err_console, model_flags, user_errors


@model_flags
def probe(
    train: str = typer.Option(
        ..., "--train", help="Tagging: CoNLL-2003 (.conll) or CoNLL-U (.conllu); sentence: .tsv/.csv/.jsonl."
    ),
    dev: str = typer.Option(..., "--dev", help="Dev file (scores in the table and the plots)."),
    test: Optional[str] = typer.Option(None, "--test", help="Optional test file."),
    task: str = typer.Option("tagging", "--task", help="tagging (a label per word) or sentence (a label per record)."),
    column: Optional[str] = typer.Option(
        None, "--column", help="Tags: ner|chunk|pos (CoNLL-2003), upos|xpos (CoNLL-U); sentence: label column."
    ),
    text_field: Optional[str] = typer.Option(
        None, "--text-column", help="Sentence task: text column (default text, else sentence)."
    ),
    fmt: Optional[str] = typer.Option(None, "--format", help="Input format when the suffix does not tell."),
    output: str = typer.Option("probe-results", "--output", "-o", help="Directory for cached features and results."),
    probe_kind: str = typer.Option("linear", "--probe", help="linear, mlp or bilstm (tagging; 2 layers)."),
    crf: bool = typer.Option(False, "--crf", help="BiLSTM probe with a CRF output layer."),
    hidden: int = typer.Option(256, "--hidden", help="MLP hidden size / BiLSTM size per direction (paper: 768)."),
    epochs: int = typer.Option(8, "--epochs"),
    lr: float = typer.Option(1e-3, "--lr"),
    restarts: int = typer.Option(1, "--restarts", help="Seeds per probe; mean ± std reported (paper: 5)."),
    scheme: str = typer.Option("auto", "--scheme", help="Entity F1 scheme: auto, IOB1, IOB2, IOBES or none."),
    subword: str = typer.Option(
        "first", "--subword", help="Sub-token pooling per word: first (paper), last, mean, max."
    ),
    pool: str = typer.Option("mean", "--pool", help="Sentence task: token pooling per layer."),
    document_context: bool = typer.Option(
        False, "--document-context", help="CoNLL-2003: encode with document neighbours."
    ),
    layers_only: bool = typer.Option(False, "--layers-only", help="Single layers only, no strategies."),
    overwrite: bool = typer.Option(
        False, "--overwrite",
        help="Replace an earlier layerwise probe output in OUTPUT (never files it did not write); cached features "
             "made with other options are extracted again.",
    ),
    *,
    model_options: ModelOptions,
) -> None:
    """Which layer knows what: one probe per layer and per strategy, from features extracted once.

    Dev or test labels the training data lacks are named with their counts (a warning, the table, the reports).
    """
    from ..probe import ProbeConfig, run

    with user_errors():
        config = ProbeConfig(task=task, column=column, probe=probe_kind, crf=crf, hidden=hidden, epochs=epochs, lr=lr,
                             restarts=restarts, scheme=scheme, subword=subword, pool=pool,
                             document_context=document_context, layers_only=layers_only)
        res = run(train, dev, test, config, model=model_options, output=output, text_field=text_field,
                  format=fmt, overwrite=overwrite,
                  log=lambda line: err_console.print(line, highlight=False, soft_wrap=True, markup=False))
    best = res.best
    err_console.print(
        f"best: {best['name']} (dev {res.metric_name} {100 * best['dev_mean']:.2f}); wrote "
        f"{', '.join(p.name for p in res.files.values())} to {output} in {res.seconds:.0f}s",
        highlight=False, markup=False,
    )
