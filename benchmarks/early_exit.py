"""Early exit: time to get layer k of L versus the full depth, on the embedded default model.

Run: ``./dev bench early_exit [--texts 2000] [--repeats 5] [--backends auto,torch,onnx,openvino]``. Measurements
alternate between the configurations (every runtime, every depth) inside one process (the machine is shared and
noisy), and the table reports the median time of each and its ratio to the same runtime's full depth, with the
target (layer k of L costs at most k/L + 5 points) checked for every runtime. Writes nothing; prints a Markdown
table.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time

import torch

import layerwise as lw

WORDS = (
    "the a of to and in model layer token paris EU rejects german call boycott british lamb quick brown fox "
    "jumps lazy dog attention transformer hidden state probe which knows what syntax meaning"
).split()


def make_texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40))) for _ in range(n)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--backends", default="auto,torch,onnx,openvino",
                    help="comma-separated runtimes to time (openvino: where the [openvino] extra is installed)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    names = [b for b in args.backends.split(",") if b and (b != "openvino" or importlib.util.find_spec("openvino"))]
    runtimes = {b: lw.Extractor(device="cpu", backend=b) for b in names}
    ex = next(iter(runtimes.values()))
    texts = make_texts(args.texts)
    n_tokens = sum(len(ids) for ids in ex.tokenizer(texts)["input_ids"])
    L = ex.num_layers
    for runtime in runtimes.values():
        for k in range(1, L + 1):
            runtime.encode(texts[:200], layers=k)  # warm-up; exports and exactness checks happen here
    times: dict[tuple[str, int], list[float]] = {(b, k): [] for b in runtimes for k in range(1, L + 1)}
    for _ in range(args.repeats):
        for (b, k) in times:  # alternate configurations within each repeat
            t0 = time.perf_counter()
            runtimes[b].encode(texts, layers=k, pool="mean")
            times[b, k].append(time.perf_counter() - t0)
    chosen = runtimes["auto"].describe()["runtime"] if "auto" in runtimes else "-"
    print(f"Early exit on the default model: {args.texts} texts, {n_tokens} tokens, {torch.get_num_threads()} "
          f"threads, median of {args.repeats} alternating runs; auto: {chosen}\n")
    print("| layer asked | ideal k/L | " + " | ".join(f"{b}: s, time / full depth" for b in runtimes) + " |")
    print("|---|---|" + "---|" * len(runtimes))
    misses = []
    for k in range(1, L + 1):
        cells = []
        for b in runtimes:
            med, full = statistics.median(times[b, k]), statistics.median(times[b, L])
            cells.append(f"{med:.3f}, {med / full:.1%}")
            if med / full > k / L + 0.05:
                misses.append(f"{b} layer {k}: {med / full:.1%} > {k / L + 0.05:.1%}")
        print(f"| {k} of {L} | {k / L:.1%} | " + " | ".join(cells) + " |")
    print("\nTarget: layer k of L costs <= k/L + 5 points on every runtime: " + ("; ".join(misses) or "met"))


if __name__ == "__main__":
    main()
