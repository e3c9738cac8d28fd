"""An exported layer against the full model, both in sentence-transformers: what ``layerwise export-model`` buys.

Run: ``./dev bench export_model [--layers 3] [--texts 2000] [--repeats 5]``. Exports layer K (mean-pooled,
normalised, as all-MiniLM-L6-v2 itself is) of the embedded default model to a temporary directory, then times
``SentenceTransformer(full).encode`` and ``SentenceTransformer(export).encode`` on SST-2 train sentences
(``../shared/data``; generated sentences when absent), alternating the two inside one process, best of ``repeats``.
It also reports the export's own check (from ``layerwise-export.json``) and how far layer K's vectors are from the
full model's (they are a different representation: that is the point). Prints a Markdown table; writes
``benchmarks/results/export_model.json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import layerwise as lw
from benchmarks.extract_memory import corpus_texts

RESULTS = Path(__file__).resolve().parent / "results" / "export_model.json"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main(argv=None) -> None:
    from sentence_transformers import SentenceTransformer

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    texts, source = corpus_texts(args.texts)
    texts = texts[: args.texts]
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        result = lw.export_model(Path(tmp) / "export", layers=args.layers, pool="mean", normalize=True)
        export_s = time.perf_counter() - t0
        models = {"full": SentenceTransformer(lw.default_model_path(), device="cpu"),
                  "export": SentenceTransformer(str(result.directory), device="cpu")}
        for model in models.values():
            model.encode(texts[:200], batch_size=32)  # warm-up
        times: dict[str, list[float]] = {name: [] for name in models}
        vectors = {}
        for _ in range(args.repeats):
            for name, model in models.items():  # alternate within each repeat (the machine is shared and noisy)
                time.sleep(0.5)
                t0 = time.perf_counter()
                vectors[name] = model.encode(texts, batch_size=32)
                times[name].append(time.perf_counter() - t0)
    best = {name: min(ts) for name, ts in times.items()}
    cos = float(np.min((vectors["full"] * vectors["export"]).sum(1)))
    checks = result.report["checks"]
    row = {
        "machine": cpu_name(), "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"),
        "texts": len(texts), "source": source, "layers": args.layers,
        "full_s": round(best["full"], 3), "export_s": round(best["export"], 3),
        "speedup": round(best["full"] / best["export"], 2),
        "export_bytes": result.report["export"]["bytes"], "export_seconds": round(export_s, 1),
        "check_max_abs_diff": checks["transformers"]["max_abs_diff"],
        "check_min_cosine": checks["sentence_transformers"].get("min_cosine"),
        "min_cosine_to_full_model": round(cos, 4),
    }
    print(f"{row['machine']}, {row['threads']} threads, {row['date']}: {len(texts)} texts ({source}), "
          f"sentence-transformers encode, batch 32, best of {args.repeats} alternating runs\n")
    print("| model | s | x full |\n|---|---|---|")
    print(f"| all-MiniLM-L6-v2 (6 layers) | {row['full_s']:.2f} | 1.00 |")
    print(f"| layerwise export, layer {args.layers} of 6 | {row['export_s']:.2f} | {row['speedup']:.2f} |")
    print(f"\nexport: {export_s:.1f} s, {row['export_bytes'] / 2**20:.1f} MiB; its check: max |diff| "
          f"{row['check_max_abs_diff']:.1e}, min cosine {row['check_min_cosine']}; layer {args.layers} vs the full "
          f"model's vectors: min cosine {cos:.4f} (another layer, as asked)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(row, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
