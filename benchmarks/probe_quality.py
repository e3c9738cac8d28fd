"""Do the probes measure the layer? layerwise's linear probe against scikit-learn's ``LogisticRegressionCV`` on the
same features, per layer, on real sets (issue 38).

Run: ``./dev bench probe_quality [--baseline-src DIR]``.

Sets (from ``../shared/data``, or ``$LAYERWISE_SHARED_DATA``; skipped with a reason when absent): SST-2 sentiment,
the first 1,000 training sentences, scored on dev (872); UD English-EWT UPOS, the first 600 training sentences,
scored on dev (2,001 sentences). The model is the embedded default (all-MiniLM-L6-v2, 7 states).

For each set: ``layerwise probe`` (every layer and the strategies, the default linear probe) is timed as a whole;
then, on the very features it extracted (its cached stores), scikit-learn's ``make_pipeline(StandardScaler(),
LogisticRegressionCV(Cs=10, max_iter=1000))`` (5-fold stratified, lbfgs) is fitted per layer on train and scored on
dev. Target: every layer within 0.5 points. ``--baseline-src DIR``: a source tree of an earlier layerwise (e.g. a
``git worktree`` of the commit before issue 38) whose probe run is timed on the same sets in a child process, and
its per-layer scores kept beside. Writes ``benchmarks/results/probe_quality.json`` with the machine and date.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from benchmarks.extract_memory import REPO, shared_data

RESULTS = REPO / "benchmarks" / "results" / "probe_quality.json"


def sets(work: Path) -> dict[str, dict[str, Any]]:
    """The two sets as files in ``work``: ``{name: {task, column, train, dev}}``."""
    data = shared_data()
    sst = (data / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()
    (work / "sst2-train-1k.tsv").write_text("\n".join(sst[:1001]) + "\n", encoding="utf-8")
    ud = (data / "ud_english_ewt" / "en_ewt-ud-train.conllu").read_text(encoding="utf-8").split("\n\n")
    (work / "ud-train-600.conllu").write_text("\n\n".join(ud[:600]) + "\n\n", encoding="utf-8")
    return {
        "SST-2 (1k train, dev)": {"task": "sentence", "column": "label", "train": work / "sst2-train-1k.tsv",
                                  "dev": data / "sst2" / "dev.tsv"},
        "UD UPOS (600 train sentences, dev)": {"task": "tagging", "column": "upos",
                                               "train": work / "ud-train-600.conllu",
                                               "dev": data / "ud_english_ewt" / "en_ewt-ud-dev.conllu"},
    }


PROBE = """
import json, sys, time
import layerwise as lw
a = json.loads(sys.argv[1])
t0 = time.perf_counter()
cfg = lw.probe.ProbeConfig(task=a["task"], column=a["column"])
res = lw.probe.run(a["train"], a["dev"], config=cfg, output=a["out"], log=lambda line: None, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t0, "extract_seconds": res.extract_seconds,
                  "rows": {r["name"]: r["dev_mean"] for r in res.rows},
                  "fits": {r["name"]: r.get("fits") for r in res.rows if r["kind"] == "layer"},
                  "ci": {r["name"]: r.get("dev_ci") for r in res.rows}}))
"""


def probe_run(case: dict[str, Any], out: Path, src: Path | None = None) -> dict[str, Any]:
    """``layerwise probe`` on ``case`` in a child process (``src``: an earlier source tree to import instead)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LAYERWISE_QUIET": "1"}
    if src is not None:
        env["PYTHONPATH"] = str(src)
    args = {k: str(v) for k, v in case.items()} | {"out": str(out)}
    done = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], env=env, capture_output=True, text=True,
                          check=False, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def sklearn_per_layer(case: dict[str, Any], out: Path) -> dict[str, float]:
    """Per layer: scikit-learn's StandardScaler + LogisticRegressionCV on the probe run's cached features."""
    import numpy as np
    from sklearn.linear_model import LogisticRegressionCV
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from layerwise.store import open_store

    def load(split: str) -> tuple[np.ndarray, list[str]]:
        store = open_store(out / "features" / split)
        values = store.column(case["column"])
        if case["task"] == "tagging":
            rows, _ = store.ragged()
            return np.asarray(rows, dtype=np.float32), [str(t) for tags in values for t in tags]
        return np.concatenate(list(store.iter_chunks(8192))).astype(np.float32), [str(v).strip() for v in values]

    (xt, yt), (xd, yd) = load("train"), load("dev")
    scores = {}
    for layer in range(xt.shape[1]):
        model = make_pipeline(StandardScaler(), LogisticRegressionCV(Cs=10, max_iter=1000, scoring="accuracy",
                                                                 n_jobs=-1))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(xt[:, layer], yt)
        scores["embeddings" if layer == 0 else f"layer {layer}"] = float((model.predict(xd[:, layer]) ==
                                                                          np.asarray(yd)).mean())
    return scores


