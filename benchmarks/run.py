"""Speed of layer features: layerwise against the code people write today, side by side in one process.

Run: ``./dev bench run [--model default|bert-base-shape|minilm-shape] [--texts 2000] [--repeats 3]``.

Contestants (mean-pooled last layer unless said; outputs are checked equal before anything is timed):

* ``seed``       one sentence at a time, padded to 512, autograd on, ``output_hidden_states=True`` (timed on a
                 subset: it is very slow)
* ``unsorted``   batches of 32 in input order, ``torch.no_grad``, ``output_hidden_states=True``, masked mean
* ``sbert``      sentence-transformers ``encode`` (batch 32, its own length sorting) on the same weights
* ``layerwise``  ``Extractor.encode(texts, layers=-1, pool="mean")``
* ``onnx``       the same with ``backend="onnx"`` (ONNX Runtime; export cached outside the timing)
* ``layer k``    ``Extractor.encode(texts, layers=k)`` for every k (early exit)

Measurements alternate between contestants in each repeat (the machine is shared and noisy); the table reports
medians, tokens/s, the ratio to layerwise and the share of the machine's fp32 matrix-product limit, measured
here with a 2048 x 2048 matmul: model FLOPs per token / time / measured GEMM FLOP/s. Random-weight models of real
shapes are fine for speed (FLOPs do not depend on weights); ``default`` is the embedded real model.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import layerwise as lw

SHAPES = {
    "bert-base-shape": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "minilm-shape": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
}


def gemm_flops(n: int = 2048, repeats: int = 10) -> float:
    """Measured fp32 matrix-product rate (FLOP/s) of this machine with torch's current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(2):
        a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def model_flops_per_token(cfg, layers: int, mean_len: float) -> float:
    """Forward FLOPs per token through ``layers`` encoder layers (projections, FFN, attention scores)."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return layers * (2 * (4 * d * d + 2 * d * ff) + 4 * mean_len * d)


def make_model(name: str, tmp: Path) -> str:
    if name == "default":
        return lw.default_model_path()
    from transformers import BertConfig, BertModel

    cfg = BertConfig(vocab_size=30522, max_position_embeddings=512, **SHAPES[name])
    torch.manual_seed(0)
    model = BertModel(cfg).eval()
    path = tmp / name
    model.save_pretrained(path, safe_serialization=True)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(lw.default_model_path()).save_pretrained(path)  # uncased WordPiece, 30522 ids
    return str(path)


def make_texts(n: int) -> list[str]:
    from benchmarks.extract_memory import corpus_texts

    texts, _ = corpus_texts(n)
    rng = random.Random(0)
    rng.shuffle(texts)  # unsorted input, as users have it
    return texts


def masked_mean(h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.unsqueeze(-1).to(h.dtype)
    return (h * m).sum(1) / m.sum(1).clamp_min(1)


def seed_style(model, tok, texts):
    out = []
    for t in texts:  # one at a time, padded to 512, autograd on: the code people copy from old tutorials
        enc = tok(t, padding="max_length", max_length=512, truncation=True, return_tensors="pt")
        hs = model(**enc, output_hidden_states=True).hidden_states
        out.append(masked_mean(hs[-1], enc["attention_mask"]).detach())
    return torch.cat(out).numpy()


def unsorted_batches(model, tok, texts, batch=32):
    out = []
    with torch.no_grad():
        for s in range(0, len(texts), batch):
            enc = tok(texts[s : s + batch], padding=True, truncation=True, max_length=512, return_tensors="pt")
            hs = model(**enc, output_hidden_states=True).hidden_states
            out.append(masked_mean(hs[-1], enc["attention_mask"]))
    return torch.cat(out).numpy()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", choices=["default", *SHAPES])
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--seed-texts", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma-separated contestants to skip")
    ap.add_argument("--exit-layers", default="", help="comma-separated k to time for early exit (default: all)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    with tempfile.TemporaryDirectory() as d:
        path = make_model(args.model, Path(d))
        ex = lw.Extractor(path, device="cpu")
        model, tok = ex.model, ex.tokenizer
        texts = make_texts(args.texts)
        n_tokens = sum(len(i) for i in tok(texts)["input_ids"])
        mean_len = n_tokens / len(texts)
        seed_texts = texts[: args.seed_texts]
        seed_tokens = sum(len(i) for i in tok(seed_texts)["input_ids"])
        L = ex.num_layers
        ref = ex.encode(texts, layers=-1, pool="mean")
        runs = {
            "layerwise": lambda: ex.encode(texts, layers=-1, pool="mean"),
            "unsorted": lambda: unsorted_batches(model, tok, texts),
        }
        checks = {"unsorted": unsorted_batches(model, tok, texts[:200])}
        if args.model == "default" and "sbert" not in skip:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(path, device="cpu")
            runs["sbert"] = lambda: st.encode(texts, batch_size=32, convert_to_numpy=True)
            checks["sbert"] = st.encode(texts[:200], batch_size=32, convert_to_numpy=True)
        if "onnx" not in skip:
            ex_onnx = lw.Extractor(path, device="cpu", backend="onnx", onnx_cache=Path(d) / "onnx")
            checks["onnx"] = ex_onnx.encode(texts[:200], layers=-1, pool="mean")
            runs["onnx"] = lambda: ex_onnx.encode(texts, layers=-1, pool="mean")
        exits = [int(k) for k in args.exit_layers.split(",") if k] or list(range(1, L))
        for k in exits:
            runs[f"layer {k}"] = lambda k=k: ex.encode(texts, layers=k, pool="mean")
        for name, got in checks.items():
            cos = (got * ref[:200]).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref[:200], axis=1))
            if cos.min() < 0.99999:
                sys.exit(f"{name} output differs from layerwise (min cosine {cos.min():.6f}); not timing")
        seed_check = seed_style(model, tok, seed_texts[:4])
        np.testing.assert_allclose(seed_check, ref[: len(seed_check)], atol=1e-4)
        runs = {k: v for k, v in runs.items() if k not in skip}
        gemm = gemm_flops()
        times: dict[str, list[float]] = {k: [] for k in runs}
        seed_times: list[float] = []
        for _ in range(args.repeats):
            for name, fn in runs.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
            if "seed" not in skip:
                t0 = time.perf_counter()
                seed_style(model, tok, seed_texts)
                seed_times.append(time.perf_counter() - t0)
        gemm2 = gemm_flops()
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    full = statistics.median(times["layerwise"])
    lw_tps = n_tokens / full
    cfg = ex.model.config
    print(f"{args.model}: {ex!r}; {len(texts)} texts, {n_tokens:,} tokens (mean {mean_len:.1f}); "
          f"{torch.get_num_threads()} threads; fp32 GEMM {gemm / 1e9:.0f} / {gemm2 / 1e9:.0f} GFLOP/s (before/after); "
          f"median of {args.repeats} alternating runs; peak RSS {rss:,.0f} MB\n")
    print("| contestant | median s | tokens/s | layerwise speed-up | share of GEMM limit |")
    print("|---|---|---|---|---|")
    rows = []
    if seed_times:
        med = statistics.median(seed_times)
        rows.append(
            ("seed-style (1 at a time, pad 512, autograd)", med * len(texts) / len(seed_texts), seed_tokens / med, L)
        )
    for name in runs:
        med = statistics.median(times[name])
        layers = int(name.split()[1]) if name.startswith("layer ") else L
        labels = {"layerwise": f"layerwise (layer {L} of {L})", "unsorted": "batched unsorted, hidden_states",
                  "sbert": "sentence-transformers encode", "onnx": "layerwise, backend='onnx'"}
        label = labels.get(name, f"layerwise layer {layers} of {L} (early exit)")
        rows.append((label, med, n_tokens / med, layers))
    g = max(gemm, gemm2)
    for label, med, tps, layers in rows:
        share = tps * model_flops_per_token(cfg, layers, mean_len) / g
        print(f"| {label} | {med:.2f} | {tps:,.0f} | {lw_tps / tps:.2f}x | {share:.0%} |")
    print("\nEarly exit (time for layer k / full depth vs k/L):")
    for k in range(1, L):
        if f"layer {k}" in times:
            print(f"  layer {k}: {statistics.median(times[f'layer {k}']) / full:.1%} (k/L {k / L:.1%})")


if __name__ == "__main__":
    main()
