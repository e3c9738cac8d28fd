"""Training one probe on cached features and scoring it (dev and test), with restarts over seeds.

Nothing is chosen on a split that is scored: the linear probe's strength by cross-validation on the training split
(:mod:`layerwise.probe.linear`), the MLP and BiLSTM probes' stopping step on :data:`HELD_OUT` of the training
split's items (sentences for tagging), held out from their training (with fewer than ``MIN_HELD_OUT`` such items
the whole budget is trained and the last step kept). Their budget follows the data
(:func:`layerwise.training.budget.steps_by_data`; ``epochs`` sets it when given), checked about twice an epoch
with a patience of a quarter of the checks (:func:`layerwise.training.budget.patience_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import torch

from ..checks import positive_ints, positive_numbers
from ..encoding.padding import pad_rows
from ..heads import LayerHead
from ..training.budget import held_out_count, patience_for, steps_by_data
from ..training.early_stopping import EarlyStopping
from ..training.rng import seeded
from .data import ProbeSplit
from .linear import fit_linear
from .mdl import OnlineCode, online_code
from .metrics import sentence_scores, tagging_scores
from .models import ProbeSpec, SequenceProbe, word_head

HELD_OUT = 0.1  # share of the training items an MLP or BiLSTM probe stops on


@dataclass
class ProbeOptions:
    """Training settings shared by every probe of a run."""

    probe: str = "linear"  # linear | mlp | bilstm
    crf: bool = False
    hidden: int = 256  # MLP hidden size / BiLSTM hidden size per direction
    dropout: float = 0.1
    epochs: int | None = None  # MLP/BiLSTM: at most this many epochs; None: the budget follows the data
    patience: int | None = None  # checks without a better held-out score; None: a quarter of the checks, >= 3
    lr: float = 1e-3
    batch_size: int = 256  # rows (linear/MLP) or 32 sentences (BiLSTM)
    device: str = "cpu"

    def __post_init__(self) -> None:
        positive_ints(hidden=self.hidden, batch_size=self.batch_size)
        if self.patience is not None:
            positive_ints(patience=self.patience)
        if self.epochs is not None:
            positive_ints(epochs=self.epochs)
        positive_numbers(lr=self.lr)

    def budget(self, batches_per_epoch: int) -> tuple[int, int]:
        """``(steps, checks_every)``: the optimiser steps an MLP or BiLSTM probe may take and how often it is
        checked on the held-out part of train: :func:`~layerwise.training.budget.steps_by_data` (``epochs``
        epochs when given), checked about twice an epoch (every 10 to 200 steps)."""
        steps = batches_per_epoch * self.epochs if self.epochs is not None else steps_by_data(batches_per_epoch)
        return steps, max(1, min(steps, max(10, min(200, batches_per_epoch // 2))))


@dataclass
class ProbeRun:
    """Scores of one probe with one seed."""

    dev: dict
    test: dict | None
    epochs: int  # MLP/BiLSTM: the epoch of the step kept (fractional epochs rounded up); linear: 0
    weights: list[float] | None = None  # learned layer weights (scalar mixes)
    extra: dict = field(default_factory=dict)
    predictions: dict[str, list[int]] = field(default_factory=dict)  # split -> predicted label index per row
    fit: dict[str, Any] = field(default_factory=dict)  # how it was fitted: solver, C, iterations, steps...
    seconds: dict[str, float] = field(default_factory=dict)  # the linear probe: its strength scan's and fit's time


def _main(scores: dict) -> float:
    return scores.get("f1", scores["accuracy"])


class _Scorer:
    """Turns predicted label indices into the task's scores."""

    def __init__(self, task: str, labels: list[str], scheme: str):
        self.task, self.labels, self.scheme = task, labels, scheme

    def __call__(self, split: ProbeSplit, pred: list[int]) -> dict:
        names = [self.labels[i] if 0 <= i < len(self.labels) else "O" for i in pred]
        if self.task == "sentence":
            return sentence_scores(split.labels, names, self.labels)
        off = split.sentence_offsets
        pred_s = [names[off[i] : off[i + 1]] for i in range(len(off) - 1)]
        return tagging_scores(split.sentences, pred_s, self.scheme)


def _targets(split: ProbeSplit, index: dict[str, int]) -> torch.Tensor:
    # labels unseen in training get -100 (ignored in the loss, always wrong in the scores)
    return torch.tensor([index.get(label, -100) for label in split.labels], dtype=torch.long)


def _row_predict(head, split: ProbeSplit, pos: list[int], dev: str) -> list[int]:
    head.eval()
    out = []
    with torch.inference_mode():
        for s in range(0, len(split), 4096):
            out.append(head(split.x[s : s + 4096][:, pos].float().to(dev)).argmax(-1).cpu())
    return torch.cat(out).tolist()


