"""Control tasks (Hewitt & Liang 2019): does a probe read the layer, or memorise its training labels?

Each word type (lower-cased; for a sentence task, each distinct text) gets one fixed label drawn at random from the
training split's label distribution; the same probe is trained on these labels and scored on them. A layer whose
probe scores high on the task but also on its control encodes little that the probe did not learn by itself:
``selectivity = task accuracy - control accuracy`` (Hewitt & Liang report it in accuracy points).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .data import ProbeSplit


def types_of(split: ProbeSplit, name: str) -> list[str]:
    """The type of every row: tagging, the lower-cased word (from the split's store); a sentence task, the record's
    text where the store keeps it, else the record itself (``name:index``: every record its own type)."""
    store = split.store
    if split.offsets is not None:
        return [w.lower() for i in range(len(store)) for w in store.words(i)]
    if store is not None and "text" in store.columns:
        return [str(t) for t in store.column("text")]
    return [f"{name}:{i}" for i in range(len(split))]


def control_splits(splits: dict[str, ProbeSplit], seed: int = 0) -> dict[str, ProbeSplit]:
    """The splits with their labels replaced by the control task's: one label per type, drawn from the training
    split's label distribution (seeded), shared by every split where the type occurs."""
    counts = Counter(splits["train"].labels)
    names = sorted(counts)
    p = np.array([counts[n] for n in names], dtype=np.float64)
    p /= p.sum()
    rng = np.random.default_rng(seed)
    label_of: dict[str, str] = {}
    out = {}
    for name, split in splits.items():
        labels = []
        for t in types_of(split, name):
            if t not in label_of:
                label_of[t] = names[int(rng.choice(len(names), p=p))]
            labels.append(label_of[t])
        out[name] = ProbeSplit(split.x, labels, split.offsets, split.store)
    return out
