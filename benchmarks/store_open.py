"""What the store's integrity checks cost: opening a store of 1,000 shards (manifest checked, every listed shard's
size checked, unlisted files looked for) against reading its features once, and a full ``verify`` (every sha256).

Run: ``./dev bench store_open [--shards 1000] [--records 1024] [--dim 384] [--repeats 5]``.

The store is written with :class:`~layerwise.store.StoreWriter` (random float32 sentence vectors: the checks do not
depend on the values) into a temporary directory, so the files are in the page cache: the read is the fastest it can
be, and the ratio the least favourable to the checks. Contestants alternate, best of ``--repeats``. Target: the open
costs < 5% of one read of the features (``store.to_numpy()`` on a freshly opened store, which also checks each
shard's header on its first use).
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

from layerwise.store import StoreWriter, open_store, verify_store
from layerwise.store.layout import shard_rows

TARGET = 0.05


def build(path: Path, shards: int, records: int, dim: int) -> None:
    """A complete sentence-level store of ``shards`` shards of ``records`` float32 vectors of width ``dim``."""
    header = {"spec": {"layers": [-1], "pool": "mean", "level": "sentence"}, "model": {"name": "bench"},
              "tokenizer": {}, "input": {"path": "bench", "keep": []}, "feature_shape": [dim]}
    writer = StoreWriter(path, header)
    writer.open()
    rng = np.random.default_rng(0)
    line = 1
    for _ in range(shards):
        feats = rng.standard_normal((records, dim), dtype=np.float32)
        tensors, meta = shard_rows("sentence", range(line, line + records), feats, dim, np.float32, tokens=records)
        writer.write_shard(tensors, meta, tokens=records)
        line += records
    writer.write_manifest("complete", 0)


def best(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall time of each contestant, run alternately ``repeats`` times after one warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: float("inf") for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name] = min(times[name], time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shards", type=int, default=1000)
    ap.add_argument("--records", type=int, default=1024, help="records per shard")
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "store"
        build(path, args.shards, args.records, args.dim)
        size = sum(p.stat().st_size for p in path.iterdir())
        times = best({"open": lambda: open_store(path), "read": lambda: open_store(path).to_numpy()}, args.repeats)
        verify = best({"verify": lambda: verify_store(path)}, 1)["verify"]
    read_only = times["read"] - times["open"]  # the read itself, without its own open
    ratio = times["open"] / read_only
    out = {"shards": args.shards, "records_per_shard": args.records, "dim": args.dim, "store_mb": size / 1e6,
           "open_s": times["open"], "read_s": read_only, "open_over_read": ratio, "verify_s": verify,
           "verify_mb_s": size / 1e6 / verify, "target": TARGET, "machine": platform.processor() or platform.machine()}
    print(f"store: {args.shards} shards x {args.records} records x {args.dim} float32 = {size / 1e6:,.0f} MB")
    print(f"open (manifest + sizes): {times['open'] * 1e3:.1f} ms; read the features once: {read_only * 1e3:.0f} ms; "
          f"open / read = {ratio:.1%} (target < {TARGET:.0%}: {'met' if ratio < TARGET else 'NOT met'})")
    print(f"verify (every sha256 and inner check): {verify:.2f} s ({size / 1e6 / verify:,.0f} MB/s)")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
