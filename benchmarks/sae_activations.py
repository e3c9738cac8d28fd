"""Token activations for sparse-autoencoder trainers (issue 56): writing them, and reading them back shuffled.

Run: ``./dev bench sae_activations [--tokens 200000] [--layers 2,4,6] [--context 128] [--dtype bfloat16]
[--rounds 5] [--round-contexts 128] [--reader-gb 2] [--only write,read] [--no-sae-lens]``.

**Writing** (``write``). A GPT-2-small-shaped random decoder (12 layers, hidden 768, 12 heads, FFN 3,072; the embedded
model's 30,522-word WordPiece vocabulary, so it loads offline; FLOPs do not depend on the values), built once under
``$LAYERWISE_CACHE/bench/sae/gpt2-small``. The corpus is SST-2's train sentences (``../shared/data``), packed into
contexts of ``--context`` tokens. Contestants, each computing ``--layers`` of the same contexts in ``--dtype``:

* ``forward alone`` (the bound): plain transformers running the blocks up to the deepest layer asked (a GPT-2 cut
  there, the same weights), batches of the contexts layerwise packed, nothing kept;
* ``layerwise``: ``lw.extract_activations`` from the text file (reading, tokenising, packing, the forward pass,
  conversion and the sha256-sealed shards all counted; the model loaded beforehand, as for every contestant);
* ``hooks + safetensors``: the loop people write: the whole model with ``output_hidden_states=True``, the layers taken,
  cast and written with ``safetensors.torch.save_file`` one file per batch;
* ``SAELens`` (the anchor): ``CacheActivationsRunner`` on the same model (``AutoModelForCausalLM`` from the same
  directory) and the same contexts (``override_dataset``), one run per hook, as it caches one hook a run.

Each round times every contestant once on ``--round-contexts`` contexts, in turn; the ratios are of the best of
``--rounds`` rounds (the machine is shared and noisy). Then one run of each on ``--tokens`` tokens gives the headline
tokens/s. Checks: layerwise's stored values against ``output_hidden_states`` (float32: max abs diff; bfloat16: min
cosine), and the bytes on disk against tokens x layers x width x the dtype's size.

**Reading** (``read``). A ``--reader-gb`` store of random bfloat16 rows (one layer of width 768; written through the
store's own writer, no model), read back with ``token_loader`` (global shuffle on, batch 4,096) after one read has put
it in the page cache: GB/s of the stored dtype, and of float32 batches; every row once per epoch (checked by summing the
rows), the same order for the same seed.

Prints a Markdown table and writes ``benchmarks/results/sae_activations.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from benchmarks.extract_memory import REPO, shared_data

RESULTS = REPO / "benchmarks" / "results" / "sae_activations.json"
CACHE = Path(os.environ.get("LAYERWISE_CACHE", Path.home() / ".cache" / "layerwise")) / "bench" / "sae"


def build_model() -> Path:
    """The GPT-2-small-shaped random decoder (module docstring), built once (a marker written last)."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    import layerwise as lw

    path = CACHE / "gpt2-small"
    if (path / ".done").exists():
        return path
    shutil.rmtree(path, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(lw.default_model_path())
    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_inner=3072, vocab_size=len(tok), n_positions=1024,
                     bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    GPT2LMHeadModel(cfg).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    (path / ".done").write_text("ok")
    return path


def corpus(tmp: Path) -> Path:
    """SST-2's train sentences, one a line."""
    lines = (shared_data() / "sst2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:]
    out = tmp / "sst2-train.txt"
    out.write_text("\n".join(line.split("\t")[0] for line in lines) + "\n", encoding="utf-8")
    return out


def contexts_of(path: Path, text: Path, size: int, n: int) -> np.ndarray:
    """The first ``n`` contexts layerwise packs from ``text`` (for the contestants that take token ids)."""
    from transformers import AutoTokenizer

    from layerwise.encoding.contexts import ContextPacker, special_ids

    tok = AutoTokenizer.from_pretrained(path)
    bos, sep, _ = special_ids(tok)
    packer = ContextPacker(size, bos, sep)
    out: list[np.ndarray] = []
    with open(text, encoding="utf-8") as fh:
        for line, record in enumerate(fh, start=1):
            ids = tok(record.rstrip("\n"), add_special_tokens=False)["input_ids"]
            out += [c for c, _ in packer.feed(ids, line)]
            if len(out) >= n:
                return np.stack(out[:n])
    raise SystemExit(f"the corpus packs into {len(out)} contexts of {size}, fewer than {n}")


class Contestants:
    """Each contestant: ``run(n_contexts) -> seconds`` over the same first contexts."""

    def __init__(self, model_dir: Path, text: Path, layers: list[int], size: int, dtype: str, batch: int,
                 tmp: Path, contexts: np.ndarray, sae_lens: bool):
        from transformers import GPT2Config, GPT2Model

        import layerwise as lw

        self.model_dir, self.text, self.layers, self.size, self.dtype = model_dir, text, layers, size, dtype
        self.batch, self.tmp, self.contexts = batch, tmp, contexts
        self.ex = lw.Extractor(str(model_dir))
        self.full = GPT2Model.from_pretrained(model_dir).eval()
        cut = GPT2Config.from_pretrained(model_dir)
        cut.n_layer = max(layers)
        self.cut = GPT2Model.from_pretrained(model_dir, config=cut).eval()
        self.sae_lens = sae_lens
        self.torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]

    def batches(self, n: int):
        for lo in range(0, n, self.batch):
            yield torch.from_numpy(self.contexts[lo : min(n, lo + self.batch)].astype(np.int64))

    def bound(self, n: int) -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for ids in self.batches(n):
                self.cut(input_ids=ids)
        return time.perf_counter() - t0

    def layerwise(self, n: int, out: Path | None = None) -> float:
        import layerwise as lw

        out = out or self.tmp / "lw"
        shutil.rmtree(out, ignore_errors=True)
        t0 = time.perf_counter()
        lw.extract_activations(self.text, out, layers=self.layers, context_size=self.size, dtype=self.dtype,
                               model=self.ex, max_contexts=n, progress=False)
        took = time.perf_counter() - t0
        return took

    def hooks(self, n: int) -> float:
        from safetensors.torch import save_file

        out = self.tmp / "hooks"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        t0 = time.perf_counter()
        with torch.inference_mode():
            for i, ids in enumerate(self.batches(n)):
                hs = self.full(input_ids=ids, output_hidden_states=True).hidden_states
                save_file({f"layer.{k}": hs[k].reshape(-1, hs[k].shape[-1]).to(self.torch_dtype).contiguous()
                           for k in self.layers} | {"token_ids": ids.to(torch.int32)},
                          str(out / f"{i:06d}.safetensors"))
        return time.perf_counter() - t0

    def sae_lens_runs(self, n: int) -> float:
        import datasets
        from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

        datasets.disable_progress_bars()
        tokens = datasets.Dataset.from_dict({"input_ids": self.contexts[:n].tolist()})
        total = 0.0
        for k in self.layers:
            out = self.tmp / f"sae-lens-{k}"
            shutil.rmtree(out, ignore_errors=True)
            cfg = CacheActivationsRunnerConfig(
                dataset_path="unused", model_name=str(self.model_dir), model_class_name="AutoModelForCausalLM",
                hook_name=f"transformer.h.{k - 1}", d_in=768, context_size=self.size, training_tokens=n * self.size,
                model_batch_size=self.batch,
                buffer_size_gb=min(n, 32 * self.batch) * self.size * 768 * 4 / 1e9 + 1e-6,
                new_cached_activations_path=str(out), dtype="float32" if self.dtype == "bfloat16" else self.dtype,
                device="cpu", shuffle=False, prepend_bos=False, streaming=False)
            t0 = time.perf_counter()
            CacheActivationsRunner(cfg, override_dataset=tokens).run()
            total += time.perf_counter() - t0
        return total

    def all(self) -> dict[str, Callable[[int], float]]:
        out: dict[str, Callable[[int], float]] = {"forward alone": self.bound, "layerwise": self.layerwise,
                                                  "hooks + safetensors": self.hooks}
        if self.sae_lens:
            out["SAELens"] = self.sae_lens_runs
        return out


def check_values(c: Contestants, out: Path) -> dict[str, Any]:
    """layerwise's store against ``output_hidden_states`` on its first 16 contexts."""
    from layerwise.store.activations import ActivationStore

    acts = ActivationStore(out)
    ids = torch.from_numpy(acts.token_ids()[:16].astype(np.int64))
    with torch.inference_mode():
        hs = c.full(input_ids=ids, output_hidden_states=True).hidden_states
    worst_cos, worst_abs = 1.0, 0.0
    for k in c.layers:
        ref = hs[k].reshape(-1, hs[k].shape[-1]).float().numpy()
        got = acts.to_numpy(k)[: len(ref)]
        cos = (ref * got).sum(-1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(got, axis=-1)
        worst_cos = min(worst_cos, float(cos.min()))
        worst_abs = max(worst_abs, float(np.abs(ref - got).max()))
    data = acts.num_tokens * len(acts.layers) * acts.width * {"float32": 4, "float16": 2, "bfloat16": 2,
                                                                 "float8": 1}[acts.dtype]
    ids_bytes = acts.num_tokens * 4
    return {"min_cosine": worst_cos, "max_abs_diff": worst_abs, "bytes_on_disk": acts.nbytes,
            "values_bytes": data, "token_id_bytes": ids_bytes, "header_bytes": acts.nbytes - data - ids_bytes,
            "manifest_bytes": (out / "manifest.json").stat().st_size, "runtime": acts.manifest["runtime"]["name"]}


def write_bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    layers = [int(k) for k in args.layers.split(",")]
    model_dir = build_model()
    text = corpus(tmp)
    n_full = -(-args.tokens // args.context)
    contexts = contexts_of(model_dir, text, args.context, max(n_full, args.round_contexts))
    c = Contestants(model_dir, text, layers, args.context, args.dtype, args.batch, tmp, contexts, not args.no_sae_lens)
    runs = c.all()
    rounds: dict[str, list[float]] = {name: [] for name in runs}
    c.layerwise(8)  # warm every path once
    c.bound(8)
    for r in range(args.rounds):
        for name, run in runs.items():
            rounds[name].append(run(args.round_contexts))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v[-1]:.1f}s" for n, v in rounds.items()), flush=True)
    best = {name: min(v) for name, v in rounds.items()}
    tokens_round = args.round_contexts * args.context
    full: dict[str, float] = {}
    for name, run in runs.items():
        full[name] = run(n_full)
        print(f"{name}: {n_full * args.context:,} tokens in {full[name]:.1f}s", flush=True)
    out = tmp / "lw-full"
    c.layerwise(n_full, out)
    checks = check_values(c, out)
    return {
        "layers": layers, "context": args.context, "dtype": args.dtype, "batch_contexts": args.batch,
        "round_tokens": tokens_round, "rounds": rounds,
        "best_tokens_per_s": {n: tokens_round / s for n, s in best.items()},
        "ratio_to_bound": best["forward alone"] / best["layerwise"],
        "ratio_to_hooks": best["hooks + safetensors"] / best["layerwise"],
        "ratio_to_sae_lens": (best["SAELens"] / best["layerwise"]) if "SAELens" in best else None,
        "full_tokens": n_full * args.context,
        "full_tokens_per_s": {n: n_full * args.context / s for n, s in full.items()},
        "checks": checks,
    }


def read_bench(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A ``--reader-gb`` random bfloat16 store read back shuffled (module docstring)."""
    from layerwise.encoding.contexts import ContextSpec
    from layerwise.store.activations import ActivationStore, ActivationWriter

    width, layers, size = 768, (1,), 128  # one layer of --reader-gb: what a trainer reads is that layer
    per_shard = 1024  # contexts: 1,024 x 128 x 768 x 2 bytes = 201 MB a shard
    total = int(args.reader_gb * 1e9)
    shards = max(1, -(-total // (per_shard * size * width * 2 * len(layers))))  # at least --reader-gb
    spec = ContextSpec(layers=layers, context_size=size, dtype="bfloat16")
    header = {"spec": spec.to_dict(), "model": {"name": "random", "fingerprint": "0"}, "model_options": {},
              "runtime": {"name": "none"}, "tokenizer": {"special_ids": [0]}, "input": {"path": None}, "width": width}
    path = tmp / "reader-store"
    writer = ActivationWriter(path, header)
    writer.open()
    rng = np.random.default_rng(0)
    rows = per_shard * size
    for s in range(shards):
        ids = rng.integers(1, 30000, size=(per_shard, size), dtype=np.int32)
        values = {k: torch.randn(rows, width).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                  for k in layers}
        writer.write_shard(ids, values, {}, consumed=(s + 1) * rows, first_line=1, last_line=1, runtime="none")
    writer.write_manifest("complete", {})
    writer.close()
    acts = ActivationStore(path)
    layer_bytes = acts.num_tokens * width * 2
    for f in path.glob("shard-*"):  # into the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    out: dict[str, Any] = {"store_bytes": acts.nbytes, "layer_bytes": layer_bytes, "tokens": acts.num_tokens,
                           "threads": torch.get_num_threads()}
    for dtype in ("stored", "float32"):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            n = 0
            for batch in acts.token_loader(layer=1, batch_size=4096, seed=0, dtype=dtype):
                n += batch.shape[0]
            best = min(best, time.perf_counter() - t0)
        assert n == acts.num_tokens
        out[f"gb_per_s_{dtype}"] = layer_bytes / best / 1e9
        out[f"seconds_{dtype}"] = best
    # every row once: the sum of every row read equals the sum of the layer
    want = sum(float(torch.from_numpy(np.array(v).view(np.int16)).view(torch.bfloat16).double().sum())
               for v, _ in acts.layer_arrays(1))
    got = sum(float(b.double().sum()) for b in acts.token_loader(layer=1, batch_size=4096, seed=0))
    first = [next(iter(acts.token_loader(layer=1, batch_size=4096, seed=s))) for s in (0, 0, 1)]
    out.update(every_row_once=abs(want - got) <= 1e-6 * max(1.0, abs(want)),
               same_seed_same_batch=bool(torch.equal(first[0], first[1])),
               other_seed_other_batch=not bool(torch.equal(first[0], first[2])))
    shutil.rmtree(path)
    return out


def machine() -> str:
    from layerwise.model.hardware import cpu_model

    return f"{cpu_model()}, {os.cpu_count()} cores"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--layers", default="2,4,6")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8, help="contexts a forward batch (layerwise: its batch_tokens)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--round-contexts", type=int, default=128)
    p.add_argument("--reader-gb", type=float, default=2.0)
    p.add_argument("--only", default="write,read")
    p.add_argument("--no-sae-lens", action="store_true")
    args = p.parse_args(argv)
    only = set(args.only.split(","))
    results: dict[str, Any] = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    stamp = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "platform": platform.platform(),
             "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="sae-bench-") as tmp:
        if "write" in only:
            results["write"] = {**stamp, **write_bench(args, Path(tmp))}
            w = results["write"]
            print(f"\n| contestant | tokens/s (best of {args.rounds}, {w['round_tokens']:,} tokens) | tokens/s "
                  f"({w['full_tokens']:,} tokens) |\n|---|---|---|")
            for name, rate in w["best_tokens_per_s"].items():
                print(f"| {name} | {rate:,.0f} | {w['full_tokens_per_s'][name]:,.0f} |")
            print(f"\nlayerwise / bound {w['ratio_to_bound']:.2f}x (target >= 0.9), / hooks "
                  f"{w['ratio_to_hooks']:.2f}x, / SAELens {w['ratio_to_sae_lens'] or 0:.2f}x (target >= 1.5); "
                  f"checks {w['checks']}")
        if "read" in only:
            results["read"] = {**stamp, **read_bench(args, Path(tmp))}
            r = results["read"]
            print(f"\nreader: {r['layer_bytes'] / 1e9:.2f} GB layer, shuffled: {r['gb_per_s_stored']:.2f} GB/s stored "
                  f"(target >= 1), {r['gb_per_s_float32']:.2f} GB/s as float32; every row once "
                  f"{r['every_row_once']}, same seed same batch {r['same_seed_same_batch']}")
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
