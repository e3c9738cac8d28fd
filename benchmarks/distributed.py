"""Local extraction vs the Ray engine with 1 and 2 encode workers, and the serial pieces of a Ray run.

Run: ``./dev bench distributed [--records 4000] [--repeats 2] [--data PATH]``. Input: the first ``--records``
sentences of ``--data`` (default: SST-2 train from ``../shared/data/sst2`` when present, else generated sentences),
embedded all-MiniLM-L6-v2, sentence level, the last layer mean-pooled, CPU fp32.

Contestants alternate inside one process on one local Ray cluster (started once, not timed; its start is reported
apart): ``local`` (``lw.extract``, torch threads = the machine's cores), ``ray-1`` (one encode actor with all cores
but one as torch threads) and ``ray-2`` (two actors, ``cores // 2`` threads each, oversubscribing the read/tokenise/
write tasks on a 2-core machine). Also timed: the serial pieces a cluster run cannot spread, the driver's count of
the input, the single read task's rate (reading and pickling parts) and the merge. Prints a Markdown table and the
numbers the README's estimate for 100M sentences uses.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import layerwise as lw
from layerwise.corpus.readers import ReadOptions
from layerwise.corpus.sources import open_source
from layerwise.extraction import ray as lray
from layerwise.store import merge_stores

WORDS = "the a film was good bad plot actor scene long short funny dull story music end start".split()


def corpus(path: Path, n: int, data: str | None) -> Path:
    """``n`` sentences, one per line: from an SST-2 tsv when given or found, else generated."""
    shared = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sst2" / "train.tsv"
    source = Path(data) if data else shared
    if source.is_file():
        lines = source.read_text(encoding="utf-8").splitlines()[1 : n + 1]
        texts = [line.split("\t")[0] for line in lines]
    else:
        rng = random.Random(0)
        texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 30))) for _ in range(n)]
    path.write_text("\n".join(texts) + "\n", encoding="utf-8")
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--records", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--part-records", type=int, default=500)
    ap.add_argument("--data", default=None)
    args = ap.parse_args(argv)
    import ray
    import torch

    cores = os.cpu_count() or 2
    root = Path(tempfile.mkdtemp(prefix="lwbench"))
    src = corpus(root / "corpus.txt", args.records, args.data)
    spec = lw.EncodeSpec()
    t0 = time.perf_counter()
    ray.init(num_cpus=cores + 1, include_dashboard=False, log_to_driver=False)  # +1: room for the light stages
    ray_start = time.perf_counter() - t0
    torch.set_num_threads(cores)
    ex = lw.Extractor(device="cpu")
    tokens = sum(len(ids) for ids in ex.tokenizer(src.read_text().splitlines())["input_ids"])

    def local(out: Path) -> None:
        lw.extract(src, out, spec, model=ex)

    def on_ray(workers: int, threads: int):
        def run(out: Path) -> None:
            lray.extract(src, out, spec, model=lw.ModelOptions(device="cpu"), num_workers=workers,
                         cpus_per_worker=threads, part_records=args.part_records)
        return run

    runs = {"local": local, "ray-1": on_ray(1, max(1, cores - 1)), "ray-2": on_ray(2, max(1, cores // 2))}
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.repeats + 1):  # the first round warms up (model loads, Ray workers) and is not counted
        for name, run in runs.items():
            out = root / f"{name}-{i}"
            t0 = time.perf_counter()
            run(out)
            if i:
                times[name].append(time.perf_counter() - t0)
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out.with_name(out.name + ".parts"), ignore_errors=True)
    # the serial pieces: the driver's count, the one read task, the merge
    source = open_source(src)
    t0 = time.perf_counter()
    lray._count_items(source, ReadOptions())
    count_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_parts = sum(1 for _ in lray.read_parts({}, source, ReadOptions(), args.part_records,
                                             set(range(10**6)), strict=False))
    read_s = time.perf_counter() - t0
    lray.extract(src, root / "m", spec, model=lw.ModelOptions(device="cpu"), num_workers=1,
                 cpus_per_worker=max(1, cores - 1), part_records=args.part_records)
    shutil.rmtree(root / "m")
    t0 = time.perf_counter()
    merge_stores([lray.part_path(root / "m", p) for p in range(n_parts)], root / "m2")
    merge_s = time.perf_counter() - t0
    ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)

    n = args.records
    best = {k: min(v) for k, v in times.items()}
    print(f"{n:,} sentences ({tokens:,} tokens), all-MiniLM-L6-v2, CPU fp32, {cores} cores, best of "
          f"{args.repeats} alternating runs, parts of {args.part_records} records; Ray start {ray_start:.1f} s "
          f"(not counted)\n")
    print("| run | encode workers x threads | best s | records/s | vs local | overhead / record |")
    print("|---|---|---|---|---|---|")
    shapes = {"local": f"1 x {cores}", "ray-1": f"1 x {max(1, cores - 1)}", "ray-2": f"2 x {max(1, cores // 2)}"}
    for k, s in best.items():
        over = (s - best["local"]) / n * 1e3
        print(f"| {k} | {shapes[k]} | {s:.1f} | {n / s:,.0f} | {best['local'] / s:.2f}x | "
              f"{'-' if k == 'local' else f'{over:+.2f} ms'} |")
    print(f"\nserial pieces: driver count {n / count_s:,.0f} records/s, read task {n / read_s:,.0f} records/s, "
          f"merge {n / merge_s:,.0f} records/s ({n_parts} parts)")


if __name__ == "__main__":
    main()
