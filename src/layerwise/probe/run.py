"""``lw.probe.run``: which layer knows what, in one pass (extract every layer once, train every probe from the cache).

Example::

    >>> import layerwise as lw
    >>> config = lw.probe.ProbeConfig(task="tagging", column="upos")
    >>> res = lw.probe.run("en_ewt-ud-train.conllu", "en_ewt-ud-dev.conllu", config=config,
    ...                    output="probe-upos")                                          # doctest: +SKIP
    >>> res.best["name"], res.best["dev_mean"]                                          # doctest: +SKIP
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..errors import LayerwiseError
from ..extractor import Extractor
from ..model.options import ModelOptions
from ..store import open_store
from ..version import __version__
from .config import ProbeConfig
from .control import control_splits
from .data import ProbeSplit, check_task, extract_split, load_split
from .isolated import extract_isolated
from .mdl import FRACTIONS
from .metrics import detect_scheme
from .models import ProbeSpec, probe_specs
from .report import check_output, cka_matrix, markdown, unseen_notes, write_all
from .train import ProbeOptions, ProbeRun, fit_probe, online_code_of
from .uncertainty import RESAMPLES, interval, item_counts, resample_weights, resampled, within_noise


@dataclass
class ProbeResults:
    """Every probe's scores (mean and std over restarts), the layer similarity matrix and the run's provenance.

    ``unseen_labels`` counts, per scored split (``dev``, ``test``), the gold labels the training data lacks
    (``{"dev": {"LABEL": rows}}``, most frequent first; ``{}`` for a split without any): a probe cannot predict them,
    and the scores count them as the metric does (:meth:`unseen_notes` says how).
    """

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
    unseen_labels: dict = field(default_factory=dict)
    files: dict = field(default_factory=dict)
    scan_seconds: float = 0.0  # the linear probes' strength scans, summed (part of ``seconds``)

    @property
    def reported(self) -> str:
        """The split the scores are reported on: ``test`` when one was given, else ``dev`` (nothing is chosen on
        either: the probes choose on the training split)."""
        return "test" if any(r.get("test_mean") is not None for r in self.rows) else "dev"

    @property
    def best(self) -> dict:
        """The probe with the highest mean score on the reported split."""
        return max(self.rows, key=lambda r: r[f"{self.reported}_mean"])

    def within_noise(self) -> list[str]:
        """The probes whose reported score differs from the best's by less than the noise (paired bootstrap 95%
        interval of the difference holds 0), the best included."""
        return [r["name"] for r in self.rows if r.get("within_noise_of_best")]

    def unseen_notes(self) -> list[str]:
        """One sentence per split with labels the training data lacks (counts, names, how they are scored)."""
        return unseen_notes(self.unseen_labels, task=self.task, metric=self.metric_name,
                            rows={split: self.provenance.get(f"{split}_rows") for split in self.unseen_labels})

    def provenance_line(self) -> str:
        """The one-line provenance under the Markdown table: model, files, probe, restarts, times, version."""
        p = self.provenance
        return (f"Model {p['model']} ({p['num_layers']} layers); train {p['train']}; dev {p['dev']}; probe "
                f"{self.options['probe']}; {self.restarts} restart(s); wall time {self.seconds:.0f}s "
                f"(extraction {self.extract_seconds:.0f}s" + (
                    f"; strength scans {self.scan_seconds:.0f}s, {100 * self.scan_seconds / self.seconds:.0f}%"
                    if self.scan_seconds and self.seconds else "") + f"); layerwise {p['layerwise_version']}.")

    def _repr_html_(self) -> str:
        """The probe table (dev, and test when scored; mean and std over restarts) and the per-layer dev curve as
        inline SVG, for notebooks."""
        from ..display import card, svg_curve, table
        from .report import table_rows

        rows = table_rows(self)
        has_test = any(r["test"] is not None for r in rows)
        body = [[r["probe"], r["layers"], r["combine"], f"{100 * r['dev']:.2f} +- {100 * r['dev_std']:.2f}"]
                + ([f"{100 * r['test']:.2f}" if r["test"] is not None else "-"] if has_test else []) for r in rows]
        singles = [r for r in self.rows if r["kind"] == "layer"]
        best = self.best
        return card(
            f"ProbeResults: {self.task_title}",
            [("model", self.provenance.get("model")), ("metric", self.metric_name), ("restarts", self.restarts),
             ("best", f"{best['name']}: {100 * best['dev_mean']:.2f}")],
            table(["probe", "layers", "combine", f"dev {self.metric_name}"]
                  + ([f"test {self.metric_name}"] if has_test else []), body),
            svg_curve([r["layers"][0] for r in singles], [100 * r["dev_mean"] for r in singles],
                      title=f"dev {self.metric_name} per layer"),
        )

    def to_dict(self) -> dict:
        """Everything but ``files``, JSON-ready (what ``results.json`` holds besides its marker)."""
        d = asdict(self)
        d.pop("files", None)
        return d

    def to_markdown(self) -> str:
        """The results table in Markdown."""
        return markdown(self)


def run(
    train: str | os.PathLike,
    dev: str | os.PathLike,
    test: str | os.PathLike | None = None,
    config: ProbeConfig | None = None,
    *,
    model: ModelOptions | Extractor | str | os.PathLike | None = None,
    output: str | os.PathLike = "probe-results",
    text_field: str | None = None,
    format: str | None = None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    overwrite: bool = False,
) -> ProbeResults:
    """Probe every layer and the BERT-paper layer strategies on a tagging or sentence task.

    Args:
        train, dev, test: tagging: CoNLL-2003 (``.conll``) or CoNLL-U (``.conllu``); sentence: TSV/CSV/JSONL.
        config: task, column, probe kind, restarts, scheme, sub-word pooling... (:class:`ProbeConfig`).
        model: the encoder: its :class:`~layerwise.ModelOptions` (or just its directory / hub id), or an already
            loaded :class:`Extractor` (default: the embedded all-MiniLM-L6-v2).
        output: directory for ``features/`` (cached stores) and the result files (:data:`~.report.OUTPUT_FILES`).
        text_field, format: sentence tasks: the text column; the input format when the suffix does not tell.
        progress: extraction progress bars (default: when stderr is a terminal).
        log: receives one line per probe (default: stderr).
        overwrite: replace an earlier probe output in ``output`` (recognised by the marker ``"format":
            "layerwise-probe"`` in its ``results.json``): its result files are rewritten, and cached features in
            ``output/features`` made with other options (e.g. another ``subword``) are extracted again (those made
            with the same options are reused). Without it, an ``output`` holding any result file is refused; a file
            of those names that no probe run wrote is refused either way, before any work, and nothing else in
            ``output`` is ever touched.

    Returns:
        :class:`ProbeResults`; the files are written into ``output``. Dev or test labels the training data lacks
        are counted in ``unseen_labels``, logged as a warning and named in every report.
    """
    cfg = config or ProbeConfig()
    say = log or (lambda line: print(line, file=sys.stderr, flush=True))
    fmt, column = check_task(cfg.task, train, cfg.column, format)
    for other in (dev, test):
        if other is not None:
            check_task(cfg.task, other, column, format)
    cfg = cfg.replace(column=column)
    out = Path(output)
    check_output(out, overwrite)
    t0 = time.perf_counter()
    paths = {"train": train, "dev": dev, "test": test}
    given = {name: path for name, path in paths.items() if path is not None}
    jobs = [dict(path=path, store_dir=out / "features" / name, task=cfg.task, fmt=fmt, column=column,
                 subword=cfg.subword, pool=cfg.pool, text_field=text_field, document_context=cfg.document_context,
                 feature_dtype=cfg.feature_dtype)
            for name, path in given.items()]
    for name, path in given.items():
        say(f"features: {name} ({os.fspath(path)})")
    model_facts = _extract_all(model, jobs, out, progress, overwrite)
    # train is held in memory (every probe passes over it many times); dev and test, only scored, are read from
    # their stores a block of rows at a time
    splits = {name: load_split(path, out / "features" / name, task=cfg.task, column=column,
                               resident=name == "train") for name, path in given.items()}
    extract_seconds = time.perf_counter() - t0
    labels = sorted(set(splits["train"].labels))
    if len(labels) < 2:
        raise LayerwiseError(f"the training data has a single class ({labels[0]!r}); a probe needs at least two")
    scheme, metric, title = _task_terms(cfg, splits["train"], train)
    unseen = unseen_labels(labels, splits)
    for note in unseen_notes(unseen, task=cfg.task, metric=metric, rows={k: len(v) for k, v in splits.items()}):
        say(f"warning: {note}")
    spent: dict[str, float] = {}
    rows = _train_all(cfg, model_facts, splits, labels, scheme, metric, say, spent)
    results = ProbeResults(
        task=cfg.task, task_title=title, metric_name=metric, restarts=cfg.restarts, rows=rows,
        cka=cka_matrix(splits["dev"].x).round(4).tolist(),  # on sampled rows: never the whole split widened
        options=_options(cfg, scheme, column),
        provenance=_provenance(model_facts, paths, splits, labels),
        seconds=0.0, extract_seconds=round(extract_seconds, 1), unseen_labels=unseen,
    )
    results.seconds = round(time.perf_counter() - t0, 1)
    results.scan_seconds = round(spent.get("scan", 0.0), 1)
    results.files = write_all(results, out)
    return results


def _options(cfg: ProbeConfig, scheme: str, column: str) -> dict:
    """The run's settings as ``results.json`` records them, with what was chosen on which split and how the
    intervals were drawn."""
    strength_metric = ("token accuracy" if cfg.task == "tagging" else "accuracy") if cfg.probe == "linear" else None
    return {"probe": cfg.probe, "crf": cfg.crf, "hidden": cfg.hidden, "epochs": cfg.epochs, "lr": cfg.lr,
            "control": cfg.control, "selection": "the training split only (cross-validated strength, or a held-out "
            "part of train to stop on)", "strength_metric": strength_metric,
            "intervals": f"bootstrap 95%, items resampled {RESAMPLES} times",
            "scheme": scheme, "subword": cfg.subword, "pool": cfg.pool, "document_context": cfg.document_context,
            "column": column, "mdl": "online code (Voita & Titov 2020), linear probe at its chosen C, blocks at "
            + ", ".join(f"{f:g}" for f in FRACTIONS) + " of the training rows" if cfg.mdl else None}


def _extract_all(model: ModelOptions | Extractor | str | os.PathLike | None, jobs: list[dict[str, Any]], out: Path,
                 progress: bool | None, overwrite: bool) -> dict[str, Any]:
    """Every split's features extracted before any is loaded: with the caller's loaded Extractor in this process,
    else in a child process (:mod:`layerwise.probe.isolated`), falling back to this process when the child cannot
    start or fails (its error, if any, then raised here with its traceback). Returns :func:`_model_facts`."""
    if isinstance(model, Extractor):
        return _extract_here(model, jobs, progress, overwrite)
    options = ModelOptions.of(model)
    if extract_isolated(options, jobs, progress=progress, overwrite=overwrite):
        return _stored_facts(out / "features" / "train", options)
    ex = Extractor.from_options(options)
    facts = _extract_here(ex, jobs, progress, overwrite)
    del ex  # its runtime (compiled graphs, pools) let go before any feature is loaded
    gc.collect()
    return facts


def _extract_here(ex: Extractor, jobs: list[dict[str, Any]], progress: bool | None, overwrite: bool) -> dict[str, Any]:
    """Extract every split with ``ex`` in this process (:func:`extract_split`); returns :func:`_model_facts`."""
    for job in jobs:
        extract_split(ex, job["path"], job["store_dir"], task=job["task"], fmt=job["fmt"], column=job["column"],
                      subword=job["subword"], pool=job["pool"], text_field=job["text_field"],
                      document_context=job["document_context"], progress=progress, overwrite=overwrite,
                      feature_dtype=job["feature_dtype"])
    return _model_facts(ex)


def _stored_facts(store_dir: Path, options: ModelOptions) -> dict[str, Any]:
    """:func:`_model_facts` read from the model record of a store the child extracted (the device: where the
    options put the model)."""
    from ..model.loading import resolve_device

    model = open_store(store_dir).model
    return {"model": model["name"], "num_layers": int(model["num_layers"]), "hidden_size": int(model["hidden_size"]),
            "device": str(resolve_device(options.device))}


def _model_facts(ex: Extractor) -> dict[str, Any]:
    """What the probes and the report need of the model once its features are extracted: its name, layer count,
    width and device (so the model itself can be let go)."""
    return {"model": ex.loaded.name, "num_layers": ex.num_layers, "hidden_size": ex.hidden_size,
            "device": str(ex.loaded.device)}


def _provenance(facts: dict[str, Any], paths: dict[str, Any], splits: dict[str, ProbeSplit],
                labels: list[str]) -> dict:
    """Where the results came from: the model (:func:`_model_facts`), the input files, their row counts, the
    labels, the version."""
    return {"model": facts["model"], "num_layers": facts["num_layers"], "hidden_size": facts["hidden_size"],
            **{name: os.fspath(path) if path else None for name, path in paths.items()},
            **{f"{name}_rows": len(split) for name, split in splits.items()},
            **{f"{name}_sentences": len(split.sentence_offsets) - 1 for name, split in splits.items()
               if split.offsets is not None},
            "layerwise_version": __version__, "labels": labels}


def unseen_labels(labels: list[str], splits: dict[str, ProbeSplit]) -> dict[str, dict[str, int]]:
    """Per scored split (``dev``, ``test``, when given): the gold labels not in ``labels`` (the training data's),
    with their row counts, most frequent first (``{}`` for a split without any)."""
    known = set(labels)
    out: dict[str, dict[str, int]] = {}
    for name in ("dev", "test"):
        if name in splits:
            counts = Counter(label for label in splits[name].labels if label not in known)
            out[name] = dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return out


def _task_terms(cfg: ProbeConfig, train: ProbeSplit, path: str | os.PathLike) -> tuple[str, str, str]:
    """``(scheme, metric name, table title)`` of the task."""
    name = os.path.basename(os.fspath(path))
    if cfg.task != "tagging":
        return "none", "accuracy", f"{cfg.column} classification ({name})"
    scheme = cfg.scheme
    if scheme == "auto":  # an "O" between sentences: a tag never continues a chunk of the previous sentence
        scheme = detect_scheme([t for sent in train.sentences for t in ("O", *sent)])
    metric = "entity F1" if scheme != "none" else "accuracy"
    return scheme, metric, f"{str(cfg.column).upper()} tagging ({name})"


def _train_all(cfg: ProbeConfig, facts: dict[str, Any], splits: dict[str, ProbeSplit], labels: list[str], scheme: str,
               metric: str, say: Callable[[str], None], spent: dict[str, float] | None = None) -> list[dict]:
    """Train every probe (every layer, then the strategies) with ``cfg.restarts`` seeds (once for a one-layer linear
    probe: convex, solved exactly); one table row each, with bootstrap intervals on every scored split and, on the
    reported split (test when given, else dev), whether it is inside the noise of the best probe. ``spent``
    receives the linear probes' seconds by part (``scan``, ``fit``), summed."""
    opts = ProbeOptions(probe=cfg.probe, crf=cfg.crf, hidden=cfg.hidden, epochs=cfg.epochs, lr=cfg.lr,
                        patience=cfg.patience, device=facts["device"])
    specs = probe_specs(facts["num_layers"])
    if cfg.layers_only:
        specs = [s for s in specs if s.kind == "layer"]
    scored = [name for name in ("dev", "test") if name in splits]
    reported = scored[-1]
    items = {name: _gold_items(splits[name], cfg.task) for name in scored}
    weights = {name: resample_weights(len(items[name]), seed=i) for i, name in enumerate(scored)}
    control = control_splits(splits) if cfg.control else None
    done: dict[tuple, dict] = {}
    samples: dict[tuple, np.ndarray] = {}
    rows = []
    for spec in specs:
        key = (spec.layers, spec.combine)
        if key not in done:
            seeds = 1 if cfg.probe == "linear" and spec.combine != "scalar_mix" else cfg.restarts
            runs = [fit_probe(spec, splits["train"], splits["dev"], splits.get("test"), task=cfg.task, labels=labels,
                              scheme=scheme, opts=opts, seed=seed) for seed in range(seeds)]
            row = summarise(runs)
            if spent is not None:
                for each in runs:
                    for part, seconds in each.seconds.items():
                        spent[part] = spent.get(part, 0.0) + seconds
            for name in scored:
                draws = np.mean([resampled(item_counts(items[name], _predicted(r, name, labels, splits[name],
                                                                             cfg.task), metric), weights[name])
                                 for r in runs], axis=0)
                row[f"{name}_ci"] = [round(v, 5) for v in interval(draws)]
                if name == reported:
                    samples[key] = draws
            if control is not None and spec.kind == "layer":
                row.update(_control(spec, control, cfg, opts, reported, runs))
            if cfg.mdl and spec.kind == "layer":
                row["mdl"] = online_code_of(spec, splits["train"], labels, cfg.task, runs[0].fit["C"]).report()
            unconverged = [r.fit for r in runs if r.fit.get("converged") is False]
            if unconverged:
                say(f"warning: the {spec.name} probe did not converge in {unconverged[0]['iterations']} iterations "
                    f"(gradient norm {unconverged[0]['grad_norm']:.3g}); its score may understate the layer")
            done[key] = row
            ci = row[f"{reported}_ci"]
            say(f"{spec.name:<34} {reported} {metric} {100 * row[f'{reported}_mean']:.2f} "
                f"[{100 * ci[0]:.2f}, {100 * ci[1]:.2f}]" + (f" ± {100 * row[f'{reported}_std']:.2f}" if seeds > 1
                                                             else "")
                + (f"  selectivity {100 * row['selectivity']:.2f}" if "selectivity" in row else ""))
        rows.append({"name": spec.name, "kind": spec.kind, "layers": list(spec.layers),
                     "combine": spec.combine if len(spec.layers) > 1 else "-",  # one layer: nothing is combined
                     "fit_key": key, **done[key]})
    best = max(rows, key=lambda r: r[f"{reported}_mean"])
    best_key = best["fit_key"]
    for r in rows:
        r["reported"] = reported
        key = r.pop("fit_key")
        r["within_noise_of_best"] = key == best_key or within_noise(samples[best_key], samples[key])
    return rows


def _gold_items(split: ProbeSplit, task: str) -> list:
    """The gold labels item by item: tag sequences per sentence (tagging), labels per record (sentence)."""
    return split.sentences if task == "tagging" else list(split.labels)


def _predicted(run: ProbeRun, name: str, labels: list[str], split: ProbeSplit, task: str) -> list:
    """A run's predictions on split ``name`` as label names, item by item (as :func:`_gold_items`)."""
    names = [labels[i] if 0 <= i < len(labels) else "O" for i in run.predictions[name]]
    if task != "tagging":
        return names
    off = split.sentence_offsets
    return [names[off[i] : off[i + 1]] for i in range(len(off) - 1)]


def _control(spec: ProbeSpec, control: dict[str, ProbeSplit], cfg: ProbeConfig, opts: ProbeOptions, reported: str,
             runs: list[ProbeRun]) -> dict:
    """The control task's accuracy on the reported split for ``spec`` and the selectivity (task accuracy minus
    control accuracy, the first seed's)."""
    labels = sorted(set(control["train"].labels))
    run = fit_probe(spec, control["train"], control["dev"], control.get("test"), task=cfg.task, labels=labels,
                    scheme="none", opts=opts, seed=0)
    accuracy = (run.test if reported == "test" else run.dev)["accuracy"]  # type: ignore[index]
    task = (runs[0].test if reported == "test" else runs[0].dev)["accuracy"]  # type: ignore[index]
    return {"control_accuracy": round(float(accuracy), 5), "selectivity": round(float(task - accuracy), 5)}


def summarise(runs: list) -> dict:
    """Mean and std over restarts of the main dev (and test) score; mean learned layer weights; how each run was
    fitted (``fits``)."""
    main = lambda s: s.get("f1", s["accuracy"])  # noqa: E731
    dev = np.array([main(r.dev) for r in runs])
    out = {"dev_mean": float(dev.mean()), "dev_std": float(dev.std(ddof=1)) if len(runs) > 1 else 0.0,
           "dev_accuracy": float(np.mean([r.dev["accuracy"] for r in runs])),
           "dev_runs": [round(float(v), 5) for v in dev], "epochs": [r.epochs for r in runs],
           "fits": [r.fit for r in runs]}
    if runs[0].test is not None:
        test = np.array([main(r.test) for r in runs])
        out.update(test_mean=float(test.mean()), test_std=float(test.std(ddof=1)) if len(runs) > 1 else 0.0)
    if runs[0].weights is not None:
        out["weights"] = [round(float(w), 4) for w in np.mean([r.weights for r in runs], axis=0)]
    return out
