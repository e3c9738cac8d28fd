"""``lw.probe.run``: which layer knows what, in one pass (extract every layer once, train every probe from the cache).

Example::

    >>> import layerwise as lw
    >>> res = lw.probe.run("en_ewt-ud-train.conllu", "en_ewt-ud-dev.conllu", task="tagging", column="upos",
    ...                    output="probe-upos")                                          # doctest: +SKIP
    >>> res.best["name"], res.best["dev_mean"]                                          # doctest: +SKIP
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from ..extractor import Extractor
from .data import ProbeSplit, check_task, split_features
from .metrics import SCHEMES, detect_scheme
from .models import PROBES, probe_specs
from .train import ProbeOptions, fit_probe


@dataclass
class ProbeResults:
    """Every probe's scores (mean and std over restarts), the layer similarity matrix and the run's provenance."""

    task: str
    task_title: str
    metric_name: str
    restarts: int
    rows: list[dict]
    cka: list[list[float]]
    options: dict
    provenance: dict
    seconds: float
    extract_seconds: float
    files: dict = field(default_factory=dict)

    @property
    def best(self) -> dict:
        """The probe with the highest mean dev score."""
        return max(self.rows, key=lambda r: r["dev_mean"])

    def provenance_line(self) -> str:
        p = self.provenance
        return (f"Model {p['model']} ({p['num_layers']} layers); train {p['train']}; dev {p['dev']}; probe "
                f"{self.options['probe']}; {self.restarts} restart(s); wall time {self.seconds:.0f}s "
                f"(extraction {self.extract_seconds:.0f}s); layerwise {p['layerwise_version']}.")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("files", None)
        return d

    def to_markdown(self) -> str:
        from .report import markdown

        return markdown(self)


def run(
    train: str | os.PathLike,
    dev: str | os.PathLike,
    test: str | os.PathLike | None = None,
    *,
    task: str = "tagging",
    column: str | None = None,
    format: str | None = None,
    text_field: str | None = None,
    model: str | os.PathLike | Extractor | None = None,
    device: str | None = None,
    output: str | os.PathLike = "probe-results",
    probe: str = "linear",
    crf: bool = False,
    hidden: int = 256,
    epochs: int = 8,
    lr: float = 1e-3,
    restarts: int = 1,
    scheme: str = "auto",
    subword: str = "first",
    pool: str = "mean",
    document_context: bool = False,
    layers_only: bool = False,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
) -> ProbeResults:
    """Probe every layer and the BERT-paper layer strategies on a tagging or sentence task.

    Args:
        train, dev, test: tagging: CoNLL-2003 (``.conll``) or CoNLL-U (``.conllu``); sentence: TSV/CSV/JSONL.
        task: ``tagging`` (one label per word) or ``sentence`` (one label per record).
        column: tag column (CoNLL-2003: ``ner`` default, ``chunk``, ``pos``; CoNLL-U: ``upos`` default, ``xpos``)
            or the sentence label column (default ``label``).
        model: encoder directory / hub id / :class:`Extractor` (default: embedded all-MiniLM-L6-v2).
        output: directory for ``features/`` (cached stores) and the result files.
        probe: ``linear`` (default), ``mlp`` (``hidden`` units) or ``bilstm`` (tagging; 2 layers, ``hidden`` per
            direction; the BERT paper used 768), with ``crf=True`` for a CRF output layer.
        restarts: seeds per probe; tables show mean ± std (the paper averages 5).
        scheme: tag scheme for entity F1: ``auto`` (detected), ``IOB1``, ``IOB2``, ``IOBES`` or ``none``.
        subword: how a word's sub-tokens are pooled (``first`` as in the paper; ``mean``, ``last``, ...).
        pool: sentence tasks: how tokens are pooled per layer.
        document_context: CoNLL-2003: encode sentences with their document neighbours (the paper's setting).
        layers_only: train single-layer probes only (skip the strategies).

    Returns:
        :class:`ProbeResults`; the files are written into ``output``.
    """
    from .. import __version__
    from .report import cka_matrix, terminal_table, write_all

    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if probe not in PROBES:
        raise ValueError(f"unknown probe {probe!r}. Valid probes are: {', '.join(PROBES)}")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}. Valid schemes are: {', '.join(SCHEMES)}")
    if isinstance(restarts, bool) or not isinstance(restarts, int) or restarts < 1:
        raise ValueError(f"restarts must be a positive int, got {restarts!r}")
    if probe == "bilstm" and task != "tagging":
        raise ValueError("probe='bilstm' reads sentences word by word: use it with task='tagging'")
    fmt, column = check_task(task, train, column, format)
    for other in (dev, test):
        if other is not None:
            check_task(task, other, column, format)
    t0 = time.perf_counter()
    ex = model if isinstance(model, Extractor) else Extractor(model, device=device)
    out = Path(output)
    splits: dict[str, ProbeSplit] = {}
    for name, path in (("train", train), ("dev", dev), ("test", test)):
        if path is None:
            continue
        say(f"features: {name} ({os.fspath(path)})")
        splits[name] = split_features(ex, path, out / "features" / name, task=task, fmt=fmt, column=column,
                                      subword=subword, pool=pool, text_field=text_field,
                                      document_context=document_context, progress=progress)
    extract_seconds = time.perf_counter() - t0
    labels = sorted(set(splits["train"].labels))
    if len(labels) < 2:
        raise ValueError(f"the training data has a single class ({labels[0]!r}); a probe needs at least two")
    if task == "tagging":
        if scheme == "auto":  # an "O" between sentences: a tag never continues a chunk of the previous sentence
            scheme = detect_scheme([t for sent in splits["train"].sentences for t in ("O", *sent)])
        metric = "entity F1" if scheme != "none" else "accuracy"
        title = f"{column.upper()} tagging ({os.path.basename(os.fspath(train))})"
    else:
        scheme, metric = "none", "accuracy"
        title = f"{column} classification ({os.path.basename(os.fspath(train))})"
    opts = ProbeOptions(probe=probe, crf=crf, hidden=hidden, epochs=epochs, lr=lr, device=str(ex.loaded.device))
    specs = probe_specs(ex.num_layers)
    if layers_only:
        specs = [s for s in specs if s.kind == "layer"]
    done: dict[tuple, dict] = {}
    rows = []
    for spec in specs:
        key = (spec.layers, spec.combine)
        if key not in done:
            runs = [fit_probe(spec, splits["train"], splits["dev"], splits.get("test"), task=task, labels=labels,
                              scheme=scheme, opts=opts, seed=seed) for seed in range(restarts)]
            done[key] = _summarise(runs)
            say(f"{spec.name:<34} dev {metric} {100 * done[key]['dev_mean']:.2f}"
                + (f" ± {100 * done[key]['dev_std']:.2f}" if restarts > 1 else ""))
        rows.append({"name": spec.name, "kind": spec.kind, "layers": list(spec.layers), "combine": spec.combine,
                     **done[key]})
    cka = cka_matrix(splits["dev"].x.float().numpy())
    results = ProbeResults(
        task=task, task_title=title, metric_name=metric, restarts=restarts, rows=rows, cka=cka.round(4).tolist(),
        options={"probe": probe, "crf": crf, "hidden": hidden, "epochs": epochs, "lr": lr, "scheme": scheme,
                 "subword": subword, "pool": pool, "document_context": document_context, "column": column},
        provenance={"model": ex.loaded.name, "num_layers": ex.num_layers, "hidden_size": ex.hidden_size,
                    "train": os.fspath(train), "dev": os.fspath(dev), "test": os.fspath(test) if test else None,
                    "train_rows": len(splits["train"]), "dev_rows": len(splits["dev"]),
                    "layerwise_version": __version__, "labels": labels},
        seconds=0.0, extract_seconds=round(extract_seconds, 1),
    )
    results.seconds = round(time.perf_counter() - t0, 1)
    results.files = write_all(results, out)
    from rich.console import Console

    Console(stderr=True).print(terminal_table(results))
    return results


def _summarise(runs) -> dict:
    main = lambda s: s.get("f1", s["accuracy"])  # noqa: E731
    dev = np.array([main(r.dev) for r in runs])
    out = {"dev_mean": float(dev.mean()), "dev_std": float(dev.std(ddof=1)) if len(runs) > 1 else 0.0,
           "dev_accuracy": float(np.mean([r.dev["accuracy"] for r in runs])),
           "dev_runs": [round(float(v), 5) for v in dev], "epochs": [r.epochs for r in runs]}
    if runs[0].test is not None:
        test = np.array([main(r.test) for r in runs])
        out.update(test_mean=float(test.mean()), test_std=float(test.std(ddof=1)) if len(runs) > 1 else 0.0)
    if runs[0].weights is not None:
        out["weights"] = [round(float(w), 4) for w in np.mean([r.weights for r in runs], axis=0)]
    return out
