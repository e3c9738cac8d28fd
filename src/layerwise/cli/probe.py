"""``layerwise probe``: train a probe on every layer and on the layer strategies; tables, plots and a report."""

from __future__ import annotations

from typing import Optional

import typer

from ..model.options import ModelOptions
from .options import check_flag, err_console, model_flags, user_errors


@model_flags
def probe(
    train: str = typer.Option(
        ..., "--train", help="Tagging: CoNLL-2003 (.conll) or CoNLL-U (.conllu); sentence: .tsv/.csv/.jsonl."
    ),
    dev: str = typer.Option(..., "--dev", help="Dev file: scored (nothing is chosen on it); reported without --test."),
    test: Optional[str] = typer.Option(None, "--test", help="Optional test file: scored and reported."),
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
    epochs: Optional[int] = typer.Option(
        None, "--epochs", help="MLP/BiLSTM: at most this many epochs (default: a budget that follows the data). The "
                               "linear probe is solved to convergence."),
    lr: float = typer.Option(1e-3, "--lr", help="MLP/BiLSTM: Adam's learning rate."),
    control: bool = typer.Option(
        False, "--control", help="Also train each layer's probe on a control task (random label per word type) "
                                 "and report selectivity (Hewitt & Liang 2019)."),
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
    feature_dtype: str = typer.Option(
        "float16", "--feature-dtype", help="The dtype of the features cached in OUTPUT/features and probed: float16 "
                                           "(half the disk; the probes compute in float32) or float32."),
    mdl: bool = typer.Option(
        False, "--mdl", help="Linear probe: also each layer's online code length of the training labels, in kbits, "
                             "and its compression (Voita & Titov 2020)."),
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
    from ..probe.data import TASKS
    from ..probe.metrics import SCHEMES
    from ..probe.models import PROBES

    with user_errors():
        for flag, value, valid in (("--task", task, TASKS), ("--probe", probe_kind, PROBES), ("--scheme", scheme,
                                                                                               SCHEMES)):
            check_flag(flag, value, valid)
        config = ProbeConfig(task=task, column=column, probe=probe_kind, crf=crf, hidden=hidden, epochs=epochs, lr=lr,
                             restarts=restarts, scheme=scheme, subword=subword, pool=pool,
                             document_context=document_context, layers_only=layers_only, control=control,
                             mdl=mdl, feature_dtype=feature_dtype)
        res = run(train, dev, test, config, model=model_options, output=output, text_field=text_field,
                  format=fmt, overwrite=overwrite,
                  log=lambda line: err_console.print(line, highlight=False, soft_wrap=True, markup=False))
    from ..probe.report import method_note, noise_note

    notes = "".join(f"\nwarning: {note}" for note in res.unseen_notes())
    print(f"{res.task_title}\n\n{res.to_markdown()}\n{notes}")  # the results on stdout (Markdown), logs on stderr
    best = res.best
    err_console.print(noise_note(res), highlight=False, markup=False)
    if method_note(res):
        err_console.print(method_note(res), highlight=False, markup=False)
    err_console.print(
        f"best: {best['name']} ({res.reported} {res.metric_name} {100 * best[f'{res.reported}_mean']:.2f}); wrote "
        f"{', '.join(p.name for p in res.files.values())} to {output} in {res.seconds:.0f}s",
        highlight=False, markup=False,
    )
