"""Probe metrics: token accuracy, entity-level F1 (seqeval, conlleval-compatible), sentence accuracy and macro-F1."""

from __future__ import annotations

import re
import warnings
from typing import Sequence

from ..errors import LayerwiseError

SCHEMES = ("auto", "none", "IOB1", "IOB2", "IOBES")
_CHUNK_TAG = re.compile(r"^(?:[BIES]-.+|O)$")


def detect_scheme(tags: Sequence[str]) -> str:
    """``IOB1``/``IOB2``/``IOBES`` when every tag is ``O`` or ``X-TYPE`` (X in B, I, E, S), else ``none``.

    IOB2 (every chunk starts with B-) and IOB1 (B- only between two adjacent chunks of one type, as in the
    original CoNLL-2003 files) are told apart by whether an ``I-`` tag ever follows ``O`` or the sentence start.
    """
    distinct = set(tags)
    if not distinct or not all(_CHUNK_TAG.match(t) for t in distinct) or distinct == {"O"}:
        return "none"
    if any(t[:2] in ("E-", "S-") for t in distinct):
        return "IOBES"
    prev = "O"
    for t in tags:
        if t.startswith("I-") and (prev == "O" or prev[2:] != t[2:]):
            return "IOB1"
        prev = t
    return "IOB2"


def tagging_scores(gold: Sequence[Sequence[str]], pred: Sequence[Sequence[str]], scheme: str) -> dict:
    """``accuracy`` over words and, for chunk schemes, seqeval's entity ``f1``/``precision``/``recall``.

    seqeval's default mode follows conlleval (a chunk starts at ``B-`` or at an ``I-`` after another type or ``O``),
    which scores IOB1 and IOB2 files the same way conlleval does.
    """
    n = sum(len(s) for s in gold)
    if n == 0:
        raise LayerwiseError("nothing to score: no words")
    correct = sum(g == p for gs, ps in zip(gold, pred) for g, p in zip(gs, ps))
    out = {"accuracy": correct / n, "words": n}
    if scheme != "none":
        from seqeval.metrics import f1_score, precision_score, recall_score

        gold_l, pred_l = [list(s) for s in gold], [list(s) for s in pred]
        with warnings.catch_warnings():  # an early probe that predicts no entity scores 0, not a warning
            warnings.simplefilter("ignore")
            out.update(f1=float(f1_score(gold_l, pred_l)), precision=float(precision_score(gold_l, pred_l)),
                       recall=float(recall_score(gold_l, pred_l)))
    return out


def sentence_scores(gold: Sequence[str], pred: Sequence[str], labels: Sequence[str]) -> dict:
    """Accuracy and macro-F1 over the training labels ``labels`` and any gold label they lack.

    A gold label the training data lacks cannot be predicted: its records count as errors in accuracy, and its
    class enters the macro average with F1 0 (recall 0), as for any class a classifier never gets right.
    """
    from sklearn.metrics import accuracy_score, f1_score

    classes = list(labels) + sorted(set(gold) - set(labels))
    return {"accuracy": float(accuracy_score(gold, pred)),
            "macro_f1": float(f1_score(gold, pred, labels=classes, average="macro", zero_division=0))}