HEAD = """
import json, sys, time
import numpy as np
import layerwise as lw
from layerwise.heads.data import read_labelled
from layerwise.probe.linear import fit_linear
from layerwise.probe.uncertainty import interval, item_counts, resample_weights, resampled
a = json.loads(sys.argv[1])
ex = lw.Extractor()
t0 = time.perf_counter()
cfg = lw.heads.HeadConfig(layers="-4:", pool="max", combine="concat", classifier="mlp", dropout=0.2)
res = lw.heads.train(cfg, a["train"], a["dev"], text_field="sentence", model=ex,
                     options=lw.heads.TrainOptions(seed=0, progress=False, cache_dir=a["cache"]), log=lambda line: None)
head_seconds = time.perf_counter() - t0
tr, dv = read_labelled(a["train"], text_field="sentence"), read_labelled(a["dev"], text_field="sentence")
feats = [ex.encode(d.texts, layers=[-4, -3, -2, -1], pool="max", combine="concat") for d in (tr, dv)]
names = sorted(set(tr.labels))
fit = fit_linear(feats[0][:, None, :], np.array([names.index(v) for v in tr.labels]), len(names))
pred = [names[i] for i in fit.predict(feats[1][:, None, :])]
head_pred = res.classifier.predict(dv.texts)
w = resample_weights(len(dv.labels))
out = {}
for name, p in (("mlp_head", head_pred), ("linear", pred)):
    counts = item_counts(list(dv.labels), [str(v) for v in p], "accuracy")
    out[name] = {"accuracy": float(counts[:, 0].sum() / counts[:, 1].sum()), "ci": interval(resampled(counts, w))}
out["mlp_head"].update(best_epoch=res.best_epoch, epochs=len(res.log), chosen_on=res.chosen_on, seconds=head_seconds)
out["linear"].update(fit.report())
print(json.dumps(out))
"""


def head_check(case: dict[str, Any], work: Path) -> dict[str, Any]:
    """The seeds' recipe (last four layers max-pooled, concatenated, an MLP head with dropout) against the converged
    linear probe on the same features (SST-2), with bootstrap intervals."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LAYERWISE_QUIET": "1"}
    args = {"train": str(case["train"]), "dev": str(case["dev"]), "cache": str(work / "head-cache")}
    done = subprocess.run([sys.executable, "-c", HEAD, json.dumps(args)], env=env, capture_output=True, text=True,
                          check=False, cwd=REPO)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="./dev bench probe_quality", description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-src", type=Path, default=None,
                    help="an earlier layerwise's src directory, whose probe run is timed on the same sets")
    ap.add_argument("--only", default="", help="comma-separated: probes, head (default: both)")
    args = ap.parse_args(argv)
    only = {c.strip() for c in args.only.split(",") if c.strip()} or {"probes", "head"}
    if not (shared_data() / "sst2").is_dir() or not (shared_data() / "ud_english_ewt").is_dir():
        print(f"probe_quality: skipped: SST-2 or UD English-EWT not found under {shared_data()} (set "
              f"LAYERWISE_SHARED_DATA)", file=sys.stderr)
        return
    from layerwise.model.hardware import cpu_model

    out: dict[str, Any] = {"machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                                       "python": platform.python_version(), "date": time.strftime("%Y-%m-%d")},
                           "sets": {}}
    with tempfile.TemporaryDirectory(prefix="layerwise-probe-quality-") as tmp:
        work = Path(tmp)
        cases = sets(work)
        if "head" in only:
            out["head_check"] = head_check(cases["SST-2 (1k train, dev)"], work)
            print(f"probe_quality: head check: {json.dumps(out['head_check'])}", file=sys.stderr)
        for name, case in cases.items():
            if "probes" not in only:
                break
            run_dir = work / name.split()[0].replace("-", "")
            new = probe_run(case, run_dir)
            reference = sklearn_per_layer(case, run_dir)
            entry: dict[str, Any] = {"layerwise": new, "sklearn_lrcv": reference,
                                     "max_gap_points": max(abs(100 * (new["rows"][k] - v)) for k, v in
                                                           reference.items())}
            if args.baseline_src is not None:
                entry["baseline"] = probe_run(case, work / f"{run_dir.name}-baseline", args.baseline_src)
            out["sets"][name] = entry
            print(f"probe_quality: {name}: {json.dumps(entry)[:400]}", file=sys.stderr)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():  # a partial run (--only) keeps the other parts of the last one
        out = {**json.loads(RESULTS.read_text(encoding="utf-8")), **{k: v for k, v in out.items() if v}}
    RESULTS.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")
    head = out.get("head_check")
    if head:
        m, lin = head["mlp_head"], head["linear"]
        print(f"\nSST-2 (1k train, dev), last 4 layers max-pooled and concatenated: MLP head (dropout 0.2) "
              f"{100 * m['accuracy']:.1f} [{100 * m['ci'][0]:.1f}, {100 * m['ci'][1]:.1f}] against the converged "
              f"linear probe {100 * lin['accuracy']:.1f} [{100 * lin['ci'][0]:.1f}, {100 * lin['ci'][1]:.1f}] "
              f"(C {lin['C']:.3g})")
    for name, e in out["sets"].items():
        print(f"\n{name}\n\n| layer | layerwise linear probe [95% CI] | sklearn LogisticRegressionCV | gap |"
              + (" earlier probe |" if "baseline" in e else "") + "\n|---|---|---|---|" + ("---|" if "baseline" in e
                                                                                          else ""))
        for layer, ref in e["sklearn_lrcv"].items():
            ci = e["layerwise"]["ci"][layer]
            got = e["layerwise"]["rows"][layer]
            print(f"| {layer} | {100 * got:.1f} [{100 * ci[0]:.1f}, {100 * ci[1]:.1f}] | {100 * ref:.1f} | "
                  f"{100 * (got - ref):+.1f} |" + (f" {100 * e['baseline']['rows'][layer]:.1f} |"
                                                   if "baseline" in e else ""))
        print(f"\nfull probe run (every layer and strategy): {e['layerwise']['seconds']:.0f} s (extraction "
              f"{e['layerwise']['extract_seconds']:.0f} s)" + (f"; the earlier probe: {e['baseline']['seconds']:.0f} s"
                                                               if "baseline" in e else ""))


if __name__ == "__main__":
    main()