def _sentence_batch(
    split: ProbeSplit, sents: list[int], pos: list[int], y: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sentences ``sents`` as ``(x [b, T, K, W], mask [b, T], tags [b, T])``, zero-padded (tags 0 where unknown)."""
    off = split.sentence_offsets
    spans = [(int(off[i]), int(off[i + 1])) for i in sents]
    x, mask = pad_rows([split.x[a:b][:, pos].float() for a, b in spans])
    if y is None:
        return x, mask, torch.zeros_like(mask)
    tags, _ = pad_rows([y[a:b].clamp_min(0) for a, b in spans])
    return x, mask, tags


def _seq_predict(model: SequenceProbe, split: ProbeSplit, pos: list[int], dev: str) -> list[int]:
    model.eval()
    out: list[int] = []
    n = len(split.sentence_offsets) - 1
    with torch.inference_mode():
        for s in range(0, n, 64):
            x, mask, _ = _sentence_batch(split, list(range(s, min(n, s + 64))), pos, None)
            for seq in model.predict(x.to(dev), mask.to(dev)):
                out.extend(seq)
    return out


def fit_probe(
    spec: ProbeSpec, train: ProbeSplit, dev: ProbeSplit, test: ProbeSplit | None, *, task: str, labels: list[str],
    scheme: str, opts: ProbeOptions, seed: int,
) -> ProbeRun:
    """Train ``spec`` on ``train`` (choosing its strength or its stopping step on ``train`` alone) and score dev
    (and test) with it; their predictions are kept for the intervals (:mod:`layerwise.probe.uncertainty`).

    Deterministic for a given ``seed``; the global Python, NumPy and torch random states are left untouched.
    """
    with seeded(seed, opts.device) as gen:
        if opts.probe == "linear":
            return _fit_linear(spec, train, dev, test, task=task, labels=labels, scheme=scheme, seed=seed)
        return _fit(spec, train, dev, test, task=task, labels=labels, scheme=scheme, opts=opts, gen=gen)


def sentence_ids(split: ProbeSplit) -> np.ndarray:
    """Tagging: the sentence index of every row ``[rows]``."""
    off = split.sentence_offsets
    return np.repeat(np.arange(len(off) - 1), np.diff(off))


def _fit_linear(spec: ProbeSpec, train: ProbeSplit, dev: ProbeSplit, test: ProbeSplit | None, *, task: str,
                labels: list[str], scheme: str, seed: int) -> ProbeRun:
    """The converged linear probe (:func:`layerwise.probe.linear.fit_linear`)."""
    pos = list(spec.layers)
    score = _Scorer(task, labels, scheme)
    y = _targets(train, {label: i for i, label in enumerate(labels)}).numpy()
    # contiguous layers (every probe's) are a view of the cached features, not a copy
    read = slice(pos[0], pos[-1] + 1) if pos == list(range(pos[0], pos[-1] + 1)) else pos
    fit = fit_linear(train.x[:, read], y, len(labels), spec.combine,
                     groups=sentence_ids(train) if task == "tagging" else None, seed=seed)

    def predict(split: ProbeSplit) -> list[int]:
        return [int(v) for s in range(0, len(split), 8192) for v in fit.predict(split.x[s : s + 8192][:, read])]

    predictions = {"dev": predict(dev), **({"test": predict(test)} if test is not None else {})}
    run = ProbeRun(dev=score(dev, predictions["dev"]),
                   test=score(test, predictions["test"]) if test is not None else None, epochs=0,
                   predictions=predictions, fit=fit.report(), seconds=fit.seconds)
    if fit.mix is not None:
        run.weights = [round(float(v), 4) for v in fit.mix]
    return run


def online_code_of(spec: ProbeSpec, train: ProbeSplit, labels: list[str], task: str, strength: float) -> OnlineCode:
    """The online code length of the training labels from ``spec``'s layers (:func:`~layerwise.probe.mdl.
    online_code`), with the linear probe at ``strength``; a tagging task's sentences stay whole in its blocks."""
    pos = list(spec.layers)
    read = slice(pos[0], pos[-1] + 1) if pos == list(range(pos[0], pos[-1] + 1)) else pos
    y = _targets(train, {label: i for i, label in enumerate(labels)}).numpy()
    return online_code(train.x[:, read], y, len(labels), strength, combine=spec.combine if len(pos) > 1 else "concat",
                       groups=sentence_ids(train) if task == "tagging" else None)


def held_out(train: ProbeSplit, seed: int, share: float = HELD_OUT) -> tuple[ProbeSplit, ProbeSplit | None]:
    """``(fit, held)``: ``train`` split by its items (sentences for tagging, records otherwise), ``share`` of them
    held out to stop on; ``(train, None)`` when that is fewer than :data:`~layerwise.training.budget.MIN_HELD_OUT`
    items (the whole budget is trained, the last step kept)."""
    items = len(train.sentence_offsets) - 1 if train.offsets is not None else len(train)
    k = held_out_count(items, share)
    if not k:
        return train, None
    order = np.random.default_rng(seed).permutation(items)
    return train.take(np.sort(order[k:])), train.take(np.sort(order[:k]))


def _steps(model: SequenceProbe | LayerHead, optim: torch.optim.Optimizer, train: ProbeSplit, y: torch.Tensor,
           pos: list[int], order: torch.Tensor, batch: int, device: str) -> Iterator[None]:
    """One pass over ``train`` in ``order`` (sentences for a sequence probe, rows otherwise), yielding after each
    optimiser step."""
    model.train()
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        if isinstance(model, SequenceProbe):
            x, mask, tags = _sentence_batch(train, idx.tolist(), pos, y)
            loss = model.loss(x.to(device), tags.to(device), mask.to(device))
        else:
            target = y[idx]
            keep = target >= 0  # labels unseen in training are -100
            if not bool(keep.any()):
                continue
            x = train.x[idx][:, pos].float().to(device)
            loss = torch.nn.functional.cross_entropy(model(x)[keep.to(device)], target[keep].to(device))
        optim.zero_grad()
        loss.backward()
        optim.step()
        yield
        model.train()


def _fit(
    spec: ProbeSpec, full: ProbeSplit, dev: ProbeSplit, test: ProbeSplit | None, *, task: str, labels: list[str],
    scheme: str, opts: ProbeOptions, gen: torch.Generator,
) -> ProbeRun:
    index = {label: i for i, label in enumerate(labels)}
    pos = list(spec.layers)
    width = full.x.shape[-1]
    score = _Scorer(task, labels, scheme)
    train, held = held_out(full, int(torch.randint(0, 2**31 - 1, (), generator=gen)))
    y = _targets(train, index)
    model: SequenceProbe | LayerHead
    if opts.probe == "bilstm":
        seq_model = SequenceProbe(spec, len(labels), width, hidden=opts.hidden, crf=opts.crf, dropout=opts.dropout)
        model = seq_model

        def predict(split: ProbeSplit) -> list[int]:
            return _seq_predict(seq_model, split, pos, opts.device)

        n_items = len(train.sentence_offsets) - 1
        batch = 32
    else:
        dropout = opts.dropout if opts.probe == "mlp" else 0.0
        row_model = word_head(spec, labels, width, opts.probe, opts.hidden, dropout)
        model = row_model

        def predict(split: ProbeSplit) -> list[int]:
            return _row_predict(row_model, split, pos, opts.device)

        n_items = len(train)
        batch = opts.batch_size
    model.to(opts.device)
    optim = torch.optim.Adam(model.parameters(), lr=opts.lr)
    per_epoch = -(-n_items // batch)
    budget, every = opts.budget(per_epoch)
    stop: EarlyStopping[dict[str, torch.Tensor]] = EarlyStopping(
        opts.patience if opts.patience is not None else patience_for(budget // every))
    step = 0
    while step < budget and not stop.stopped:
        for _ in _steps(model, optim, train, y, pos, torch.randperm(n_items, generator=gen), batch, opts.device):
            step += 1
            if step % every == 0 or step == budget:
                if held is None:  # too few items to hold out: the last step is kept
                    value = float(step)
                else:  # ties (a held-out part with no entity) broken by accuracy
                    scores = score(held, predict(held))
                    value = _main(scores) + 1e-4 * scores["accuracy"]
                stop.update(step, value,
                            lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})
            if stop.stopped or step >= budget:
                break
    model.load_state_dict(stop.best_or_raise())
    predictions = {"dev": predict(dev), **({"test": predict(test)} if test is not None else {})}
    run = ProbeRun(dev=score(dev, predictions["dev"]),
                   test=score(test, predictions["test"]) if test is not None else None,
                   epochs=-(-stop.best_epoch // per_epoch), predictions=predictions,
                   fit={"optimiser": "Adam", "lr": opts.lr, "steps": step, "budget": budget,
                        "best_step": stop.best_epoch, "stopped_early": stop.stopped,
                        "held_out_items": 0 if held is None else len(held.sentence_offsets) - 1
                        if held.offsets is not None else len(held)})
    w = model.layer_weights()
    if w is not None and spec.combine == "scalar_mix":
        run.weights = [round(float(v), 4) for v in w]
    return run
