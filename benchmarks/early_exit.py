"""Early exit: time to get layer k of L versus the full depth, on the embedded default model.

Run: ``./dev bench early_exit [--texts 2000] [--repeats 5]``. Measurements alternate between the
configurations inside one process (the machine is shared and noisy), and the table reports the median time
of each and its ratio to full depth. Writes nothing; prints a Markdown table.
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ex = lw.Extractor(device="cpu")
    texts = make_texts(args.texts)
    n_tokens = sum(len(ids) for ids in ex.tokenizer(texts)["input_ids"])
    L = ex.num_layers
    configs = {k: (k,) for k in range(1, L + 1)}
    ex.encode(texts[:200], layers=L)  # warm-up
    times: dict[int, list[float]] = {k: [] for k in configs}
    for _ in range(args.repeats):
        for k in configs:  # alternate configurations within each repeat
            t0 = time.perf_counter()
            ex.encode(texts, layers=k, pool="mean")
            times[k].append(time.perf_counter() - t0)
    full = statistics.median(times[L])
    print(f"Early exit on {ex!r}: {args.texts} texts, {n_tokens} tokens, {torch.get_num_threads()} threads, "
          f"median of {args.repeats} alternating runs\n")
    print("| layer asked | median s | tokens/s | time / full depth | ideal k/L |")
    print("|---|---|---|---|---|")
    for k in configs:
        med = statistics.median(times[k])
        print(f"| {k} of {L} | {med:.3f} | {n_tokens / med:,.0f} | {med / full:.1%} | {k / L:.1%} |")


if __name__ == "__main__":
    main()
