"""Training a head: frozen (features cached once in a store, cheap epochs) or fine-tuned; early stopping on a
held-out part of train, so the dev (and test) scores are never those of the split the epoch was chosen on.

Example::

    >>> import layerwise as lw
    >>> cfg = lw.heads.HeadConfig(layers="-4:", pool="max", combine="concat", classifier="mlp", dropout=0.2)
    >>> opts = lw.heads.TrainOptions(epochs=10, seed=0)
    >>> result = lw.heads.train(cfg, "train.tsv", "dev.tsv", text_field="sentence", options=opts,
    ...                         output="sst2-head")                                        # doctest: +SKIP
    >>> result.dev["accuracy"], result.best_epoch                                                # doctest: +SKIP
"""

from __future__ import annotations

import copy
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..checks import positive_ints, positive_numbers
from ..errors import LayerwiseError
from ..extractor import Extractor
from ..model.backends.auto import AutoBackend
from ..model.loading import DEFAULT_MODEL_NAME
from ..model.options import ModelOptions
from ..training.budget import MIN_HELD_OUT, held_out_count, patience_for, steps_by_data
from ..training.early_stopping import EarlyStopping
from ..training.rng import seeded
from .classifier import SequenceClassifier, owned_model_dir
from .config import HeadConfig
from .data import (
    FrozenFeatures,
    cached_store,
    check_record_file,
    encode_labels,
    frozen_features,
    label_map,
    read_labelled,
)
from .metrics import classification_scores

METRICS = ("accuracy", "macro_f1")


