"""A model larger than the GPU memory it may take, streamed to the GPU block by block (issue 36, item 5), against the
same model held in GPU memory.

Run: ``./dev bench gpu_stream [--shape tinyllama-1.1b] [--layers all] [--texts 1024] [--max-memory 1GB] [--rounds 3]
[--texts-file F] [--tokenizer DIR]``. Needs a CUDA GPU (the CPU path is measured by ``big_model``).

The checkpoint is ``big_model``'s (random weights of a real shape, bfloat16, built shard by shard and cached). In one
process, the variants alternate round by round, best of ``--rounds`` (after one warm-up each), each encoding the same
texts with ``layers=--layers, combine="stack", pool="mean"`` (one mean-pooled vector per hidden state asked for) in
one call. Every block runs whatever layers are asked for (the deepest is the last); ``--layers`` decides how much
of a chunk's memory the kept states take (all 23 states of a 1,024-record chunk do not fit beside the weights, so
fewer records share one pass over the blocks):

* ``in GPU memory``: ``Extractor(path, device="cuda")``, every block on the GPU (bf16 held, float32 compute);
* ``streamed, pinned copies kept``: ``max_memory`` below the blocks' bytes, so blocks past it stream; their pinned host
  copies are kept (they fit in host memory), the next block's copy overlapping the current block's compute;
* ``streamed, staged from the checkpoint``: the same, with the pinned copies not kept (``transfer.HOST_SHARE = 0``):
  each chunk reads the blocks from the checkpoint's pages again through two pinned staging buffers;
* ``streamed, not overlapped``: pinned copies kept, but no block moved ahead (each block's copy waited for before its
  compute): what the overlap saves.

Recorded per variant: records/s, its ratio to the in-memory run, the largest absolute difference of its vectors from
the in-memory ones (and relative to their largest value), the variant's own peak of allocated GPU memory (what it
holds between encodes plus its encode's peak above everything held), and the bytes moved to the GPU per encode.
Texts: the first SST-2 train sentences (``../shared/data/sst2/train.tsv``, or ``--texts-file``, one text a line). Writes
``benchmarks/results/gpu_stream.json``, merged by configuration (shape, layers, max_memory).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
from pathlib import Path
from typing import Any, Callable

from benchmarks.big_model import SHAPES, build_checkpoint, cache_root, sst2_texts

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_stream.json"


def texts_from(args: argparse.Namespace) -> list[str]:
    """The texts to encode: ``--texts-file`` or SST-2's first train sentences, ``--texts`` of them."""
    if args.texts_file:
        lines = [t for t in Path(args.texts_file).read_text(encoding="utf-8").splitlines() if t.strip()]
    else:
        lines = sst2_texts(args.texts) or []
    if len(lines) < args.texts:
        raise SystemExit(f"gpu_stream: {len(lines)} texts found, {args.texts} asked for: give --texts-file (one text "
                         f"a line) or put SST-2 under ../shared/data")
    return lines[: args.texts]


def variant(path: Path, layers: str, max_memory: str | None, keep_host: bool = True, overlap: bool = True
            ) -> Callable[[list[str]], Any]:
    """A loaded Extractor's encode of the run's texts (a closure), set up as the variant says."""
    import layerwise as lw
    from layerwise.model import blocks as blocks_module
    from layerwise.model import transfer

    ex = lw.Extractor(str(path), device="cuda", backend="torch", max_memory=max_memory)
    real_streamed = blocks_module.Blocks.streamed

    def encode(texts: list[str]) -> Any:
        share = transfer.HOST_SHARE
        transfer.HOST_SHARE = share if keep_host else 0.0
        if not overlap:
            blocks_module.Blocks.streamed = lambda self, m, ahead=None: real_streamed(self, m, None)
        try:
            return ex.encode(texts, layers=layers if not layers.lstrip("-").isdigit() else [int(layers)],
                             combine="stack", pool="mean")
        finally:
            transfer.HOST_SHARE = share
            blocks_module.Blocks.streamed = real_streamed

    encode.extractor = ex  # type: ignore[attr-defined]
    return encode


