"""Classifier heads on SST-2: the classic recipes, trained on the full train set, scored on dev.

Run: ``./dev bench sst2_heads [--only a,b] [--epochs 10] [--finetune-epochs 1] [--finetune-train N]``.

Needs ``../shared/data/sst2`` (or ``$LAYERWISE_SHARED_DATA/sst2``). Uses the embedded default model
(all-MiniLM-L6-v2, 6 layers, hidden 384). Frozen configurations share a feature cache (one extraction per pooling,
all layers stored, so every layer choice reuses it); the time column is the head's own training time, and the
extraction time of each cache is reported once. Prints a Markdown table and writes
``benchmarks/results/sst2_heads.json``.

Configurations:
  a  last layer, CLS, linear
  b  last layer, mean, linear
  c  last four layers concatenated, max-pooled, MLP (256, ReLU, dropout 0.2)
  d  layers [0, 2, 4, 6] mean-pooled and concatenated, linear
  e  one linear classifier per layer (all 7), learned softmax weights over their logits
  f  last layer, attention pooling over tokens (learned query), linear
  g  fine-tuned encoder: last layer, mean, linear (encoder lr 2e-5)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import layerwise as lw
from layerwise.heads import HeadConfig

REPO = Path(__file__).resolve().parents[1]

CONFIGS = {
    "a": ("last layer, CLS, linear", dict(layers=-1, pool="cls", classifier="linear")),
    "b": ("last layer, mean, linear", dict(layers=-1, pool="mean", classifier="linear")),
    "c": ("last 4 concat, max-pool, MLP 256 + dropout 0.2", dict(layers="-4:", pool="max", combine="concat",
                                                                 classifier="mlp", hidden=[256], dropout=0.2)),
    "d": ("layers [0,2,4,6] mean-pooled, concat, linear", dict(layers=[0, 2, 4, 6], pool="mean", combine="concat")),
    "e": ("per-layer classifiers (all 7), learned weights", dict(layers="all", pool="mean", classifier="per_layer")),
    "f": ("last layer, attention pooling, linear", dict(layers=-1, pool="attention")),
    "g": ("fine-tuned, last layer mean, linear", dict(layers=-1, pool="mean", mode="finetune")),
}


def shared_sst2() -> Path:
    return Path(os.environ.get("LAYERWISE_SHARED_DATA", REPO.parent / "shared" / "data")) / "sst2"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="abcdefg")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--finetune-epochs", type=int, default=1)
    ap.add_argument("--finetune-train", type=int, default=0, help="fine-tune on the first N train sentences (0 = all)")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "sst2_heads.json"))
    args = ap.parse_args(argv)
    data = shared_sst2()
    if not (data / "train.tsv").is_file():
        sys.exit(f"SST-2 not found at {data}; set LAYERWISE_SHARED_DATA to the folder holding sst2/")
    ex = lw.Extractor(device="cpu")
    rows, extraction = [], {}
    done_pools: set = set()
    train_file = data / "train.tsv"
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.only.replace(",", ""):
            title, kw = CONFIGS[key]
            cfg = HeadConfig(**kw)
            epochs = args.finetune_epochs if cfg.mode == "finetune" else args.epochs
            tr = train_file
            if cfg.mode == "finetune" and args.finetune_train:
                lines = train_file.read_text(encoding="utf-8").splitlines()
                tr = Path(tmp) / "train-subset.tsv"
                tr.write_text("\n".join(lines[: args.finetune_train + 1]) + "\n", encoding="utf-8")
            enc = ex if cfg.mode == "frozen" else lw.Extractor(device="cpu")  # fine-tuning changes its encoder
            t0 = time.perf_counter()
            opts = lw.heads.TrainOptions(epochs=epochs, seed=0, patience=3, cache_dir=args.cache_dir)
            res = lw.heads.train(cfg, tr, data / "dev.tsv", text_field="sentence", options=opts, model=enc,
                                 output=Path(tmp) / key, log=lambda s, k=key: print(f"[{k}] {s}", file=sys.stderr))
            wall = time.perf_counter() - t0
            cache_key = ("tokens" if cfg.pool == "attention" else cfg.pool) if cfg.mode == "frozen" else None
            if cache_key and cache_key not in done_pools:
                extraction[cache_key] = round(res.feature_seconds, 1)
                done_pools.add(cache_key)
            rows.append({
                "key": key, "title": title, "config": cfg.to_dict(), "dev_accuracy": res.dev["accuracy"],
                "dev_macro_f1": res.dev["macro_f1"], "best_epoch": res.best_epoch, "epochs_run": len(res.log),
                "train_seconds": round(wall - res.feature_seconds, 1), "feature_seconds": round(res.feature_seconds, 1),
                "layers": res.layers,
            })
            rows[-1]["train_records"] = args.finetune_train if cfg.mode == "finetune" and args.finetune_train else 67349
            print(f"[{key}] dev accuracy {res.dev['accuracy']:.4f} in {wall:.0f}s", file=sys.stderr)
            out = Path(args.out)  # written after every configuration: an interrupted run keeps what it finished
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps({"model": "all-MiniLM-L6-v2 (embedded)", "threads": torch.get_num_threads(),
                                       "extraction_seconds": extraction, "rows": rows}, indent=2) + "\n")
    print("| | configuration | dev accuracy | macro-F1 | best epoch / run | training s | features s | train set |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['key']} | {r['title']} | {r['dev_accuracy']:.4f} | {r['dev_macro_f1']:.4f} | "
              f"{r['best_epoch']} / {r['epochs_run']} | {r['train_seconds']:.0f} | {r['feature_seconds']:.0f} | "
              f"{r['train_records']:,} |")
    for r in rows:
        if r["layers"]:
            print(f"\n({r['key']}) learned layer weights: " + ", ".join(
                f"layer {e['layer']}: w={e['weight']:.3f}"
                + (f" (own dev acc {e['dev_accuracy']:.3f})" if "dev_accuracy" in e else "")
                for e in r["layers"]))


if __name__ == "__main__":
    main()
