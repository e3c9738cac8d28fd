"""Classification metrics (scikit-learn): accuracy, macro-F1, per-class precision/recall/F1, confusion matrix."""

from __future__ import annotations

from typing import Sequence

from ..errors import LayerwiseError


def classification_scores(gold: Sequence[str], pred: Sequence[str], labels: Sequence[str]) -> dict:
    """Scores of string predictions against string gold labels, over the class list ``labels``.

    Returns:
        dict: ``{"n", "accuracy", "macro_f1", "per_class": {label: {precision, recall, f1, support}},
        "labels", "confusion": [[...]]}`` where row ``i``, column ``j`` of ``confusion`` counts the records of gold
        label ``i`` predicted as label ``j``.
    """
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score, precision_recall_fscore_support

    labels = list(labels)
    if len(gold) != len(pred):
        raise LayerwiseError(f"{len(gold)} gold labels but {len(pred)} predictions")
    if not gold:
        raise LayerwiseError("nothing to score: no records")
    p, r, f, s = precision_recall_fscore_support(gold, pred, labels=labels, zero_division=0)
    return {
        "n": len(gold),
        "accuracy": float(accuracy_score(gold, pred)),
        "macro_f1": float(f1_score(gold, pred, labels=labels, average="macro", zero_division=0)),
        "per_class": {
            label: {"precision": float(p[i]), "recall": float(r[i]), "f1": float(f[i]), "support": int(s[i])}
            for i, label in enumerate(labels)
        },
        "labels": labels,
        "confusion": confusion_matrix(gold, pred, labels=labels).tolist(),
    }


def format_scores(scores: dict, title: str = "") -> str:
    """A plain-text report: headline scores (and ``scores["skipped"]`` records when set), the per-class table and
    the confusion matrix."""
    labels = scores["labels"]
    width = max(8, *(len(label) for label in labels))
    skipped = scores.get("skipped") or 0  # records left out of the scores (bad or unlabelled), when the caller says
    head = f"{title}n={scores['n']}  accuracy {scores['accuracy']:.4f}  macro-F1 {scores['macro_f1']:.4f}"
    lines = [head + (f"  (skipped {skipped} bad or unlabelled record{'s' if skipped != 1 else ''})" if skipped else ""),
             ""]
    lines.append(f"{'label':<{width}}  precision  recall     f1  support")
    for label in labels:
        c = scores["per_class"][label]
        lines.append(f"{label:<{width}}  {c['precision']:9.4f}  {c['recall']:6.4f}  {c['f1']:.4f}  {c['support']:7d}")
    lines += [
        "",
        "confusion (rows = gold, columns = predicted):",
        " " * width + "  " + "  ".join(f"{x:>7}" for x in labels),
    ]
    for label, row in zip(labels, scores["confusion"]):
        lines.append(f"{label:<{width}}  " + "  ".join(f"{v:>7d}" for v in row))
    return "\n".join(lines)
