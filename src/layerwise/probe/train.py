"""Training one probe on cached features and scoring it (dev and test), with restarts over seeds."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..checks import positive_ints, positive_numbers
from ..encoding.padding import pad_rows
from ..heads import LayerHead
from ..training.early_stopping import EarlyStopping
from ..training.rng import seeded
from .data import ProbeSplit
from .metrics import sentence_scores, tagging_scores
from .models import ProbeSpec, SequenceProbe, word_head


@dataclass
class ProbeOptions:
    """Training settings shared by every probe of a run."""

    probe: str = "linear"  # linear | mlp | bilstm
    crf: bool = False
    hidden: int = 256  # MLP hidden size / BiLSTM hidden size per direction
    dropout: float = 0.1
    epochs: int = 8
    patience: int = 2
    lr: float = 1e-3
    batch_size: int = 256  # rows (linear/MLP) or 32 sentences (BiLSTM)
    device: str = "cpu"

    def __post_init__(self) -> None:
        positive_ints(hidden=self.hidden, epochs=self.epochs, patience=self.patience, batch_size=self.batch_size)
        positive_numbers(lr=self.lr)


@dataclass
class ProbeRun:
    """Scores of one probe with one seed."""

    dev: dict
    test: dict | None
    epochs: int
    weights: list[float] | None = None  # learned layer weights (scalar mixes)
    extra: dict = field(default_factory=dict)


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
    """Train ``spec`` on ``train``; keep the epoch with the best dev score; score dev (and test) with it.

    Deterministic for a given ``seed``; the global Python, NumPy and torch random states are left untouched.
    """
    with seeded(seed, opts.device) as gen:
        return _fit(spec, train, dev, test, task=task, labels=labels, scheme=scheme, opts=opts, gen=gen)


def _epoch(model: SequenceProbe | LayerHead, optim: torch.optim.Optimizer, train: ProbeSplit, y: torch.Tensor,
           pos: list[int], order: torch.Tensor, batch: int, device: str) -> None:
    """One pass over ``train`` in ``order``: sentences for a sequence probe, rows (words or records) otherwise."""
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


def _fit(
    spec: ProbeSpec, train: ProbeSplit, dev: ProbeSplit, test: ProbeSplit | None, *, task: str, labels: list[str],
    scheme: str, opts: ProbeOptions, gen: torch.Generator,
) -> ProbeRun:
    index = {label: i for i, label in enumerate(labels)}
    pos = list(spec.layers)
    width = train.x.shape[-1]
    score = _Scorer(task, labels, scheme)
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
    stop: EarlyStopping[dict[str, torch.Tensor]] = EarlyStopping(opts.patience)
    for epoch in range(1, opts.epochs + 1):
        _epoch(model, optim, train, y, pos, torch.randperm(n_items, generator=gen), batch, opts.device)
        stop.update(epoch, _main(score(dev, predict(dev))),
                    lambda: {k: v.detach().clone() for k, v in model.state_dict().items()})
        if stop.stopped:
            break
    model.load_state_dict(stop.best_or_raise())
    run = ProbeRun(dev=score(dev, predict(dev)), test=score(test, predict(test)) if test is not None else None,
                   epochs=stop.best_epoch)
    w = model.layer_weights()
    if w is not None and spec.combine == "scalar_mix":
        run.weights = [round(float(v), 4) for v in w]
    return run
