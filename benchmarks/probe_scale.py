"""Probes at corpus scale: the whole layer study (seven layers and the BERT paper's strategies) on UD English-EWT's
full training set, timed, with its peak memory against the size of its cached features, and every learned mix
against the uniform mix of its layers.

Run: ``./dev bench probe_scale [--data ud|sst2] [--sentences N] [--column upos] [--mdl] [--output DIR]``.

Data: ``../shared/data/ud_english_ewt`` (or ``$LAYERWISE_SHARED_DATA``), train (12,544 sentences, 204k tokens; the
first ``N`` with ``--sentences``) scored on dev; the stand-in for CoNLL-2003 (14k sentences, 203k tokens). The model
is the embedded default (all-MiniLM-L6-v2, 7 states). ``layerwise probe`` runs in a child process (its peak RSS is the
child's own, read from ``getrusage``), once with its feature extraction and, when ``--twice``, again on the cached
features (the probes alone).

Reported: wall time, extraction, the strength scans' share, peak RSS over the cached features' bytes (train + dev,
float16 on disk; in memory they are the same size) and the extraction child's own peak (``layerwise.probe.isolated``),
and for each learned mix: its weights, whether any is within 1e-3 of one-hot, which mix its held-out folds kept, its
dev score against scikit-learn's ``LogisticRegression`` on the uniform mean of the same standardised layers (the C the
mix chose). ``--mdl``: single layers only, each with its online code length. Targets (issue "probes at corpus
scale"): <= 10 minutes on the 2-core machine, quiet; peak memory <= 1.5x the cached features; every learned mix at
least the uniform mix. Writes ``benchmarks/results/probe_scale[_sst2][_mdl].json`` with the machine and date.
``--data sst2``: SST-2 sentiment (``--sentences`` training sentences, scored on dev) instead of UD.
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
from pathlib import Path

from benchmarks.extract_memory import REPO, shared_data

RESULTS = REPO / "benchmarks" / "results" / "probe_scale.json"

CHILD = """
import json, resource, sys, time
import layerwise as lw
t = time.perf_counter()
train, dev, task, column, output, mode, text_field = sys.argv[1:8]
res = lw.probe.run(train, dev, config=lw.probe.ProbeConfig(task=task, column=column, mdl=mode == "mdl",
                   layers_only=mode == "mdl"), text_field=text_field if task == "sentence" else None,
                   output=output, overwrite=True, progress=False, log=lambda line: None)