def measure(runs: dict[str, Any], held: dict[str, int], texts: list[str], rounds: int
            ) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """The variants' encodes, alternating, best of ``rounds``: ``(seconds, own peak of GPU memory (``held`` plus
    the encode's peak above all held memory), bytes moved to the GPU per encode)`` by variant."""
    import torch

    best = {name: float("inf") for name in runs}
    peak: dict[str, int] = {}
    moved: dict[str, int] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            feed = run.extractor.loaded.blocks.feed  # type: ignore[attr-defined]
            before = feed.bytes_to_gpu if feed is not None else 0
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()  # every variant's held memory
            t0 = time.perf_counter()
            run(texts)
            torch.cuda.synchronize()
            best[name] = min(best[name], time.perf_counter() - t0)
            peak[name] = max(peak.get(name, 0), torch.cuda.max_memory_allocated() - base + held[name])
            feed = run.extractor.loaded.blocks.feed  # type: ignore[attr-defined]
            moved[name] = (feed.bytes_to_gpu - before) if feed is not None else 0
    return best, peak, moved


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="./dev bench gpu_stream", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="tinyllama-1.1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", default="all", help="the layers encoded: 'all', '-1', '0:5'... (default all)")
    parser.add_argument("--texts", type=int, default=1024)
    parser.add_argument("--max-memory", default="1GB", help="the streamed variants' GPU budget (default 1GB)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--texts-file", default=None)
    parser.add_argument("--tokenizer", default=None, help="copy the checkpoint's tokenizer from this directory "
                                                          "(default: the embedded default model's)")
    parser.add_argument("--build-threads", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)

    import numpy as np
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_stream: needs a CUDA GPU (big_model measures the CPU path)")
    texts = texts_from(args)
    built = build_checkpoint(args.shape, cache_root(), args.build_threads,
                             Path(args.tokenizer) if args.tokenizer else None)
    path = Path(built["path"])
    names = {"in GPU memory": dict(max_memory=None),
             "streamed, pinned copies kept": dict(max_memory=args.max_memory),
             "streamed, staged from the checkpoint": dict(max_memory=args.max_memory, keep_host=False),
             "streamed, not overlapped": dict(max_memory=args.max_memory, overlap=False)}
    runs: dict[str, Callable[[list[str]], Any]] = {}
    load_s: dict[str, float] = {}
    held: dict[str, int] = {}  # GPU bytes each variant keeps between encodes (its weights, the feed's slots)
    vectors: dict[str, Any] = {}
    for name, kw in names.items():  # one after the other, so each one's GPU memory is its own
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        runs[name] = variant(path, args.layers, **kw)
        load_s[name] = time.perf_counter() - t0
        vectors[name] = runs[name](texts)  # warm-up: first-call allocations, the first read of the checkpoint
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before
    best, peak, moved = measure(runs, held, texts, args.rounds)
    reference = vectors["in GPU memory"]
    table = []
    for name in runs:
        rate = len(texts) / best[name]
        table.append({"variant": name, "records_per_s": round(rate, 1),
                      "ratio_to_in_memory": round(best["in GPU memory"] / best[name], 3),
                      "max_abs_diff": float(np.abs(vectors[name] - reference).max()),
                      "max_rel_diff": float(np.abs(vectors[name] - reference).max() / np.abs(reference).max()),
                      "gpu_peak_gb": round(peak[name] / 2**30, 3),
                      "gb_to_gpu_per_encode": round(moved[name] / 2**30, 3),
                      "load_s": round(load_s[name], 2),
                      "weights": {k: v for k, v in runs[name].extractor.describe()["weights"].items()  # type: ignore
                                  if k in ("resident_blocks", "blocks", "held_dtype", "max_memory", "transfer")}})
    props = torch.cuda.get_device_properties(0)
    key = f"{args.shape} layers={args.layers} max_memory={args.max_memory}"
    result = {"date": time.strftime("%Y-%m-%d"), "machine": {
        "gpu": props.name, "gpu_memory_gb": round(props.total_memory / 2**30, 1), "cpu": platform.processor(),
        "torch": torch.__version__, "cuda": torch.version.cuda}, "shape": args.shape, "layers": args.layers,
        "texts": len(texts),
        "max_memory": args.max_memory, "rounds": args.rounds, "checkpoint_gb": round(built["bytes"] / 2**30, 2),
        "runs": table}
    print("| variant | records/s | vs in memory | max abs diff (relative) | GPU peak GB | GB to GPU per encode |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['variant']} | {r['records_per_s']} | {r['ratio_to_in_memory']}x | "
              f"{r['max_abs_diff']:.2e} ({r['max_rel_diff']:.1e}) | "
              f"{r['gpu_peak_gb']} | {r['gb_to_gpu_per_encode']} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    merged = json.loads(out.read_text(encoding="utf-8")) if out.is_file() else {}
    merged[key] = result
    out.write_text(json.dumps(merged, indent=1) + "\n", encoding="utf-8")
    gc.collect()


if __name__ == "__main__":
    main()
