"""What a resume's check costs: every listed shard's sha256 on a ~1 GB store, in seconds and as a share of the time
extracting that store takes.

Run: ``./dev bench resume_check [--gb 1.0] [--texts 300] [--repeats 3]``.

Two measurements, one run:

* **The check.** A complete sentence-level store of about ``--gb`` GB (32 MB shards of 384-wide float32 vectors:
  the default model's width; the check does not depend on the values) is written with
  :class:`~layerwise.store.StoreWriter` into a temporary directory, so its files are in the page cache (hashing is
  then bound by the CPU; on a cold disk the read is the bound, and it is the same read a resume does anyway). Timed:
  reopening it as a resume does (``StoreWriter.open``: lock, manifest, every shard checked) with
  ``check="sha256"`` (the default: every byte, several shards at a time) against ``check="headers"`` (sizes and
  headers, the last shard's sha256: what a resume checked before), and ``first_damaged`` with one thread. Best of
  ``--repeats``, alternating.
* **The extraction it guards.** ``lw.extract`` of ``--texts`` SST-2 dev sentences with the embedded default model
  (PyTorch backend: no export in the timing) at sentence level and at token level (every token's vector: the most
  bytes per second, the least favourable case for the check's share). The rate (MB of store per second) gives the
  time to extract the ~1 GB store; the share is check seconds / that time.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np

import layerwise as lw
from layerwise.store import StoreWriter
from layerwise.store.integrity import Expected, first_damaged
from layerwise.store.layout import shard_rows

DIM = 384  # all-MiniLM-L6-v2's width
SST2 = Path(__file__).resolve().parents[1] / ".." / "shared" / "data" / "sst2" / "dev.tsv"
HEADER = {"spec": {"layers": [-1], "pool": "mean", "level": "sentence"}, "model": {"name": "bench"}, "tokenizer": {},
          "input": {"path": "bench", "keep": []}, "feature_shape": [DIM]}


def build(path: Path, gb: float) -> int:
    """A complete store of about ``gb`` GB of 32 MB shards; returns its bytes."""
    records = (32 << 20) // (DIM * 4)
    shards = max(1, round(gb * 1e9 / (records * DIM * 4)))
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((records, DIM), dtype=np.float32)
    line = 1
    with StoreWriter(path, HEADER) as writer:
        writer.open()
        for _ in range(shards):
            feats[0, 0] = line  # each shard its own bytes
            tensors, meta = shard_rows("sentence", range(line, line + records), feats, DIM, np.float32, tokens=records)
            writer.write_shard(tensors, meta, tokens=records)
            line += records
        writer.write_manifest("complete", 0)
    return sum(p.stat().st_size for p in path.iterdir())


def reopen(path: Path, check: str) -> Callable[[], object]:
    """A resume's open of the store, with ``check``."""

    def run() -> object:
        with StoreWriter(path, HEADER, check=check) as writer:
            state = writer.open()
        assert state == "complete", state
        return state

    return run


def best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each contestant, run alternately ``repeats`` times."""
    times = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times


def extraction_rate(texts: int, level: str, tmp: Path, ex: lw.Extractor) -> dict[str, float]:
    """Extract ``texts`` SST-2 dev sentences at ``level``; MB of store written per second of the run."""
    store = tmp / f"sst2-{level}"
    lines = SST2.read_text(encoding="utf-8").splitlines()[: texts + 1]
    corpus = tmp / f"sst2-{texts}.tsv"
    corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
    spec = lw.EncodeSpec(level=level) if level != "sentence" else lw.EncodeSpec()
    summary = lw.extract(corpus, store, spec, model=ex, reading=lw.ReadOptions(text_field="sentence"),
                         options=lw.ExtractOptions(progress=False))
    size = sum(p.stat().st_size for p in store.glob("shard-*"))
    return {"records": summary.records, "tokens": summary.tokens, "seconds": summary.seconds, "mb": size / 1e6,
            "mb_per_s": size / 1e6 / summary.seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=1.0, help="the store's size")
    ap.add_argument("--texts", type=int, default=300, help="SST-2 dev sentences extracted to time the extraction")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        t0 = time.perf_counter()
        size = build(path, args.gb)
        built = time.perf_counter() - t0
        manifest = json.loads((path / "manifest.json").read_text())
        expected = Expected.of(manifest)
        times = best({"sha256": reopen(path, "sha256"), "headers": reopen(path, "headers"),
                      "sha256, 1 thread": lambda: first_damaged(path, manifest["shards"], expected, workers=1)},
                     args.repeats)
        ex = lw.Extractor(device="cpu", backend="torch")
        rates = {level: extraction_rate(args.texts, level, Path(tmp), ex) for level in ("sentence", "token")}
    shards = len(manifest["shards"])
    gb = size / 1e9
    out = {"store_gb": gb, "shards": shards, "write_s": built, "check_s": times, "extraction": rates,
           "extract_store_s": {k: size / 1e6 / r["mb_per_s"] for k, r in rates.items()},
           "machine": platform.processor() or platform.machine()}
    out["share"] = {k: times["sha256"] / s for k, s in out["extract_store_s"].items()}
    print(f"store: {shards} shards, {gb:.2f} GB (written and hashed in {built:.1f} s)")
    for name, t in times.items():
        print(f"resume check {name:>16}: {t:6.2f} s ({gb / t:.2f} GB/s)")
    for level, r in rates.items():
        took = out["extract_store_s"][level]
        print(f"extract {level:>8}: {r['records']} records, {r['tokens']:,} tokens in {r['seconds']:.1f} s = "
              f"{r['mb_per_s']:.2f} MB/s of store -> {gb:.2f} GB in {took / 60:,.1f} min; the sha256 check is "
              f"{out['share'][level]:.3%} of it")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