print(json.dumps({"seconds": time.perf_counter() - t, "extract_seconds": res.extract_seconds,
                  "scan_seconds": res.scan_seconds,
                  "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "extraction_peak_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))
"""


def _bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*.safetensors"))


def _uniform_baseline(out: Path, data: dict, rows: list[dict]) -> dict[str, float]:
    """Dev accuracy of scikit-learn's LogisticRegression on the uniform mean of each mix's standardised layers, at
    the C the mix chose (the held-out comparison)."""
    from sklearn.linear_model import LogisticRegression

    from layerwise.probe.data import load_split
    from layerwise.probe.linear import _moments
    from layerwise.probe.train import _targets

    train = load_split(data["train"], out / "probe" / "features" / "train", task=data["task"], column=data["column"])
    dev = load_split(data["dev"], out / "probe" / "features" / "dev", task=data["task"], column=data["column"])
    labels = sorted(set(train.labels))
    index = {label: i for i, label in enumerate(labels)}
    y, dy = _targets(train, index).numpy(), _targets(dev, index).numpy()
    out_scores = {}
    for r in rows:
        if r["combine"] != "scalar_mix":
            continue
        layers = slice(r["layers"][0], r["layers"][-1] + 1)
        x = train.x[:, layers].float().numpy()
        mean, scale = _moments(x)
        u = ((x - mean) / scale).mean(1)
        del x
        um, us = _moments(u)
        model = LogisticRegression(C=r["fits"][0]["C"], max_iter=1000).fit((u - um) / us, y)
        d = ((dev.x[:, layers].float().numpy() - mean) / scale).mean(1)
        keep = dy >= 0
        out_scores[r["name"]] = float((model.predict(((d - um) / us)[keep]) == dy[keep]).mean())
    return out_scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=0, help="the first N training sentences (0: all)")
    parser.add_argument("--data", choices=("ud", "sst2"), default="ud",
                        help="ud: UD English-EWT tagging (the CoNLL-2003 stand-in); sst2: SST-2 sentiment")
    parser.add_argument("--column", default="upos", help="ud: the tag column (upos or xpos)")
    parser.add_argument("--output", default=None, help="where the probe writes (default: a temporary directory)")
    parser.add_argument("--twice", action="store_true", help="run again on the cached features (probes alone)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the scikit-learn uniform-mean comparison")
    parser.add_argument("--mdl", action="store_true", help="single layers only, with their online code length (MDL)")
    args = parser.parse_args()
    work = Path(args.output or tempfile.mkdtemp(prefix="probe-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    if args.data == "ud":
        ud = shared_data() / "ud_english_ewt"
        sentences = (ud / "en_ewt-ud-train.conllu").read_text(encoding="utf-8").strip().split("\n\n")
        if args.sentences:
            sentences = sentences[: args.sentences]
        train = work / "train.conllu"
        train.write_text("\n\n".join(sentences) + "\n\n", encoding="utf-8")
        tokens = sum(1 for s in sentences for line in s.splitlines() if line and line[0].isdigit() and "\t" in line
                     and "-" not in line.split("\t")[0] and "." not in line.split("\t")[0])
        data = {"train": train, "dev": ud / "en_ewt-ud-dev.conllu", "task": "tagging", "column": args.column,
                "text_field": "-", "title": f"UD English-EWT {args.column}, {len(sentences):,} training sentences "
                                            f"({tokens:,} tokens)"}
    else:
        lines = (shared_data() / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()
        sentences = lines[1:][: args.sentences or None]
        train = work / "train.tsv"
        train.write_text("\n".join([lines[0], *sentences]) + "\n", encoding="utf-8")
        data = {"train": train, "dev": shared_data() / "sst2" / "dev.tsv", "task": "sentence", "column": "label",
                "text_field": "sentence", "title": f"SST-2, the first {len(sentences):,} training sentences"}
    runs = []
    for _ in range(2 if args.twice else 1):
        child = subprocess.run([sys.executable, "-c", CHILD, str(data["train"]), str(data["dev"]), data["task"],
                                data["column"], str(work / "probe"), "mdl" if args.mdl else "-", data["text_field"]],
                               capture_output=True, text=True, check=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
    results = json.loads((work / "probe" / "results.json").read_text(encoding="utf-8"))
    features = _bytes(work / "probe" / "features")
    baseline = {} if args.no_baseline else _uniform_baseline(work, data, results["rows"])
    print(f"probe_scale: {data['title']}, scored on dev; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d')}")
    for k, run in enumerate(runs):
        print(f"run {k + 1}{' (cached features)' if k else ''}: {run['seconds']:.0f} s (extraction "
              f"{run['extract_seconds']:.0f} s, strength scans {run['scan_seconds']:.0f} s); peak RSS "
              f"{run['peak_rss'] / 1e9:.2f} GB = {run['peak_rss'] / features:.2f}x the cached features "
              f"({features / 1e9:.2f} GB); the extraction's child process {run['extraction_peak_rss'] / 1e9:.2f} GB")
    print("\n| probe | dev | C | iterations | scan rows | weights | mix kept (held-out folds) | uniform mean "
          "(scikit-learn) | MDL kbits (compression) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results["rows"]:
        fit = r["fits"][0]
        weights = r.get("weights")
        flag = " (one-hot)" if weights and max(weights) >= 1 - 1e-3 else ""
        base = baseline.get(r["name"])
        kept = fit.get("mix_validation") or {}
        held = f"{kept['kept']} ({kept['learned']:.4f} vs {kept['uniform']:.4f})" if kept else "-"
        code = r.get("mdl")
        mdl = f"{code['kbits']:,.1f} ({code['compression']:.2f}x)" if code else "-"
        print(f"| {r['name']} | {100 * r['dev_mean']:.2f} | {fit['C']:.3g} | {fit['iterations']} | "
              f"{fit.get('scan_rows', '-')} | {weights or '-'}{flag} | "
              f"{held} | {'-' if base is None else f'{100 * base:.2f}'} | {mdl} |")
    results_file = RESULTS.with_name(f"probe_scale{'_sst2' if args.data == 'sst2' else ''}"
                                     f"{'_mdl' if args.mdl else ''}.json")
    results_file.parent.mkdir(parents=True, exist_ok=True)
    results_file.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "machine": platform.processor(), "cores": os.cpu_count(),
        "data": data["title"], "sentences": len(sentences), "runs": runs, "features_bytes": features,
        "uniform_baseline": baseline,
        "rows": [{k: r[k] for k in ("name", "dev_mean", "weights", "fits", "mdl") if k in r} for r in results["rows"]],
    }, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
