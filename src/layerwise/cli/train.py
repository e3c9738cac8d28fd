"""``layerwise train``: a classifier head on hidden layers, with early stopping on dev; saved to a directory."""

from __future__ import annotations

import json
from typing import Optional

import typer

from ..errors import LayerwiseError
from ..model.options import ModelOptions
from .options import (
    LayersOpt,
    NoHeaderOpt,
    SiteOpt,
    WeightsOpt,
    check_flag,
    err_console,
    model_flags,
    parse_layers,
    parse_weights,
    user_errors,
)


def parse_sizes(text: str, option: str) -> list[int]:
    """'512,128' -> [512, 128]; ``ValueError`` naming the option and the bad item."""
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise LayerwiseError(f"{option} item {part!r} is not a positive int; give layer sizes like {option} "
                                 f"512,128")
        out.append(int(part))
    return out


@model_flags
def train(
    train_file: str = typer.Option(
        ..., "--train", help="Training file: .tsv, .csv, .jsonl (or .parquet) with a text and one label per record "
                             "(a tag per word, .conll/.conllu: layerwise probe --task tagging)."
    ),
    dev_file: Optional[str] = typer.Option(
        None, "--dev", help="Optional dev file: scored after every epoch and reported (the epoch is chosen on "
                            "--held-out of train, not on dev). Without it, the held-out part is the dev set."),
    test_file: Optional[str] = typer.Option(
        None, "--test", help="Optional test file, scored once with the chosen epoch's model."
    ),
    output: str = typer.Option(..., "--output", "-o", help="Model directory to write."),
    text_field: Optional[str] = typer.Option(
        None, "--text-column", "--text-field", help="Text column: a name or a position from 1 (default: text, "
                                                    "else sentence)."
    ),
    label_field: str = typer.Option(
        "label", "--label-column", "--label-field", help="Label column: a name or a position from 1 (labels may be "
                                                         "strings)."
    ),
    fmt: Optional[str] = typer.Option(
        None, "--format", help="Input format when the suffix does not tell: tsv, csv, jsonl, parquet."
    ),
    no_header: bool = NoHeaderOpt,
    layers: str = LayersOpt,
    site: str = SiteOpt,
    combine: str = typer.Option(
        "concat",
        "--combine",
        "-c",
        help="concat, sum, mean, weighted (--weights), scalar_mix (learned) or attention (learned, over layers).",
    ),
    weights: Optional[str] = WeightsOpt,
    pool: str = typer.Option(
        "mean", "--pool", "-p", help="cls, mean, max, mean_max, last (per layer) or attention (learned, over tokens)."
    ),
    head: str = typer.Option(
        "linear", "--head", help="linear, mlp or per_layer (one classifier per layer + learned weights)."
    ),
    hidden: str = typer.Option("256", "--hidden", help="MLP hidden sizes, comma-separated, e.g. 512,128."),
    activation: str = typer.Option("relu", "--activation", help="relu, gelu or tanh."),
    dropout: float = typer.Option(0.1, "--dropout", help="Dropout before each linear layer of the head."),
    mode: str = typer.Option(
        "frozen", "--mode", help="frozen (cached features, encoder fixed) or finetune (encoder updated)."
    ),
    epochs: Optional[int] = typer.Option(
        None, "--epochs", help="At most this many epochs (default: frozen, a budget that follows the data; "
                               "finetune, 10)."),
    lr: float = typer.Option(1e-3, "--lr", help="Head learning rate (AdamW)."),
    encoder_lr: float = typer.Option(2e-5, "--encoder-lr", help="Encoder learning rate in finetune mode."),
    batch_size: int = typer.Option(32, "--batch-size"),
    seed: int = typer.Option(0, "--seed", help="Same seed, same model."),
    patience: Optional[int] = typer.Option(
        None, "--patience", help="Epochs without a better held-out score before stopping (default: a quarter of the "
                                 "epochs, at least 3)."),
    held_out: float = typer.Option(
        0.1, "--held-out", help="Share of the training records held out to choose the epoch on (0: choose on dev, "
                                "whose score is then not an unbiased estimate)."),
    metric: str = typer.Option("accuracy", "--metric", help="accuracy or macro_f1 (model selection)."),
    cache_dir: Optional[str] = typer.Option(
        None, "--cache-dir", help="Frozen feature cache (default ~/.cache/layerwise/features)."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q",
                               help="No progress bars and no one-time work lines (exports)."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an earlier layerwise model in OUTPUT (never anything else)."
    ),
    *,
    model_options: ModelOptions,
) -> None:
    """Train a classifier on hidden layers; prints one line per epoch and the final dev/test scores.

    The splits: --train fits the head, with --held-out of it (10%) kept aside to choose the epoch on; --dev (optional)
    is scored and reported; --test (optional) is scored once at the end. Without --dev, the held-out part of train is
    the dev set.

    A classifier takes one label per record (a text and its label column). For a tag per word (NER, POS in CoNLL-2003
    or CoNLL-U files), measure the layers with layerwise probe --task tagging.
    """
    from ..heads import HeadConfig, TrainOptions
    from ..heads import train as run_train
    from ..heads.config import ACTIVATIONS, CLASSIFIERS, MODES
    from ..heads.metrics import format_scores
    from ..heads.train import METRICS
    from ..notices import set_quiet

    set_quiet(quiet)  # the one-time work's lines (exports, the runtime that takes over) too
    with user_errors():
        for flag, value, valid in (("--head", head, CLASSIFIERS), ("--mode", mode, MODES),
                                   ("--activation", activation, ACTIVATIONS), ("--metric", metric, METRICS)):
            check_flag(flag, value, valid)
        sizes = parse_sizes(hidden, "--hidden") if head == "mlp" else []
        config = HeadConfig(model=model_options, layers=parse_layers(layers), site=site, pool=pool, combine=combine,
                            weights=parse_weights(weights), classifier=head, hidden=sizes or [256],
                            activation=activation, dropout=dropout, mode=mode)
        options = TrainOptions(epochs=epochs, lr=lr, encoder_lr=encoder_lr, batch_size=batch_size, seed=seed,
                               patience=patience, metric=metric, cache_dir=cache_dir, held_out=held_out,
                               progress=False if quiet else None)
        result = run_train(
            config, train_file, dev_file, test_file, options=options, text_field=text_field, label_field=label_field,
            format=fmt, output=output, overwrite=overwrite, header=not no_header,
            log=lambda line: err_console.print(line, highlight=False, soft_wrap=True),
        )
    dev_name = "dev" if dev_file is not None else "dev (held out of train)"
    print(format_scores(result.dev, title=f"{dev_name} (best epoch {result.best_epoch}): "))
    if result.test is not None:
        print()
        print(format_scores(result.test, title="test: "))
    if result.layers:
        print("\nlearned layer weights: " + json.dumps(result.layers))
    err_console.print(
        f"best epoch chosen on {result.chosen_on}; saved to {output} in {result.seconds:.1f}s (features "
        f"{result.feature_seconds:.1f}s)", highlight=False
    )
