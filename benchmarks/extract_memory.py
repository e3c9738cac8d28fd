"""Corpus-scale extraction: peak memory must not grow with corpus size; shard writing must stay cheap.

Run: ``./dev bench extract_memory [--sizes 20000 100000] [--level sentence] [--layers=-4:]``.

Each size runs ``layerwise.extract`` on the embedded default model in a fresh child process (so peak RSS is
that run's own), over SST-2 sentences from the shared data folder when present (cycled to the size), else
generated sentences. Prints a Markdown table: records, tokens, seconds, tokens/s, share of the run spent
writing shards (safetensors + manifest, atomic renames), store size, peak RSS.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def shared_data() -> Path:
    """``$LAYERWISE_SHARED_DATA`` or ``../shared/data`` beside the repository."""
    return Path(os.environ.get("LAYERWISE_SHARED_DATA", REPO.parent / "shared" / "data"))


def corpus_texts(n: int) -> tuple[list[str], str]:
    sst2 = shared_data() / "sst2" / "train.tsv"
    if sst2.is_file():
        lines = sst2.read_text(encoding="utf-8").splitlines()[1:]
        base = [ln.split("\t")[0] for ln in lines if ln.strip()]
        source = f"SST-2 train ({len(base):,} sentences, cycled)"
    else:
        rng = random.Random(0)
        words = "the a of to and film story actor plot funny dull moving brilliant slow cast scene music".split()
        base = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 30))) for _ in range(20000)]
        source = "generated sentences (shared SST-2 not found)"
    return [base[i % len(base)] for i in range(n)], source


CHILD = """
import json, resource, sys, layerwise as lw
corpus, store, level, layers = sys.argv[1:5]
spec = lw.EncodeSpec(layers=layers, combine="concat", level=level, pool="mean" if level == "sentence" else None)
s = lw.extract(corpus, store, spec, model=lw.Extractor(device="cpu"), options=lw.ExtractOptions(progress=False))
print(json.dumps({"records": s.records, "tokens": s.tokens, "seconds": s.seconds, "write_seconds": s.write_seconds,
                  "bytes": s.bytes_written, "shards": s.shards_written,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def run_size(n: int, level: str, layers: str, tmp: Path) -> dict:
    texts, source = corpus_texts(n)
    corpus = tmp / f"corpus-{n}.txt"
    corpus.write_text("\n".join(texts) + "\n", encoding="utf-8")
    store = tmp / f"store-{n}"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", CHILD, str(corpus), str(store), level, layers],
                         env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["source"] = source
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", type=int, nargs="+", default=[20000, 100000])
    ap.add_argument("--level", default="sentence")
    ap.add_argument("--layers", default="-4:")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for n in args.sizes:
            rows.append((n, run_size(n, args.level, args.layers, Path(d))))
            print(f"done {n}: {rows[-1][1]}", file=sys.stderr)
    print(f"Extraction to a store, default model, layers {args.layers} concat, {args.level} level "
          f"(mean pool), float32; corpus: {rows[0][1]['source']}\n")
    print("| records | tokens | seconds | tokens/s | writing shards | store MB | shards | peak RSS MB |")
    print("|---|---|---|---|---|---|---|---|")
    for _, r in rows:
        print(f"| {r['records']:,} | {r['tokens']:,} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:,.0f} | "
              f"{r['write_seconds'] / r['seconds']:.1%} | {r['bytes'] / 1e6:,.0f} | {r['shards']} | "
              f"{r['peak_rss_mb']:,.0f} |")


if __name__ == "__main__":
    main()
