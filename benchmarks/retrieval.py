"""What each output precision costs in retrieval: recall@10 against float32 on SST-2 sentences, queries and corpus.

Run: ``./dev bench retrieval [--corpus 5000] [--queries 500] [--calibration 1000]``.

The embedded default model (all-MiniLM-L6-v2), last layer, mean-pooled, L2-normalised, as sentence-transformers
serves it. Corpus: the first ``--corpus`` sentences of SST-2 train; queries: the first ``--queries`` sentences of
SST-2 dev (a disjoint set); calibration for int8/uint8: the ``--calibration`` train sentences *after* the corpus (the
ranges never see the corpus or the queries). Each precision is encoded by layerwise itself
(``Extractor.encode(output_dtype=...)``), then searched the way its users search it:

  float32, float16   dot product
  int8, uint8        integer dot product (int32 accumulators), as vector databases score int8 vectors, and the
                     dot product of the values mapped back through the calibration ranges ("dequantized")
  binary, ubinary    Hamming distance on the packed bits (popcount of XOR)

recall@10 is the share of each query's float32 top 10 that the precision's top 10 keeps (ties broken by index),
averaged over queries. "bytes" is one vector's size; "x smaller" is against float32. Also the ``dimensions`` cut
(Matryoshka-style leading dimensions, renormalised) for comparison. Writes ``benchmarks/results/retrieval.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results" / "retrieval.json"
POPCOUNT = np.array([bin(i).count("1") for i in range(256)], dtype=np.int32)


def shared_sst2() -> Path:
    return Path(os.environ.get("LAYERWISE_SHARED_DATA", REPO.parent / "shared" / "data")) / "sst2"


def sentences(path: Path) -> list[str]:
    with open(path, encoding="utf-8", newline="") as fh:
        return [row["sentence"] for row in csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)]


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` highest scores per row, ties broken by the lower index."""
    order = np.lexsort((np.broadcast_to(np.arange(scores.shape[1]), scores.shape), -scores), axis=1)
    return order[:, :k]


def hamming_scores(q: np.ndarray, c: np.ndarray) -> np.ndarray:
    """Negative Hamming distance between packed bit rows ``q [n, B]`` and ``c [m, B]`` (uint8 view)."""
    qu, cu = q.view(np.uint8), c.view(np.uint8)
    out = np.empty((len(qu), len(cu)), dtype=np.int32)
    for i, row in enumerate(qu):
        out[i] = -POPCOUNT[np.bitwise_xor(cu, row)].sum(1)
    return out


def dequantize(x: np.ndarray, precision: str, ranges) -> np.ndarray:
    """int8/uint8 values back to floats through their calibration ranges (the inverse of the quantization)."""
    lo, hi = (np.asarray(r, np.float32) for r in ranges)
    offset = 128 if precision == "int8" else 0
    return (x.astype(np.float32) + offset) * ((hi - lo) / 255.0) + lo


def scores_of(precision: str, q: np.ndarray, c: np.ndarray, scoring: str = "", ranges=None) -> np.ndarray:
    if precision in ("binary", "ubinary"):
        return hamming_scores(q, c)
    if precision in ("int8", "uint8"):
        if scoring == "dequantized":
            return dequantize(q, precision, ranges) @ dequantize(c, precision, ranges).T
        return q.astype(np.int32) @ c.astype(np.int32).T
    return q.astype(np.float32) @ c.astype(np.float32).T


def recall_at(k: int, want: np.ndarray, got: np.ndarray) -> float:
    return float(np.mean([len(set(w) & set(g)) / k for w, g in zip(want, got)]))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=int, default=5000)
    ap.add_argument("--queries", type=int, default=500)
    ap.add_argument("--calibration", type=int, default=1000)
    ap.add_argument("--k", type=int, default=10)
    args = ap.parse_args(argv)
    data = shared_sst2()
    if not (data / "train.tsv").is_file():
        sys.exit(f"SST-2 not found at {data}; set LAYERWISE_SHARED_DATA to the folder holding sst2/")
    import layerwise as lw
    from layerwise.encoding.precision import NUMPY_DTYPES, packed_width

    train, dev = sentences(data / "train.tsv"), sentences(data / "dev.tsv")
    corpus, queries = train[: args.corpus], dev[: args.queries]
    calibration = train[args.corpus : args.corpus + args.calibration]
    ex = lw.Extractor()
    base = dict(layers=-1, pool="mean", normalize=True)
    t0 = time.perf_counter()
    ranges = {p: ex.calibrate(calibration, lw.EncodeSpec(output_dtype=p, normalize=True)).calibration
              for p in ("int8", "uint8")}
    calib_s = time.perf_counter() - t0

    def enc(texts: list[str], precision: str, dimensions: int | None = None) -> np.ndarray:
        return ex.encode(texts, **base, output_dtype=precision, calibration=ranges.get(precision),
                         dimensions=dimensions, batch_tokens=4096)

    ref_c, ref_q = enc(corpus, "float32"), enc(queries, "float32")
    want = top_k(scores_of("float32", ref_q, ref_c), args.k)
    rows = []
    variants = [("float32", None, "dot"), ("float16", None, "dot")]
    variants += [(p, None, s) for p in ("int8", "uint8") for s in ("integer dot", "dequantized")]
    variants += [("binary", None, "hamming"), ("ubinary", None, "hamming")]
    variants += [("float32", 128, "dot"), ("float32", 64, "dot")]
    done: dict = {}
    for precision, dims, scoring in variants:
        if (precision, dims) not in done:
            done[(precision, dims)] = enc(corpus, precision, dims), enc(queries, precision, dims)
        c, q = done[(precision, dims)]
        got = top_k(scores_of(precision, q, c, scoring, ranges.get(precision)), args.k)
        width = dims or ref_c.shape[1]
        nbytes = packed_width(width, precision) * np.dtype(NUMPY_DTYPES[precision]).itemsize
        rows.append({"precision": precision, "dimensions": width, "scoring": scoring, "bytes": int(nbytes),
                     "x_smaller": round(ref_c[0].nbytes / nbytes, 1),
                     f"recall@{args.k}": round(recall_at(args.k, want, got), 4)})
        print(f"{precision:8s} dims {width:4d} {scoring:12s} {nbytes:5d} B  x{rows[-1]['x_smaller']:5.1f}  "
              f"recall@{args.k} {rows[-1][f'recall@{args.k}']:.4f}", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs", "model": ex.loaded.name, "corpus": len(corpus), "queries": len(queries),
           "calibration_texts": len(calibration), "calibration_s": round(calib_s, 2), "rows": rows}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
