"""What reduced precision costs downstream: SST-2 heads and a UD POS probe on float32, bfloat16 and int8 features.

Run: ``./dev bench precision [--variants float32,bfloat16,int8] [--sst2-train 20000] [--pos-train 4000]
[--recipes b,c] [--epochs 10] [--pos-epochs 8] [--pos-dev 0] [--pos-strategies] [--device cpu] [--fidelity-only]``.

Each variant is one :class:`layerwise.Extractor` of the embedded default model (all-MiniLM-L6-v2, 6 layers, hidden
384); only the features differ between variants, everything downstream is the same code with the same seed:

  float32        ``lw.Extractor()``: backend ``auto`` (the faster exact runtime), float32
  float32-torch  ``lw.Extractor(backend="torch")``: plain PyTorch float32 (not run by default)
  bfloat16       ``lw.Extractor(compute_dtype="bfloat16")``: PyTorch bf16; skipped, with the reason printed, on a CPU
                 without AVX-512 BF16 / AMX (``layerwise.model.hardware.native_on_cpu``), where it runs emulated and
                 very slowly
  bfloat16       (under ``auto`` it races PyTorch bf16 and OpenVINO's bf16 hint where the ``[openvino]`` extra is
                 installed)
  int8           ``lw.Extractor(quantize="int8")``: int8 weights on OpenVINO (``int8-weights``) where the extra is
                 installed, else ONNX Runtime's dynamic int8
  int8-onnx      ``lw.Extractor(backend="onnx", quantize="int8")``: ONNX Runtime's dynamic int8 (``int8``)
  int8-full      ``lw.Extractor(quantize="int8-full")``: int8 weights and activations on OpenVINO, calibrated on the
                 bundled sample (``int8-full``)

Per variant, first its fidelity to PyTorch float32 by layer and by sentence length: every layer mean-pooled over
SST-2 dev sentences and, for the longest bucket, runs of consecutive dev sentences joined to 65-200 tokens; the
minimum cosine in each length bucket (1-4, 5-16, 17-64, 65+ tokens with the special tokens). Short texts are where
int8's per-group activation ranges hurt most (the worst sentence of the ONNX Runtime recipe is "thank ", 3 tokens).
``--fidelity-only`` stops there. Then:

1. SST-2 heads (``lw.heads.train``, frozen mode, recipes of ``benchmarks/sst2_heads.py``): (b) last layer, mean
   pooling, linear; (c) last four layers concatenated, max-pooled, MLP 256 + dropout 0.2. Trained on the first
   ``--sst2-train`` sentences of SST-2 train (0 = all 67,349), seed 0, up to ``--epochs`` with patience 3, scored on
   the whole dev set (872 sentences).
2. UD English-EWT UPOS probe (``lw.probe.run``): a linear probe on every single layer (0 = embeddings .. 6; with
   ``--pos-strategies`` also the BERT-paper layer mixes), words pooled from their first sub-token, trained on the
   first ``--pos-train`` sentences of ``en_ewt-ud-train.conllu`` (0 = all 12,544), scored on the dev file (2,001
   sentences; ``--pos-dev N`` keeps the first N, for quick runs only).

Every variant gets its own feature cache and probe folder in a temporary directory, so nothing is reused across
precisions (the head cache is keyed by the weights, which int8 shares with float32) and "features s" is the
variant's own extraction time (heads b and c extract separately: mean and max pooling; the probe extracts train and
dev once at word level). "setup s" is the extractor's first call (ONNX export / quantisation, exactness check).
Pitfalls: the probe stores its features as float16 for every variant (``layerwise.probe`` does so), which rounds
away part of a float32-vs-bfloat16 difference; the head cache keeps float32. Recipe (c) (an MLP on max-pooled
features) is unstable on small training sets (a few hundred sentences, few epochs: near-chance and seed-dependent),
so quick runs say little about it; ``--recipes b`` also halves the SST-2 extraction.

"Within 0.5 points" (project issue #16): a variant passes when, for each score judged (the dev accuracy of every
head recipe run and the POS probe's best single-layer dev accuracy), ``|variant - float32| <= 0.5`` percentage points,
float32 being the first variant (``float32`` unless ``--variants`` says otherwise). The per-layer POS differences are
reported too (largest ``|delta|``) but not judged. Scale: one SST-2 dev sentence is 0.115 points, so 0.5 points is
about 4 of 872 sentences; the UD dev set has ~25,000 words (0.5 points ~ 125 words).

Needs ``../shared/data`` (``sst2/``, ``ud_english_ewt/``) or ``$LAYERWISE_SHARED_DATA``. Prints a Markdown table,
the CPU flags that decide reduced precision (``avx512_bf16``, ``amx_bf16``, ``avx512_vnni``), the thread count and a
plain verdict; writes ``benchmarks/results/precision.json`` (rewritten after every variant).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, cast

import torch

import layerwise as lw
from benchmarks.extract_memory import shared_data
from benchmarks.sst2_heads import CONFIGS
from layerwise.heads import HeadConfig
from layerwise.model.hardware import PrecisionWarning, cpu_flags, native_on_cpu

REPO = Path(__file__).resolve().parents[1]
TOLERANCE = 0.5  # percentage points (issue #16)
FLAGS = ("avx512_bf16", "amx_bf16", "avx512_vnni")
VARIANTS = {  # name -> (how it is built, Extractor keyword arguments)
    "float32": ("lw.Extractor()", {}),
    "float32-torch": ("lw.Extractor(backend='torch')", {"backend": "torch"}),
    "bfloat16": ("lw.Extractor(compute_dtype='bfloat16')", {"compute_dtype": "bfloat16"}),
    "int8": ("lw.Extractor(quantize='int8')", {"quantize": "int8"}),
    "int8-onnx": ("lw.Extractor(backend='onnx', quantize='int8')", {"backend": "onnx", "quantize": "int8"}),
    "int8-full": ("lw.Extractor(quantize='int8-full')", {"quantize": "int8-full"}),
}
BUCKETS = ((1, 4), (5, 16), (17, 64), (65, 10_000))  # tokens per text, special tokens included
RECIPES = ("b", "c")


def first_lines(src: Path, dst: Path, n: int) -> int:
    """Header plus the first ``n`` data lines of a TSV (``n = 0``: all); returns the data lines written."""
    lines = src.read_text(encoding="utf-8").splitlines()
    body = [ln for ln in lines[1:] if ln.strip()]
    body = body[:n] if n else body
    dst.write_text("\n".join([lines[0], *body]) + "\n", encoding="utf-8")
    return len(body)


def first_sentences(src: Path, dst: Path, n: int) -> int:
    """The first ``n`` sentences (blank-line separated blocks, comments kept) of a CoNLL-U file (``n = 0``: all)."""
    blocks = [b for b in src.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    blocks = blocks[:n] if n else blocks
    dst.write_text("\n\n".join(b.strip("\n") for b in blocks) + "\n\n", encoding="utf-8")
    return len(blocks)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def skip_reason(name: str, device: str) -> str | None:
    """Why a variant cannot run meaningfully here, or ``None``."""
    if name == "bfloat16" and device == "cpu" and not native_on_cpu(torch.bfloat16):
        return ("this CPU has neither avx512_bf16 nor amx_bf16: bf16 would run emulated, far slower than float32; "
                "run it on a CPU that has them")
    return None


def length_texts(dev: Path, tok) -> list[str]:
    """SST-2 dev sentences, plus runs of consecutive ones joined until 65-200 tokens (the 65+ bucket)."""
    sentences = [ln.split("\t")[0] for ln in dev.read_text(encoding="utf-8").splitlines()[1:] if ln.strip()]
    joined, run = [], []
    for s in sentences:
        run.append(s)
        n = len(tok(" ".join(run))["input_ids"])
        if n >= 65:
            if n <= 200:
                joined.append(" ".join(run))
            run = []
    return sentences + joined


def fidelity_by_length(ex: lw.Extractor, ref: lw.Extractor, texts: list[str]) -> dict[str, list[float]]:
    """``{"1-4": [min cosine of layer 0, 1, ..., L], ...}``: every layer mean-pooled, against ``ref``, per bucket."""
    import numpy as np

    lengths = np.array([len(ids) for ids in ref.tokenizer(texts)["input_ids"]])
    got = ex.encode(texts, layers="all", combine="stack", pool="mean")  # [n, L+1, D]
    want = ref.encode(texts, layers="all", combine="stack", pool="mean")
    cos = (got * want).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1) + 1e-12)
    out = {}
    for lo, hi in BUCKETS:
        rows = (lengths >= lo) & (lengths <= hi)
        if rows.any():
            key = f"{lo}-{hi}" if hi < 10_000 else f"{lo}+"
            out[key] = [round(float(c), 6) for c in cos[rows].min(0)]
            out[key + " n"] = [int(rows.sum())]
    return out


def run_variant(name: str, args, data: dict[str, Path], tmp: Path) -> dict:
    """Build the variant's extractor, train the heads and the probe on its features; one result row."""
    built, kw = VARIANTS[name]
    row: dict = {"variant": name, "extractor": built}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PrecisionWarning)  # skip_reason has already decided
        ex = lw.Extractor(device=args.device, **kw)
        ex.encode(["A warm-up sentence for the first call."], layers="all", combine="stack", pool="mean")
    row["setup_seconds"] = round(time.perf_counter() - t0, 1)
    reference = lw.Extractor(device=args.device, backend="torch")
    row["fidelity_by_length"] = fidelity_by_length(ex, reference, length_texts(data["sst2_dev"], ex.tokenizer))
    row["precision"] = ex.describe()["precision"]
    say(f"[{name}] fidelity by length (min cosine, layers 0..L): {row['fidelity_by_length']}")
    if args.fidelity_only:
        return row
    work = tmp / name
    heads: dict[str, dict] = {}
    for key in args.recipes:
        title, cfg_kw = CONFIGS[key]
        cfg = HeadConfig(**cast("dict[str, Any]", cfg_kw))
        opts = lw.heads.TrainOptions(epochs=args.epochs, seed=args.seed, patience=3, cache_dir=work / "cache",
                                     progress=False)
        t = time.perf_counter()
        res = lw.heads.train(cfg, data["sst2_train"], data["sst2_dev"], text_field="sentence",
                             options=opts, model=ex, output=work / f"head-{key}",
                             log=lambda s, k=key: say(f"[{name} {k}] {s}"))
        wall = time.perf_counter() - t
        heads[key] = {"title": title, "dev_accuracy": res.dev["accuracy"], "dev_macro_f1": res.dev["macro_f1"],
                      "best_epoch": res.best_epoch, "epochs_run": len(res.log),
                      "feature_seconds": round(res.feature_seconds, 1),
                      "train_seconds": round(wall - res.feature_seconds, 1)}
        say(f"[{name} {key}] dev accuracy {res.dev['accuracy']:.4f} ({wall:.0f}s, features {res.feature_seconds:.0f}s)")
    row["heads"] = heads
    config = lw.probe.ProbeConfig(task="tagging", column="upos", epochs=args.pos_epochs,
                                  layers_only=not args.pos_strategies)
    t = time.perf_counter()
    pr = lw.probe.run(data["pos_train"], data["pos_dev"], config=config, model=ex, output=work / "probe",
                      progress=False, log=lambda s: say(f"[{name} pos] {s}"))
    layers = {r["layers"][0]: r["dev_accuracy"] for r in pr.rows if r["kind"] == "layer"}
    best_layer = max(layers, key=lambda i: layers[i])
    row["pos"] = {"per_layer": {str(i): round(a, 5) for i, a in sorted(layers.items())},
                  "best_layer": best_layer, "best_layer_accuracy": layers[best_layer],
                  "strategies": {r["name"]: round(r["dev_accuracy"], 5) for r in pr.rows if r["kind"] != "layer"},
                  "extract_seconds": pr.extract_seconds, "seconds": round(time.perf_counter() - t, 1)}
    row["feature_seconds"] = round(sum(h["feature_seconds"] for h in heads.values()) + pr.extract_seconds, 1)
    row["seconds"] = round(time.perf_counter() - t0, 1)
    desc = ex.describe()
    row["describe"] = {k: desc.get(k) for k in ("backend", "compute_dtype", "precision", "runtime", "device")}
    return row


