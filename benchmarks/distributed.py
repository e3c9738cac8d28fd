"""The Ray engine at this machine's real resources: local vs Ray, each stage's rate, and the planning time.

Run: ``./dev bench distributed [--records 4000] [--repeats 2] [--data PATH]``. Input: the first ``--records``
sentences of ``--data`` (default: SST-2 train from ``../shared/data/sst2`` when present, else generated sentences),
embedded all-MiniLM-L6-v2, sentence level, the last layer mean-pooled, CPU fp32.

Ray starts with its defaults (this machine's CPUs, as a user's would), once, not timed (its start is reported).
Contestants alternate inside one process: ``local`` (``lw.extract``, torch threads = the machine's cores) and
``ray-auto`` (``num_workers="auto"``: the pool the cluster leaves room for). Each part store records what its split
cost in each stage (``split`` in its manifest: read, tokenise, encode and write seconds), from which the rate of one
task of each stage is printed. Planning is timed on a directory of 1,000 small files and on one 10 GB sparse file;
opening the parts as one store (no merge) is timed too. Prints Markdown tables and the figures that the estimate for
100M sentences of the Ray guide (``docs/how-to/ray.md``) uses.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import layerwise as lw
from layerwise.corpus.sources import open_source
from layerwise.corpus.splits import plan_splits
from layerwise.extraction import ray as lray

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


def stage_rates(store: Path) -> dict[str, float]:
    """Records per second of one task of each stage, over every part of a Ray run's output."""
    seconds = {"read": 0.0, "tokenize": 0.0, "encode": 0.0, "write": 0.0}
    records = 0
    for part in sorted(store.glob("part-*")):
        split = json.loads((part / "manifest.json").read_text())["split"]
        records += int(split["records"])
        for stage in seconds:
            seconds[stage] += float(split[f"{stage}_seconds"])
    return {stage: records / s if s > 0 else float("inf") for stage, s in seconds.items()}


def planning(root: Path) -> tuple[float, float]:
    """Seconds to plan a directory of 1,000 small files, and one 10 GB sparse file (best of 3 each)."""
    folder = root / "many"
    folder.mkdir()
    for k in range(1000):
        (folder / f"f{k:04d}.jsonl").write_text(json.dumps({"text": f"file {k}"}) + "\n")
    big = root / "big.txt"
    with open(big, "wb") as fh:
        fh.write(b"a short line of text for the sample\n" * 2000)
        fh.truncate(10 * 10**9)
    out = []
    for path in (folder, big):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            src = open_source(path)
            plan_splits(src, src.files(), 10_000)
            src.identity(lw.ReadOptions(), quick=True)
            best = min(best, time.perf_counter() - t0)
        out.append(best)
    big.unlink()
    return out[0], out[1]


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
    ray.init(include_dashboard=False, log_to_driver=False)  # Ray's defaults: the machine as a user has it
    ray_start = time.perf_counter() - t0
    torch.set_num_threads(cores)
    ex = lw.Extractor(device="cpu")
    tokens = sum(len(ids) for ids in ex.tokenizer(src.read_text().splitlines())["input_ids"])
    workers: list[int] = []

    def local(out: Path) -> None:
        lw.extract(src, out, spec, model=ex)

    def on_ray(out: Path) -> None:
        workers.append(lray.extract(src, out, spec, model=lw.ModelOptions(device="cpu"),
                                    part_records=args.part_records).workers)

    runs = {"local": local, "ray-auto": on_ray}
    times: dict[str, list[float]] = {k: [] for k in runs}
    rates: list[dict[str, float]] = []
    open_s = float("inf")
    for i in range(args.repeats + 1):  # the first round warms up (model loads, Ray workers) and is not counted
        for name, run in runs.items():
            out = root / f"{name}-{i}"
            t0 = time.perf_counter()
            run(out)
            if i:
                times[name].append(time.perf_counter() - t0)
            if name == "ray-auto":
                rates.append(stage_rates(out))
                t0 = time.perf_counter()
                len(lw.open_store(out))
                open_s = min(open_s, time.perf_counter() - t0)
            shutil.rmtree(out, ignore_errors=True)
    plan_dir, plan_big = planning(root)
    ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)

    n = args.records
    best = {k: min(v) for k, v in times.items()}
    print(f"{n:,} sentences ({tokens:,} tokens), all-MiniLM-L6-v2, CPU fp32, {cores} cores, Ray's default resources, "
          f"best of {args.repeats} alternating runs, parts of about {args.part_records} records; Ray start "
          f"{ray_start:.1f} s (not counted)\n")
    print("| run | encode workers x threads | best s | records/s | vs local |")
    print("|---|---|---|---|---|")
    shapes = {"local": f"1 x {cores}", "ray-auto": f"{workers[-1]} x 1"}
    for k, s in best.items():
        print(f"| {k} | {shapes[k]} | {s:.1f} | {n / s:,.0f} | {best['local'] / s:.2f}x |")
    stage = {k: max(r[k] for r in rates) for k in rates[0]}
    print("\n| stage (one task) | records/s |")
    print("|---|---|")
    for k, v in stage.items():
        print(f"| {k} | {v:,.0f} |")
    print(f"\nplanning: 1,000 files {plan_dir * 1e3:.0f} ms, one 10 GB file {plan_big * 1e3:.0f} ms; opening the "
          f"parts as one store {open_s * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
