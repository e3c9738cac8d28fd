"""Speed and fidelity of layer features: layerwise's paths against the fastest peers, side by side in one run.

Run: ``./dev bench run [--model default|bert-base-shape|minilm-shape] [--texts 2000] [--repeats 5] [--no-side]
[--doc-tokens 512] [--exit-layers 2,4]``. ``--doc-tokens N`` times ``--texts`` documents of about N tokens each
(consecutive corpus sentences joined) instead of sentences: where attention's share of the work grows.

Contestants (mean-pooled last layer; every output is compared with the float32 PyTorch reference before timing):

* ``layerwise auto``   ``Extractor()``: the default backend (the faster exact runtime, timed)
* ``layerwise torch``  ``Extractor(backend="torch")``: PyTorch float32 (the reference, = transformers)
* ``layerwise bf16``   ``Extractor(compute_dtype="bfloat16")``, only on a CPU with AVX-512 BF16 or AMX
* ``layerwise int8``   ``Extractor(quantize="int8")``: int8 weights on OpenVINO where the extra is installed, else
  dynamic int8 through ONNX Runtime
* ``layerwise int8 onnx``  ``Extractor(backend="onnx", quantize="int8")``: ONNX Runtime's dynamic int8
* ``layerwise int8-full``  ``Extractor(quantize="int8-full")``: int8 weights and activations on OpenVINO, calibrated
  on the bundled sample (needs the ``[openvino]`` extra)
* ``layerwise openvino``, ``layerwise openvino bf16``: ``Extractor(backend="openvino")`` float32, and with
  ``compute_dtype="bfloat16"`` (OpenVINO's bf16 hint), where the ``[openvino]`` extra is installed
* ``raw onnxruntime``, ``raw openvino``, ``raw openvino bf16``: the runtimes called directly on the same graphs, as a
  user would write it: batches of 32 sorted by length, tokenised in the loop, the last hidden state mean-pooled with
  its mask in numpy; OpenVINO with the throughput hint and an ``AsyncInferQueue`` (one request per stream) that
  overlaps tokenising with inference. The default must be within 5% of the fastest exact one
* ``st torch``         sentence-transformers ``encode`` (batch 32, its own length sorting), this environment
* ``st onnx``, ``st onnx-O3``, ``st int8``: sentence-transformers' ONNX backends (optimum export, O3 graph
  optimisation, dynamic int8 for this CPU), and ``st openvino``, ``st openvino-int8``: its OpenVINO backend
  (optimum-intel export run with an explicit f32 precision hint; NNCF static int8 calibrated on the texts), run in a
  side environment (``benchmarks/st_side.py``: optimum needs transformers 4) by a worker that times its own
  ``encode``; ``--no-side`` leaves them out
* ``batched unsorted``  the hand-written loop: batches of 32 in input order, ``output_hidden_states=True``
* ``seed-style``       one sentence at a time padded to 512 with autograd on (timed on a few texts: very slow)

Each repeat times every contestant once, in turn (the machine is shared and noisy); the table gives the best of the
repeats. Columns: tokens/s, how many times faster the default is, the share of the machine's limit for the
contestant's precision (``benchmarks/limits.py``: the best matrix-product rate of torch and ONNX Runtime on the
encoder's own shapes; model FLOPs per token x tokens/s / limit; never above 100% unless the limit is wrong, which
is then said), and fidelity against the float32 reference: the minimum cosine and the largest absolute difference
of the unit-normalised vectors (sentence-transformers normalises its output; "exact" is <= 1e-5).

Then, on real sentences (SST-2 dev), the per-layer fidelity of bf16 and int8 (every layer mean-pooled: minimum
cosine and largest absolute difference to float32), and the first-use ONNX export time. Random-weight models of
real shapes are fine for speed (FLOPs do not depend on weights); fidelity needs the real ``default`` model.
Writes ``benchmarks/results/run.json``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import layerwise as lw
from benchmarks import limits
from layerwise.model.hardware import cpu_flags, native_on_cpu

SETTLE = 0.5  # seconds of rest before each timed run: spinning worker threads of the last contestant wind down
SHAPES = {
    "bert-base-shape": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072),
    "minilm-shape": dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536),
}
EXACT = 1e-5  # largest absolute difference of unit vectors that counts as the same output
RESULTS = Path(__file__).parent / "results" / "run.json"


def model_flops_per_token(cfg, layers: int, mean_len: float) -> float:
    """Forward FLOPs per token through ``layers`` encoder layers (projections, FFN, attention scores)."""
    d, ff = cfg.hidden_size, cfg.intermediate_size
    return layers * (2 * (4 * d * d + 2 * d * ff) + 4 * mean_len * d)


def make_model(name: str, tmp: Path) -> str:
    if name == "default":
        return lw.default_model_path()
    from transformers import AutoTokenizer, BertConfig, BertModel

    cfg = BertConfig(vocab_size=30522, max_position_embeddings=512, **SHAPES[name])
    torch.manual_seed(0)
    model = BertModel(cfg).eval()
    path = tmp / name
    model.save_pretrained(path, safe_serialization=True)
    AutoTokenizer.from_pretrained(lw.default_model_path()).save_pretrained(path)  # uncased WordPiece, 30522 ids
    return str(path)


def make_texts(n: int) -> list[str]:
    from benchmarks.extract_memory import corpus_texts

    texts, _ = corpus_texts(n)
    rng = random.Random(0)
    rng.shuffle(texts)  # unsorted input, as users have it
    return texts


def make_documents(n: int, tokenizer, tokens: int = 512) -> list[str]:
    """``n`` documents of consecutive corpus sentences joined until the next would pass ``tokens`` tokens (special
    tokens included): the long-input workload, where attention's share of the work grows with the length."""
    sentences = make_texts(n * tokens // 8)
    lengths = [len(ids) - 2 for ids in tokenizer(sentences, add_special_tokens=True)["input_ids"]]
    docs, current, used = [], [], 2
    for sentence, length in zip(sentences, lengths):
        if used + length > tokens and current:
            docs.append(" ".join(current))
            current, used = [], 2
            if len(docs) == n:
                break
        current.append(sentence)
        used += length
    return docs


def dev_sentences() -> list[str]:
    """SST-2 dev sentences (real, whole sentences) for the per-layer fidelity; generated ones when absent."""
    from benchmarks.extract_memory import shared_data

    path = shared_data() / "sst2" / "dev.tsv"
    if path.is_file():
        return [ln.split("\t")[0] for ln in path.read_text(encoding="utf-8").splitlines()[1:] if ln.strip()]
    return make_texts(872)


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


def unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def fidelity(got: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    """(minimum cosine, largest absolute difference of the unit vectors) over rows."""
    a, b = unit(got), unit(ref)
    return float((a * b).sum(-1).min()), float(np.abs(a - b).max())


def per_layer(ex: lw.Extractor, ref: lw.Extractor, texts: list[str]) -> list[dict]:
    """Every layer mean-pooled: min cosine and max abs difference (raw values) to ``ref``."""
    got = ex.encode(texts, layers="all", combine="stack", pool="mean")  # [n, K, D]
    want = ref.encode(texts, layers="all", combine="stack", pool="mean")
    rows = []
    for k in range(want.shape[1]):
        cos, _ = fidelity(got[:, k], want[:, k])
        rows.append({"layer": k, "min_cosine": cos, "max_abs": float(np.abs(got[:, k] - want[:, k]).max())})
    return rows


class Contestant:
    """A timed callable: ``run() -> (seconds, [n, D] embeddings)``, with its precision and a label."""

    def __init__(self, label: str, precision: str, run: Callable[[], tuple[float, np.ndarray]], layers: int):
        self.label, self.precision, self.run, self.layers = label, precision, run, layers
        self.times: list[float] = []
        self.output: np.ndarray | None = None


def timed(fn: Callable[[], np.ndarray]) -> Callable[[], tuple[float, np.ndarray]]:
    def run() -> tuple[float, np.ndarray]:
        t0 = time.perf_counter()
        out = fn()
        return time.perf_counter() - t0, np.asarray(out)

    return run


def sorted_batches(tok, texts: list[str], batch: int = 32):
    """``(indices, numpy encodings)`` of batches of ``batch`` texts sorted by length (longest first)."""
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        enc = tok([texts[i] for i in idx], padding=True, return_tensors="np")
        yield idx, enc["input_ids"].astype(np.int64), enc["attention_mask"].astype(np.int64)


def np_mean(h: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    return (h * m).sum(1) / np.maximum(m.sum(1), 1e-9)


def raw_onnxruntime(graph: Path, tok, texts: list[str], threads: int, depth: int) -> Callable[[], np.ndarray]:
    """ONNX Runtime called directly on layerwise's export (all optimisations), the last state mean-pooled."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(str(graph), opts, providers=["CPUExecutionProvider"])

    def run() -> np.ndarray:
        out: np.ndarray | None = None
        for idx, ids, mask in sorted_batches(tok, texts):
            (h,) = session.run([f"hidden_{depth}"], {"input_ids": ids, "attention_mask": mask})
            if out is None:
                out = np.empty((len(texts), h.shape[-1]), np.float32)
            out[idx] = np_mean(h, mask)
        assert out is not None
        return out

    return run


def raw_openvino(ir: Path, tok, texts: list[str], threads: int, depth: int, hint: str) -> Callable[[], np.ndarray]:
    """OpenVINO called directly on layerwise's IR: throughput hint, ``hint`` precision, an async infer queue."""
    import openvino as ov

    compiled = ov.Core().compile_model(str(ir), "CPU", {"PERFORMANCE_HINT": "THROUGHPUT",
                                                         "INFERENCE_PRECISION_HINT": hint,
                                                         "INFERENCE_NUM_THREADS": threads})
    queue = ov.AsyncInferQueue(compiled, int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")))
    width = compiled.output(f"hidden_{depth}").get_partial_shape()[2].get_length()

    def run() -> np.ndarray:
        out = np.empty((len(texts), width), np.float32)

        def done(request, userdata) -> None:
            idx, mask = userdata
            out[idx] = np_mean(request.get_tensor(f"hidden_{depth}").data, mask)

        queue.set_callback(done)
        for idx, ids, mask in sorted_batches(tok, texts):
            queue.start_async({"input_ids": ids, "attention_mask": mask}, (idx, mask))
        queue.wait_all()
        return out

    return run


def first_use_export(path: str, tmp: Path) -> dict[str, float]:
    """Seconds of the first call with an empty cache (export + check) and of the same call afterwards."""
    cache = tmp / "first-use"
    t0 = time.perf_counter()
    ex = lw.Extractor(path, device="cpu", onnx_cache=cache)
    load = time.perf_counter() - t0
    t0 = time.perf_counter()
    ex.encode(["warm up"], layers=-1)  # PyTorch serves it while the runtimes are prepared in the background
    first = time.perf_counter() - t0
    ex.backend.settle()
    t0 = time.perf_counter()
    lw.Extractor(path, device="cpu", onnx_cache=cache).encode(["warm up"], layers=-1)
    again = time.perf_counter() - t0
    exported = ex.backend.onnx.export_seconds if getattr(ex.backend, "onnx", None) else {}
    return {"load_s": load, "first_call_s": first, "export_s": sum(exported.values()), "cached_load_and_call_s": again}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", choices=["default", *SHAPES])
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--seed-texts", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip", default="", help="comma-separated contestants to skip (auto, torch, bf16, int8, "
                                                "int8-onnx, int8-full, openvino, openvino-bf16, raw-ort, raw-ov, "
                                                "raw-ov-bf16, st-torch, st-onnx, st-onnx-O3, st-int8, st-openvino, "
                                                "st-openvino-int8, unsorted, seed)")
    ap.add_argument("--no-side", action="store_true",
                    help="leave out sentence-transformers' ONNX and OpenVINO backends")
    ap.add_argument("--doc-tokens", type=int, default=0, help="time --texts documents of about this many tokens "
                                                                "each (e.g. 512) instead of sentences")
    ap.add_argument("--exit-layers", default="", help="comma-separated k to time for early exit (default: none)")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    if args.no_side:
        skip |= {"st-onnx", "st-onnx-O3", "st-int8", "st-openvino", "st-openvino-int8"}
    threads = torch.get_num_threads()
    bf16_ok = native_on_cpu(torch.bfloat16)
    if not bf16_ok:
        skip.add("bf16")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = make_model(args.model, tmp)
        cache = tmp / "onnx"
        ref = lw.Extractor(path, device="cpu", backend="torch")
        model, tok = ref.model, ref.tokenizer
        texts = make_documents(args.texts, tok, args.doc_tokens) if args.doc_tokens else make_texts(args.texts)
        n_tokens = sum(len(i) for i in tok(texts)["input_ids"])
        mean_len = n_tokens / len(texts)
        L = ref.num_layers
        cfg = ref.model.config
        variants = {"auto": lw.Extractor(path, device="cpu", onnx_cache=cache),
                    "int8": lw.Extractor(path, device="cpu", onnx_cache=cache, quantize="int8"),
                    "int8-onnx": lw.Extractor(path, device="cpu", onnx_cache=cache, quantize="int8", backend="onnx")}
        if importlib.util.find_spec("nncf") is not None and "int8-full" not in skip:
            variants["int8-full"] = lw.Extractor(path, device="cpu", onnx_cache=cache, quantize="int8-full")
        if "bf16" not in skip:
            variants["bf16"] = lw.Extractor(path, device="cpu", compute_dtype="bfloat16")
        has_openvino = importlib.util.find_spec("openvino") is not None
        if has_openvino:
            variants["openvino"] = lw.Extractor(path, device="cpu", onnx_cache=cache, backend="openvino")
            if bf16_ok:
                variants["openvino-bf16"] = lw.Extractor(path, device="cpu", onnx_cache=cache, backend="openvino",
                                                         compute_dtype="bfloat16")
        for ex in variants.values():
            ex.encode(texts[:8], layers=-1)  # exports (and the exactness check) happen here, outside the timing
            if hasattr(ex.backend, "settle"):
                ex.backend.settle()  # auto prepares its runtimes in the background: the steady state is timed
        contestants: dict[str, Contestant] = {
            "auto": Contestant("layerwise, default (auto)", "float32",
                               timed(lambda: variants["auto"].encode(texts, layers=-1, pool="mean")), L),
            "torch": Contestant("layerwise, backend='torch'", "float32",
                                timed(lambda: ref.encode(texts, layers=-1, pool="mean")), L),
            "int8": Contestant(f"layerwise, quantize='int8' ({variants['int8'].backend.precision})", "int8",
                               timed(lambda: variants["int8"].encode(texts, layers=-1, pool="mean")), L),
            "int8-onnx": Contestant("layerwise, backend='onnx', quantize='int8' (dynamic)", "int8",
                                    timed(lambda: variants["int8-onnx"].encode(texts, layers=-1, pool="mean")), L),
        }
        if "int8-full" in variants:
            contestants["int8-full"] = Contestant(
                "layerwise, quantize='int8-full' (OpenVINO, calibrated)", "int8",
                timed(lambda: variants["int8-full"].encode(texts, layers=-1, pool="mean")), L)
        if "bf16" in variants:
            contestants["bf16"] = Contestant("layerwise, compute_dtype='bfloat16'", "bfloat16",
                                             timed(lambda: variants["bf16"].encode(texts, layers=-1, pool="mean")), L)
        for key, label, precision in (("openvino", "layerwise, backend='openvino'", "float32"),
                                      ("openvino-bf16", "layerwise, backend='openvino', bfloat16", "bfloat16")):
            if key in variants:
                contestants[key] = Contestant(
                    label, precision, timed(lambda key=key: variants[key].encode(texts, layers=-1, pool="mean")), L)
        graph = variants["auto"].backend.onnx.path_for(variants["auto"].backend.onnx.depth_for([L]))
        variants["auto"].backend.onnx.build(L)
        contestants["raw-ort"] = Contestant("raw ONNX Runtime (all optimisations)", "float32",
                                            timed(raw_onnxruntime(graph, tok, texts, threads, L)), L)
        if has_openvino:
            ir = variants["openvino"].backend.build(L)
            contestants["raw-ov"] = Contestant("raw OpenVINO, THROUGHPUT, async queue", "float32",
                                               timed(raw_openvino(ir, tok, texts, threads, L, "f32")), L)
            if bf16_ok:
                contestants["raw-ov-bf16"] = Contestant("raw OpenVINO, bf16 hint, THROUGHPUT, async queue",
                                                        "bfloat16",
                                                        timed(raw_openvino(ir, tok, texts, threads, L, "bf16")), L)
        if args.model == "default" and "st-torch" not in skip:
            from sentence_transformers import SentenceTransformer

            st = SentenceTransformer(path, device="cpu")
            contestants["st-torch"] = Contestant(
                "sentence-transformers encode (torch)", "float32",
                timed(lambda: st.encode(texts, batch_size=32, convert_to_numpy=True)), L)
        contestants["unsorted"] = Contestant("batched unsorted, hidden_states", "float32",
                                             timed(lambda: unsorted_batches(model, tok, texts)), L)
        exits = [int(k) for k in args.exit_layers.split(",") if k]
        for k in exits:
            contestants[f"layer {k}"] = Contestant(
                f"layerwise auto, layer {k} of {L} (early exit)", "float32",
                timed(lambda k=k: variants["auto"].encode(texts, layers=k, pool="mean")), k)
        side = None
        side_names = [n for n in ("st-onnx", "st-onnx-O3", "st-int8", "st-openvino", "st-openvino-int8")
                      if n not in skip]
        side_facts: dict = {}
        if args.model == "default" and side_names:
            from benchmarks.st_side import SideST

            side = SideST(path, threads, tmp / "side").__enter__()
            side_facts = side.prepare(texts)
            labels = {"st-onnx": ("sentence-transformers backend='onnx'", "float32"),
                      "st-onnx-O3": ("sentence-transformers ONNX O3", "float32"),
                      "st-int8": ("sentence-transformers int8 (dynamic)", "int8"),
                      "st-openvino": ("sentence-transformers backend='openvino'", "float32"),
                      "st-openvino-int8": ("sentence-transformers OpenVINO int8 (static, calibrated)", "int8")}
            for name in side_names:
                if name in side.names:
                    contestants[name] = Contestant(labels[name][0], labels[name][1],
                                                   lambda name=name: side.encode(name, batch_size=32), L)
                else:
                    print(f"{name}: not run ({side_facts.get(name, {}).get('error', 'failed')})", file=sys.stderr)
        contestants = {k: c for k, c in contestants.items() if k not in skip}
        try:
            want = ref.encode(texts, layers=-1, pool="mean")
            seed_texts = texts[: args.seed_texts]
            seed_tokens = sum(len(i) for i in tok(seed_texts)["input_ids"])
            np.testing.assert_allclose(seed_style(model, tok, seed_texts[:4]), want[:4], atol=1e-4)
            limit = limits.measure(cfg.hidden_size, cfg.intermediate_size, bf16=bf16_ok)
            seed_times: list[float] = []
            for _ in range(args.repeats):
                for c in contestants.values():
                    time.sleep(SETTLE)  # the previous contestant's idle threads (here or in the side process) stop
                    seconds, out = c.run()
                    c.times.append(seconds)
                    if c.output is None:
                        c.output = out
                if "seed" not in skip:
                    t0 = time.perf_counter()
                    seed_style(model, tok, seed_texts)
                    seed_times.append(time.perf_counter() - t0)
            limit_after = limits.measure(cfg.hidden_size, cfg.intermediate_size, bf16=bf16_ok)
            chosen = variants["auto"].backend.runtime()
            layer_rows = {}
            first_use = first_use_export(path, tmp) if "auto" in contestants else {}
            if args.model == "default":
                dev = dev_sentences()
                layer_rows = {name: per_layer(ex, ref, dev) for name, ex in variants.items() if name != "auto"}
                layer_rows["auto"] = per_layer(variants["auto"], ref, dev)
        finally:
            if side is not None:
                side.close()
    for name in list(limit):  # the better of the two measurements
        if limit_after[name]["flops"] > limit[name]["flops"]:
            limit[name] = limit_after[name]
    report(args, contestants, limit, n_tokens, mean_len, len(texts), cfg, want, seed_times, seed_tokens,
           layer_rows, first_use, side_facts, threads, chosen)


def report(args, contestants, limit, n_tokens, mean_len, n_texts, cfg, want, seed_times, seed_tokens, layer_rows,
           first_use, side_facts, threads, chosen) -> None:
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"})
    print(f"{args.model}: {n_texts} texts, {n_tokens:,} tokens (mean {mean_len:.1f}); {platform.processor() or ''} "
          f"{threads} threads; CPU flags {', '.join(flags)}; best of {args.repeats} alternating runs\n")
    print("Limits (best matrix-product rate on the encoder's shapes): " + "; ".join(
        f"{p} {r['flops'] / 1e9:.0f} GFLOP/s ({r['by']})" for p, r in limit.items()) + "\n")
    best = {k: min(c.times) for k, c in contestants.items()}
    base = best.get("auto")
    rows = []
    print("| contestant | precision | best s | tokens/s | default is faster by | share of limit | min cosine | "
          "max abs (unit) |")
    print("|---|---|---|---|---|---|---|---|")
    if seed_times:
        s = min(seed_times)
        speedup = (n_tokens / base) / (seed_tokens / s) if base else float("nan")
        print(f"| seed-style (1 at a time, pad 512, autograd) | float32 | {s * n_texts / args.seed_texts:.1f} "
              f"(est.) | {seed_tokens / s:,.0f} | {speedup:.1f}x | | | |")
    over = []
    for key, c in contestants.items():
        tps = n_tokens / best[key]
        lim = limit.get(c.precision, limit["float32"])["flops"]
        share = tps * model_flops_per_token(cfg, c.layers, mean_len) / lim
        if share > 1:
            over.append(f"{c.label}: {share:.0%}")
        cos, diff = fidelity(c.output, want)
        ratio = (n_tokens / base) / tps if base else float("nan")
        rows.append({"key": key, "label": c.label, "precision": c.precision, "best_s": best[key], "times": c.times,
                     "tokens_per_s": tps, "default_speedup": ratio, "share_of_limit": share, "min_cosine": cos,
                     "max_abs_unit": diff})
        print(f"| {c.label} | {c.precision} | {best[key]:.2f} | {tps:,.0f} | {ratio:.2f}x | {share:.0%} | "
              f"{cos:.6f} | {diff:.1e} |")
    if over:
        print(f"\nLIMIT WRONG: a share above 100% ({'; '.join(over)}): the measured limit is not the real one")
    by = {r["key"]: r for r in rows}
    print("\nAcceptance (issues 16 and 28):")
    exact_st = [r for k, r in by.items() if k.startswith("st-") and r["max_abs_unit"] <= EXACT]
    if exact_st and "auto" in by:
        fastest = max(exact_st, key=lambda r: r["tokens_per_s"])
        print(f"  default vs the fastest exact sentence-transformers backend ({fastest['label']}): "
              f"{by['auto']['tokens_per_s'] / fastest['tokens_per_s']:.2f}x (target >= 1.3x)")
    raw_exact = [r for k, r in by.items() if k.startswith("raw-") and r["max_abs_unit"] <= EXACT]
    if raw_exact and "auto" in by:
        fastest = max(raw_exact, key=lambda r: r["tokens_per_s"])
        ratio = by["auto"]["tokens_per_s"] / fastest["tokens_per_s"]
        print(f"  default vs the fastest exact raw runtime ({fastest['label']}): {ratio:.2f}x its speed "
              f"(target >= 0.95x); the runtime auto chose: {chosen}")
    targets = (("bf16", 2.0), ("openvino-bf16", 1.8), ("int8", 2.2), ("int8-onnx", 2.2), ("int8-full", 2.8))
    for key, target in targets:
        if key in by:
            vs = {ref_key: by[key]["tokens_per_s"] / by[ref_key]["tokens_per_s"] for ref_key in ("torch", "auto")
                  if ref_key in by}
            layers = layer_rows.get(key, [])
            worst = min((r["min_cosine"] for r in layers), default=float("nan"))
            last = layers[-1]["min_cosine"] if layers else float("nan")
            print(f"  {key}: {vs.get('torch', float('nan')):.2f}x PyTorch float32, {vs.get('auto', float('nan')):.2f}x "
                  f"the default (target >= {target}x float32); per-layer min cosine {worst:.5f}, last layer "
                  f"{last:.5f} (targets: bf16 >= 0.9995 every layer, int8 >= 0.99 last layer)")
    if layer_rows:
        names = list(layer_rows)
        print("\nPer-layer fidelity on SST-2 dev sentences (mean-pooled; min cosine / max abs to PyTorch float32):\n")
        print("| layer | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        for k in range(len(layer_rows[names[0]])):
            cells = [f"{layer_rows[n][k]['min_cosine']:.6f} / {layer_rows[n][k]['max_abs']:.1e}" for n in names]
            print(f"| {k} | " + " | ".join(cells) + " |")
    if first_use:
        print(f"\nFirst use of the default backend with an empty cache: load {first_use['load_s']:.1f} s, first call "
              f"{first_use['first_call_s']:.1f} s (export {first_use['export_s']:.1f} s + exactness check); a new "
              f"process with the cache: load + call {first_use['cached_load_and_call_s']:.1f} s")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "model": args.model, "texts": n_texts, "tokens": n_tokens,
        "threads": threads, "cpu_flags": flags, "limits": limit, "rows": rows, "per_layer": layer_rows,
        "first_use": first_use, "side": side_facts, "auto_runtime": chosen,
    }, indent=1, default=str))


if __name__ == "__main__":
    main()