def compare(rows: list[dict]) -> None:
    """Add ``delta`` (percentage points against the first variant that ran) and ``within`` to every row."""
    ran = [r for r in rows if "skipped" not in r and "heads" in r]
    if not ran:
        return
    ref = ran[0]
    for r in ran:
        d = {f"head_{k}": 100 * (h["dev_accuracy"] - ref["heads"][k]["dev_accuracy"]) for k, h in r["heads"].items()}
        d["pos_best_layer"] = 100 * (r["pos"]["best_layer_accuracy"] - ref["pos"]["best_layer_accuracy"])
        per = [100 * abs(a - ref["pos"]["per_layer"][i]) for i, a in r["pos"]["per_layer"].items()]
        r["delta_points"] = {k: round(v, 3) for k, v in d.items()}
        r["pos_max_layer_delta_points"] = round(max(per), 3)
        r["reference"] = ref["variant"]
        r["within_tolerance"] = all(abs(v) <= TOLERANCE for v in d.values())


def pct(x: float) -> str:
    return f"{100 * x:.2f}"


def signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2f}"


def markdown(rows: list[dict], recipes: str) -> list[str]:
    heads = " | ".join(f"SST-2 head {k} dev acc" for k in recipes)
    out = [f"| variant | {heads} | delta vs float32 (points) | POS probe best layer acc | per-layer accs (0..6) | "
           f"delta (points; max per-layer) | features s | setup s |",
           "|---|" + "---|" * (len(recipes) + 6)]
    for r in rows:
        if "skipped" in r:
            out.append(f"| {r['variant']} | " + " | ".join(["skipped"] + ["-"] * (len(recipes) + 5)) + " |")
            continue
        d = r.get("delta_points", {})
        accs = " | ".join(pct(r["heads"][k]["dev_accuracy"]) for k in recipes)
        head_d = " / ".join(f"{k} {signed(d.get(f'head_{k}'))}" for k in recipes)
        per = " ".join(pct(a) for a in r["pos"]["per_layer"].values())
        out.append(f"| {r['variant']} | {accs} | {head_d} | {pct(r['pos']['best_layer_accuracy'])} (layer "
                   f"{r['pos']['best_layer']}) | {per} | {signed(d.get('pos_best_layer'))}; "
                   f"{r.get('pos_max_layer_delta_points', 0):.2f} | {r['feature_seconds']:.0f} | "
                   f"{r['setup_seconds']:.0f} |")
    return out