@dataclass(frozen=True)
class TrainOptions:
    """How a head is trained (what it is: :class:`HeadConfig`).

    Attributes:
        epochs: at most this many epochs; ``None`` (default): frozen heads get a budget that follows the data
            (:meth:`epochs_for`), fine-tuned ones 10 epochs.
        lr, batch_size, weight_decay: AdamW training; ``encoder_lr`` for the encoder in ``finetune`` mode.
        seed: the same seed gives the same model (and the same held-out records); the caller's global RNG state is
            left untouched.
        patience: stop after this many epochs without a better score on the held-out records; ``None`` (default):
            a quarter of the epochs, at least 3 (:func:`~layerwise.training.budget.patience_for`).
        metric: ``accuracy`` or ``macro_f1`` (early stopping and model selection).
        held_out: the share of the training records (at least one) held out of training to choose the epoch on;
            ``0``: choose on dev, whose score then is not an unbiased estimate (``metrics.json`` says which).
        cache_dir: where frozen features are cached (default ``~/.cache/layerwise/features``).
        progress: progress bars (``True``/``False``; default: a bar on a terminal, else a plain line every 30 s once
            the work has run that long: :mod:`layerwise.progress`).
    """

    epochs: int | None = None
    lr: float = 1e-3
    encoder_lr: float = 2e-5
    batch_size: int = 32
    weight_decay: float = 0.01
    seed: int = 0
    patience: int | None = None
    metric: str = "accuracy"
    cache_dir: str | os.PathLike | None = None
    progress: bool | None = None
    held_out: float = 0.1

    def __post_init__(self) -> None:
        positive_ints(batch_size=self.batch_size)
        if self.patience is not None:
            positive_ints(patience=self.patience)
        if self.epochs is not None:
            positive_ints(epochs=self.epochs)
        if isinstance(self.held_out, bool) or not isinstance(self.held_out, (int, float)) or \
                not 0 <= self.held_out < 1:
            raise LayerwiseError(f"held_out must be a share of the training records in [0, 1), got "
                                 f"{self.held_out!r}; 0 chooses the epoch on dev")
        positive_numbers(lr=self.lr, encoder_lr=self.encoder_lr)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise LayerwiseError(f"seed must be an int, got {self.seed!r}")
        if self.metric not in METRICS:
            raise LayerwiseError(f"unknown metric {self.metric!r}. Valid metrics are: {', '.join(METRICS)}")

    def epochs_for(self, batches_per_epoch: int, mode: str) -> int:
        """The epochs to train at most: :attr:`epochs` when given; else, frozen: the epochs of
        :func:`~layerwise.training.budget.steps_by_data`; fine-tuned: 10."""
        if self.epochs is not None:
            return self.epochs
        if mode == "finetune":
            return 10
        return max(1, -(-steps_by_data(batches_per_epoch) // max(1, batches_per_epoch)))


@dataclass
class TrainResult:
    """What :func:`train` did: the best model, the epoch log, its dev (and test) scores, learned layer weights."""

    classifier: SequenceClassifier
    log: list[dict]
    best_epoch: int
    dev: dict
    test: dict | None = None
    layers: list[dict] = field(default_factory=list)  # per layer: index, learned weight, own dev score (per_layer)
    seconds: float = 0.0
    feature_seconds: float = 0.0
    output: Path | None = None
    chosen_on: str = ""  # what the best epoch was chosen on (a held-out part of train, or dev)

    def _repr_html_(self) -> str:
        """The head's scores, the best epoch, the epoch curve and the learned layer weights, for notebooks."""
        from ..display import card, svg_curve, table

        def scores(d: dict | None) -> str:
            return "-" if not d else ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                                               for k, v in d.items() if not isinstance(v, (dict, list)))

        metric = next((k for k in ("dev_accuracy", "dev_f1", "dev_macro_f1") if self.log and k in self.log[0]), None)
        parts = [table(["layer", "learned weight", "own dev score"],
                       [[r.get("index", r.get("layer")), r.get("weight", "-"), r.get("dev", "-")]
                        for r in self.layers])] if self.layers else []
        if metric:
            parts.append(svg_curve([e.get("epoch", i) for i, e in enumerate(self.log)],
                                   [e[metric] for e in self.log], title=f"{metric} per epoch"))
        return card("TrainResult", [("best epoch", self.best_epoch), ("dev", scores(self.dev)),
                                    ("test", scores(self.test)), ("seconds", f"{self.seconds:.1f}"),
                                    ("saved to", self.output or "-")], *parts)


class _Split:
    """One labelled split: frozen features or raw texts, with label indices; ``rows``: a part of them."""

    def __init__(self, y: torch.Tensor, feats: FrozenFeatures | None = None, texts: list[str] | None = None,
                 rows: torch.Tensor | None = None):
        self.feats, self.texts, self.rows = feats, texts, rows
        self.y = y if rows is None else y[rows]

    def __len__(self) -> int:
        return len(self.y)

    def take(self, rows: torch.Tensor) -> "_Split":
        """The records ``rows`` of this (whole) split."""
        return _Split(self.y, self.feats, self.texts, rows)

    def source_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Positions ``index`` of this split as rows of the features or texts it reads."""
        return index if self.rows is None else self.rows[index]


def held_out(split: _Split, share: float, gen: torch.Generator) -> tuple[_Split, _Split | None]:
    """``(fit, held)``: ``share`` of the records held out to choose the epoch on; ``(split, None)`` when ``share``
    is 0 or would hold out fewer than :data:`~layerwise.training.budget.MIN_HELD_OUT` records."""
    k = held_out_count(len(split), share)
    if not k:
        return split, None
    order = torch.randperm(len(split), generator=gen)
    return split.take(order[k:].sort().values), split.take(order[:k].sort().values)


def _load_splits(clf_config: HeadConfig, ex: Extractor, paths: dict, kw: dict, progress: bool | None,
                 say: Callable[[str], None]) -> tuple[dict, list[str]]:
    """Read every split (frozen: through the feature cache); fix the label list from train; report skipped rows."""
    layers = clf_config.encode.resolve(ex, learned=True).layer_indices
    raw: dict[str, tuple[list[str], FrozenFeatures | None, list[str] | None]] = {}
    for name, path in paths.items():
        if clf_config.mode == "frozen":
            store = cached_store(ex, path, pool=clf_config.pool, layers=layers, site=clf_config.site,
                                 text_field=kw["text_field"], label_field=kw["label_field"], cache_dir=kw["cache_dir"],
                                 progress=progress, format=kw["format"], header=kw["header"])
            if len(store) == 0:
                raise LayerwiseError(
                    f"{os.fspath(path)!r} holds no usable record (empty file, or every record was bad); the bad "
                    f"records ({len(store.errors)}) are listed in {store.path / 'errors.jsonl'}: fix them and run again"
                )
            feats = frozen_features(store, layers, kw["label_field"], source=path)
            if not len(feats):
                raise LayerwiseError(f"{os.fspath(path)!r} holds no record with a label in column "
                                     f"{kw['label_field']!r}; name the label column with --label-column "
                                     f"(label_field=)")
            bad, unlabelled = len(store.errors), len(store) - len(feats)
            if bad or unlabelled:
                say(f"{name}: {len(feats)} records used; skipped {bad} bad (listed in {store.path / 'errors.jsonl'}) "
                    f"and {unlabelled} without a label")
            raw[name] = (feats.labels, feats, None)
        else:
            data = read_labelled(path, text_field=kw["text_field"], label_field=kw["label_field"], format=kw["format"],
                                 header=kw["header"])
            if data.skipped:
                say(f"{name}: {len(data.texts)} records used; skipped {data.skipped} bad or unlabelled "
                    f"(lines {_lines(data.skipped_lines or [])} of {os.fspath(path)})")
            raw[name] = (data.labels, None, data.texts)
    names = label_map(raw["train"][0])
    splits = {
        name: _Split(encode_labels(labels, names, f"the {name} file {os.fspath(paths[name])!r}"), feats, texts)
        for name, (labels, feats, texts) in raw.items()
    }
    return splits, names


def dev_from_train(splits: dict[str, _Split], opts: TrainOptions, train_path: str | os.PathLike,
                   say: Callable[[str], None]) -> TrainOptions:
    """Without a dev file: ``opts.held_out`` of train (10% when 0), drawn with ``opts.seed``, becomes ``splits["dev"]``
    and the rest ``splits["train"]``; the epoch is then chosen on it (the options returned hold nothing more out)."""
    import dataclasses

    share = opts.held_out or 0.1
    fit, held = held_out(splits["train"], share, torch.Generator().manual_seed(opts.seed))
    if held is None:
        raise LayerwiseError(f"the training file {os.fspath(train_path)!r} has {len(splits['train'])} usable records, "
                             f"too few to hold out a dev part of at least {MIN_HELD_OUT}: give a dev file (--dev)")
    splits["train"], splits["dev"] = fit, held
    say(f"no dev file: {len(held)} of the {len(fit) + len(held)} training records are held out as the dev set "
        f"(the epoch is chosen on them and the dev scores are theirs)")
    return dataclasses.replace(opts, held_out=0.0)


def _lines(lines: list[int], most: int = 10) -> str:
    shown = ", ".join(map(str, lines[:most]))
    return shown + (f", ... ({len(lines) - most} more)" if len(lines) > most else "")


def check_output(output: str | os.PathLike, overwrite: bool) -> None:
    """Before any work: refuse an output that is a file or a directory layerwise did not write as a model.

    An absent path or an empty directory is free; an earlier layerwise model directory (:func:`is_model_dir`) is
    replaced only with ``overwrite``; anything else is refused, ``overwrite`` or not
    (:meth:`OwnedOutput.check <layerwise.outputs.OwnedOutput.check>`).
    """
    owned_model_dir(output).check(overwrite)


def _batches(clf: SequenceClassifier, split: _Split, index: torch.Tensor, train: bool):
    dev = clf.extractor.loaded.device
    index = split.source_rows(index)
    if split.feats is not None:
        x, mask = split.feats.batch(index)
    else:
        texts = [(split.texts or [])[i] for i in index.tolist()]  # finetune mode: a split holds its texts
        x, mask = clf.train_features(texts) if train else clf.features(texts)
    return x.to(dev).float(), None if mask is None else mask.to(dev)


def _predict(clf: SequenceClassifier, split: _Split, per_layer: bool = False, batch: int = 512) -> torch.Tensor:
    """Predicted indices ``[n]`` (``per_layer=True``: ``[n, K]``, each layer's own classifier)."""
    clf.head.eval()
    encoder_mode(clf.extractor, training=False)
    out = []
    with torch.inference_mode():
        for start in range(0, len(split), batch):
            index = torch.arange(start, min(start + batch, len(split)))
            x, mask = _batches(clf, split, index, train=False)
            logits = clf.head.per_layer_logits(x) if per_layer else clf.head(x, mask)
            out.append(logits.argmax(-1).cpu())
    return torch.cat(out)


def _scores(clf: SequenceClassifier, split: _Split) -> dict:
    names = clf.labels
    pred = _predict(clf, split)
    return classification_scores([names[i] for i in split.y.tolist()], [names[i] for i in pred.tolist()], names)


def train(
    config: HeadConfig,
    train_path: str | os.PathLike,
    dev_path: str | os.PathLike | None = None,
    test_path: str | os.PathLike | None = None,
    *,
    options: TrainOptions | None = None,
    text_field: str | None = None,
    label_field: str = "label",
    format: str | None = None,
    output: str | os.PathLike | None = None,
    model: Extractor | ModelOptions | None = None,
    log: Callable[[str], None] | None = None,
    overwrite: bool = False,
    header: bool = True,
) -> TrainResult:
    """Train the head of ``config`` on ``train_path``, pick the epoch on a part held out of it, save to ``output``.

    The splits: train fits the head, and ``options.held_out`` of it (10%) is held out to choose the epoch on. Dev is
    scored after each epoch and reported (nothing is chosen on it unless ``held_out=0``); without ``dev_path``, the
    held-out part is the dev set and is what the scores are reported on. Test is scored once, at the end.

    Args:
        config: the head (its ``labels`` are filled from the training data).
        train_path, dev_path, test_path: TSV/CSV/JSONL (or parquet) files with a text and a label column; dev and
            test are optional.
        options: epochs, learning rates, batch size, seed, patience, metric, cache, progress
            (:class:`TrainOptions`; default ``TrainOptions()``).
        text_field, label_field, format: column names (default text: ``text`` else ``sentence``; or 1-based
            positions, ``"2"``) and file format.
        output: model directory to write (weights, config, labels, log, metrics).
        model: the encoder: a :class:`~layerwise.ModelOptions` (default: ``config.model``), or an already loaded
            :class:`Extractor` (frozen mode shares it; finetune mode updates it in place).
        log: receives one line per epoch (default: print to stderr).
        overwrite: replace an earlier layerwise model at ``output`` (anything else there is refused before work).
        header: whether a csv/tsv file's first row names its columns (``False``: columns by position).

    Returns:
        A :class:`TrainResult`.
    """
    opts = options or TrainOptions()
    for split, path in (("training", train_path), ("dev", dev_path), ("test", test_path)):
        if path is not None:  # a file of per-word tags is said before the model loads
            check_record_file(path, format, f"the {split} file")
    if output is not None:
        check_output(output, overwrite)
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    t0 = time.perf_counter()
    ex = model if isinstance(model, Extractor) else Extractor.from_options(model or config.options)
    if config.mode == "finetune" and (ex.backend.name not in ("torch", "auto") or ex.backend.precision == "int8"):
        raise LayerwiseError(
            f"mode='finetune' trains the encoder's weights, which needs backend='torch'; this encoder runs on "
            f"backend={ex.backend.name!r} ({ex.backend.precision}): use mode='frozen' (its features are cached) or the "
            f"torch or auto backend in float32"
        )
    if config.mode == "finetune" and isinstance(ex.backend, AutoBackend):
        ex.backend.torch_only("the encoder's weights are fine-tuned in place")  # an exported graph would be stale
    # the saved config names the encoder it was trained with, as options that load from any working directory
    used = ex.options if isinstance(model, Extractor) else (model or config.options)
    name = used.model if used.model is not None or ex.loaded.name == DEFAULT_MODEL_NAME else ex.loaded.name
    if name is not None and Path(name).expanduser().is_dir():
        name = str(Path(name).expanduser().resolve())
    # where it runs and where graphs are cached belong to the machine that loads the head, not to the head
    config = config.replace(model=used.replace(model=name, device=None, onnx_cache=None))
    paths = {"train": train_path, **({"dev": dev_path} if dev_path is not None else {}),
             **({"test": test_path} if test_path is not None else {})}
    kw = {"text_field": text_field, "label_field": label_field, "format": format, "cache_dir": opts.cache_dir,
          "header": header}
    splits, names = _load_splits(config, ex, paths, kw, opts.progress, say)
    if dev_path is None:  # the held-out part of train is the dev set: chosen on and reported
        opts = dev_from_train(splits, opts, train_path, say)
    feature_seconds = time.perf_counter() - t0
    config = config.replace(labels=names)
    with seeded(opts.seed, ex.loaded.device) as gen:
        clf = SequenceClassifier(config, ex)
        history, best_epoch, chosen_on = _fit(clf, splits, opts, gen, say, opts.progress)
    if dev_path is None:
        chosen_on = (f"the dev set held out of train ({len(splits['dev'])} records; no dev file): its scores are "
                     f"those of the part the epoch was chosen on")
    result = TrainResult(clf, history, best_epoch, _scores(clf, splits["dev"]), feature_seconds=feature_seconds,
                         chosen_on=chosen_on)
    if "test" in splits:
        result.test = _scores(clf, splits["test"])
    result.layers = _layer_report(clf, splits["dev"])
    result.seconds = time.perf_counter() - t0
    if output is not None:
        metrics = {"dev": result.dev, "test": result.test, "best_epoch": best_epoch, "chosen_on": chosen_on,
                   "layers": result.layers,
                   "seconds": result.seconds, "feature_seconds": feature_seconds, "metric": opts.metric,
                   "seed": opts.seed}
        result.output = clf.save(output, log=history, metrics=metrics)
    return result


def encoder_mode(ex: Extractor, *, training: bool) -> None:
    """Put a PyTorch encoder in train or eval mode (a TensorFlow/Keras encoder is only ever run for inference)."""
    if isinstance(ex.model, torch.nn.Module):
        ex.model.train(training)


def _fit(clf: SequenceClassifier, splits: dict[str, _Split], opts: TrainOptions, gen: torch.Generator,
         say: Callable[[str], None], show: bool | None) -> tuple[list[dict[str, Any]], int, str]:
    """The epoch loop with early stopping on a held-out part of train (``opts.held_out``; on dev when 0); leaves
    ``clf`` at its best epoch. Returns the log, the best epoch and what it was chosen on."""
    from ..progress import progress_bar

    ex, config = clf.extractor, clf.config
    params = [{"params": list(clf.head.parameters()), "lr": opts.lr}]
    if config.mode == "finetune":
        ex.loaded.ensure_depth(max(clf.layers))  # a model loaded by depth: the blocks it trains, read before AdamW
        if ex.loaded.blocks is not None:
            ex.loaded.blocks.hold_in_compute()
        params.append({"params": [p for p in ex.model.parameters() if not p.is_meta], "lr": opts.encoder_lr})
    opt = torch.optim.AdamW(params, weight_decay=opts.weight_decay)
    tr, held = held_out(splits["train"], opts.held_out, gen)
    last = held is None and opts.held_out > 0  # too few records to hold out: the whole budget, the last epoch kept
    judge, judged = (held, "held-out") if held is not None else (splits["dev"], "dev")
    epochs = opts.epochs_for(-(-len(tr) // opts.batch_size), config.mode)
    history: list[dict[str, Any]] = []
    patience = opts.patience if opts.patience is not None else patience_for(epochs)
    stop: EarlyStopping[tuple[dict[str, Any], dict[str, Any] | None]] = EarlyStopping(patience)
    for epoch in range(1, epochs + 1):
        t_epoch = time.perf_counter()
        clf.head.train()
        encoder_mode(ex, training=config.mode == "finetune")
        order = torch.randperm(len(tr), generator=gen)
        total, seen = 0.0, 0
        steps = range(0, len(tr), opts.batch_size)
        for start in progress_bar(show, steps, total=len(steps), leave=False, desc=f"epoch {epoch}", unit="step",
                                  file=sys.stderr):
            index = order[start : start + opts.batch_size]
            x, mask = _batches(clf, tr, index, train=True)
            loss = clf.head.loss(x, tr.y[index].to(x.device), mask)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(index)
            seen += len(index)
        scores = _scores(clf, splits["dev"])  # logged; the epoch is chosen on `judge`
        chosen = _scores(clf, held) if held is not None else scores
        improved = stop.update(epoch, float(epoch) if last else chosen[opts.metric], lambda: (
            copy.deepcopy(clf.head.state_dict()),
            copy.deepcopy(ex.model.state_dict()) if config.mode == "finetune" else None))
        entry = {"epoch": epoch, "loss": total / seen, "dev_accuracy": scores["accuracy"],
                 "dev_macro_f1": scores["macro_f1"]}
        if held is not None:
            entry.update(held_out_accuracy=chosen["accuracy"], held_out_macro_f1=chosen["macro_f1"])
        entry.update(seconds=round(time.perf_counter() - t_epoch, 3), best=improved)
        history.append(entry)
        say(f"epoch {epoch}/{epochs}  loss {entry['loss']:.4f}  dev accuracy {scores['accuracy']:.4f}  "
            f"macro-F1 {scores['macro_f1']:.4f}"
            + (f"  held-out {opts.metric.replace('_', '-')} {chosen[opts.metric]:.4f}" if held is not None else "")
            + f"  {entry['seconds']:.1f}s{'  *best' if improved else ''}")
        if stop.stopped:
            say(f"early stop: no better {judged} {opts.metric} for {patience} epochs; keeping epoch "
                f"{stop.best_epoch}")
            break
    best_state = stop.best_or_raise()
    clf.head.load_state_dict(best_state[0])
    if best_state[1] is not None:
        ex.model.load_state_dict(best_state[1])
    encoder_mode(ex, training=False)
    clf.head.eval()
    chosen_on = (f"held-out {len(judge)} of the {len(splits['train'])} training records" if held is not None else
                 f"nothing: the last epoch (the {len(tr)} training records are too few to hold out "
                 f"{MIN_HELD_OUT})" if last else "dev (the dev scores are then not an unbiased estimate: held_out=0)")
    return history, stop.best_epoch, chosen_on


def _layer_report(clf: SequenceClassifier, dev: _Split) -> list[dict]:
    """Learned layer weights (``per_layer`` / ``scalar_mix``) and, for ``per_layer``, each layer's own dev accuracy."""
    weights = clf.head.layer_weights()
    if weights is None:
        return []
    report = [{"layer": int(i), "weight": float(w)} for i, w in zip(clf.layers, weights.tolist())]
    if clf.config.classifier == "per_layer":
        own = _predict(clf, dev, per_layer=True)  # [n, K]
        for k, entry in enumerate(report):
            entry["dev_accuracy"] = float((own[:, k] == dev.y).float().mean())
    return report