def fidelity_table(rows: list[dict]) -> list[str]:
    """Markdown: per variant and length bucket, the minimum cosine to float32 at every layer (0..L)."""
    out = ["| variant (precision) | tokens | texts | min cosine per layer (0 .. L) | worst |", "|---|---|---|---|---|"]
    for r in rows:
        for bucket, mins in r.get("fidelity_by_length", {}).items():
            if bucket.endswith(" n"):
                continue
            n = r["fidelity_by_length"][bucket + " n"][0]
            out.append(f"| {r['variant']} ({r.get('precision', '?')}) | {bucket} | {n} | "
                       f"{' '.join(f'{c:.4f}' for c in mins)} | {min(mins):.4f} |")
    return out


def verdicts(rows: list[dict]) -> list[str]:
    lines = []
    for r in rows:
        if "skipped" in r:
            lines.append(f"- {r['variant']}: not run ({r['skipped']}).")
        elif "heads" in r and r["variant"] != r.get("reference"):
            worst = max(r["delta_points"].items(), key=lambda kv: abs(kv[1]))
            verdict = "WITHIN" if r["within_tolerance"] else "NOT within"
            lines.append(f"- {r['variant']}: {verdict} {TOLERANCE} points of {r['reference']} (largest judged delta: "
                         f"{worst[0]} {worst[1]:+.2f} points; " + ", ".join(
                             f"{k} {v:+.2f}" for k, v in r["delta_points"].items()) + ").")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="float32,bfloat16,int8", help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--sst2-train", type=int, default=20000, help="first N SST-2 train sentences (0 = all)")
    ap.add_argument("--pos-train", type=int, default=4000, help="first N UD EWT train sentences (0 = all)")
    ap.add_argument("--pos-dev", type=int, default=0, help="first N UD EWT dev sentences (0 = all; quick runs only)")
    ap.add_argument("--recipes", default=",".join(RECIPES), help="SST-2 head recipes of sst2_heads.py (b, c)")
    ap.add_argument("--epochs", type=int, default=10, help="head epochs (patience 3)")
    ap.add_argument("--pos-epochs", type=int, default=8, help="probe epochs (patience 2)")
    ap.add_argument("--pos-strategies", action="store_true", help="also probe the BERT-paper layer mixes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--fidelity-only", action="store_true", help="only the per-layer, per-length fidelity")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "precision.json"))
    args = ap.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        ap.error(f"unknown variant(s) {bad or names}. Valid variants are: {', '.join(VARIANTS)}")
    args.recipes = [k.strip() for k in args.recipes.replace(",", " ").split()]
    if not args.recipes or any(k not in RECIPES for k in args.recipes):
        ap.error(f"--recipes takes {', '.join(RECIPES)} (got {args.recipes})")
    root = shared_data()
    sources = {"sst2_train": root / "sst2" / "train.tsv", "sst2_dev": root / "sst2" / "dev.tsv",
               "pos_train": root / "ud_english_ewt" / "en_ewt-ud-train.conllu",
               "pos_dev": root / "ud_english_ewt" / "en_ewt-ud-dev.conllu"}
    missing = [str(p) for p in sources.values() if not p.is_file()]
    if missing:
        sys.exit(f"shared data not found: {', '.join(missing)}; set LAYERWISE_SHARED_DATA to the folder holding "
                 f"sst2/ and ud_english_ewt/ (default: ../shared/data beside the repository)")
    flags = {f: f in cpu_flags() for f in FLAGS}
    meta = {"model": "all-MiniLM-L6-v2 (embedded)", "device": args.device, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "cpu_flags": flags, "tolerance_points": TOLERANCE, "seed": args.seed,
            "recipes": args.recipes, "head_epochs": args.epochs, "pos_epochs": args.pos_epochs,
            "date": time.strftime("%Y-%m-%d")}
    rows: list[dict] = []
    out = Path(args.out)
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lw-precision-") as d:
        tmp = Path(d)
        data = {"sst2_train": tmp / "sst2-train.tsv", "sst2_dev": sources["sst2_dev"],
                "pos_train": tmp / "en_ewt-ud-train.conllu", "pos_dev": tmp / "en_ewt-ud-dev.conllu"}
        meta["sst2_train"] = first_lines(sources["sst2_train"], data["sst2_train"], args.sst2_train)
        dev_lines = sources["sst2_dev"].read_text(encoding="utf-8").splitlines()[1:]
        meta["sst2_dev"] = sum(1 for ln in dev_lines if ln.strip())
        meta["pos_train"] = first_sentences(sources["pos_train"], data["pos_train"], args.pos_train)
        meta["pos_dev"] = first_sentences(sources["pos_dev"], data["pos_dev"], args.pos_dev)
        for name in names:
            reason = skip_reason(name, args.device)
            if reason:
                say(f"[{name}] skipped: {reason}")
                rows.append({"variant": name, "extractor": VARIANTS[name][0], "skipped": reason})
            else:
                say(f"[{name}] {VARIANTS[name][0]}")
                rows.append(run_variant(name, args, data, tmp))
            compare(rows)
            meta["seconds"] = round(time.perf_counter() - t_all, 1)
            out.parent.mkdir(parents=True, exist_ok=True)  # after every variant: an interrupted run keeps what it did
            out.write_text(json.dumps({**meta, "rows": rows}, indent=2) + "\n")
    print(f"Embedded all-MiniLM-L6-v2, device {args.device}; SST-2: train on the first {meta['sst2_train']:,} "
          f"sentences, dev {meta['sst2_dev']:,}; UD EWT UPOS: train on the first {meta['pos_train']:,} sentences, dev "
          f"{meta['pos_dev']:,}; seed {args.seed}; head epochs <= {args.epochs}, probe epochs <= {args.pos_epochs}; "
          f"{meta['torch_threads']} torch threads ({meta['cpu_count']} CPUs); CPU flags: "
          + ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in flags.items()) + f"; total {meta['seconds']:.0f}s.\n")
    print("Fidelity to PyTorch float32 by sentence length (SST-2 dev; 65+: consecutive dev sentences joined):\n")
    print("\n".join(fidelity_table(rows)) + "\n")
    if args.fidelity_only:
        print(f"Written: {out}")
        return
    print("\n".join(markdown(rows, args.recipes)))
    ref = next((r["reference"] for r in rows if "reference" in r), "-")
    print(f"\nAccuracies in percent; deltas in percentage points against {ref}; judged: every head "
          f"recipe and the POS best single layer, |delta| <= {TOLERANCE}.\n")
    print("\n".join(verdicts(rows)))
    print(f"\nWritten: {out}")


if __name__ == "__main__":
    main()
