"""Any architecture: what discovery costs at load, and what early exit and layer capture give on a decoder.

Run: ``./dev bench any_architecture [--layers 12] [--width 768] [--texts 400] [--repeats 5]``. Builds a random
GPT-2-small-shaped decoder and a Llama-shaped one from configs (nothing is downloaded), saves each, then measures in
one process, alternating the contestants (the machine is shared and noisy), best of ``--repeats``:

* load: ``layerwise.load_model`` (AutoModel + tokenizer + the discovery check against ``output_hidden_states``)
  against ``AutoModel.from_pretrained`` + ``AutoTokenizer.from_pretrained`` alone, first load in the process and a
  second one (the mapping is then cached);
* capture: ``Extractor.encode(layers="all", pool="mean")`` against hand-written batched ``output_hidden_states=True``
  code with a masked mean over every layer (the same work);
* early exit: layer ``L // 4`` against layer ``L``.

Writes nothing; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModel, AutoTokenizer, GPT2Config, LlamaConfig, PreTrainedTokenizerFast

import layerwise as lw
from layerwise.model import discovery

from .early_exit import make_texts


def build(kind: str, root: Path, layers: int, width: int) -> Path:
    corpus = make_texts(2000, seed=1)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=2000, special_tokens=["</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    vocab = tok.get_vocab_size()
    if kind == "gpt2":
        config = GPT2Config(vocab_size=vocab, n_embd=width, n_layer=layers, n_head=width // 64, n_positions=1024,
                            bos_token_id=0, eos_token_id=0)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=width * 8 // 3,
                             num_hidden_layers=layers, num_attention_heads=width // 64,
                             num_key_value_heads=width // 128, max_position_embeddings=4096, bos_token_id=0,
                             eos_token_id=0)
    path = root / kind
    AutoModel.from_config(config).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", model_max_length=1024).save_pretrained(path)
    return path


def best(fn: Callable[[], object], times: list[float]) -> None:
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)


def by_hand(model, tokenizer, texts: list[str], batch: int = 32) -> list[torch.Tensor]:
    """Batched output_hidden_states with a masked mean over every layer (what people write by hand)."""
    out = []
    with torch.inference_mode():
        for i in range(0, len(texts), batch):
            enc = tokenizer(texts[i : i + batch], padding=True, return_tensors="pt")
            hs = model(**enc, output_hidden_states=True).hidden_states
            m = enc["attention_mask"].unsqueeze(-1).float()
            out.append(torch.stack([(h * m).sum(1) / m.sum(1) for h in hs], 1))
    return out


def measure(path: Path, texts: list[str], repeats: int) -> tuple:
    """(L, tokens, load layerwise, load transformers, cached load, all layers, by hand, layer L/4, layer L)."""
    load_lw: list[float] = []
    load_hf: list[float] = []
    for _ in range(repeats):
        discovery._cache.clear()  # a first load in a fresh process
        best(lambda: lw.load_model(str(path), device="cpu"), load_lw)
        best(lambda: (AutoModel.from_pretrained(path), AutoTokenizer.from_pretrained(path)), load_hf)
    cached: list[float] = []
    for _ in range(repeats):
        best(lambda: lw.load_model(str(path), device="cpu"), cached)
    ex = lw.Extractor(str(path), device="cpu")
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.eos_token
    L = ex.num_layers
    n_tokens = sum(len(ids) for ids in tok(texts)["input_ids"])
    t_lw: list[float] = []
    t_hand: list[float] = []
    t_k: list[float] = []
    t_full: list[float] = []
    for _ in range(repeats):
        best(lambda: ex.encode(texts, layers="all", combine="stack", pool="mean"), t_lw)
        best(lambda: by_hand(ex.model, tok, texts), t_hand)
        best(lambda: ex.encode(texts, layers=L // 4, pool="mean"), t_k)
        best(lambda: ex.encode(texts, layers=L, pool="mean"), t_full)
    return (L, n_tokens, min(load_lw), min(load_hf), min(cached), min(t_lw), min(t_hand), min(t_k), min(t_full))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--width", type=int, default=768)
    ap.add_argument("--texts", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    texts = make_texts(args.texts)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("gpt2", "llama"):
            rows.append((kind, *measure(build(kind, Path(tmp), args.layers, args.width), texts, args.repeats)))
    print(f"Random {args.layers}-layer, width-{args.width} decoders, CPU fp32, {torch.get_num_threads()} threads, "
          f"{args.texts} texts, best of {args.repeats} alternating runs\n")
    print("| model | load: layerwise / transformers (first) | cached | all layers pooled: layerwise / by hand | "
          "layer L/4 / layer L |")
    print("|---|---|---|---|---|")
    for kind, L, n, lw_load, hf_load, cached_load, a, h, k, full in rows:
        print(f"| {kind} ({n:,} tokens) | {lw_load:.2f} s / {hf_load:.2f} s = {lw_load / hf_load:.2f}x | "
              f"{cached_load:.2f} s = {cached_load / hf_load:.2f}x | {a:.2f} s / {h:.2f} s = {h / a:.2f}x faster | "
              f"{L // 4} of {L}: {k / full:.1%} of the time |")


if __name__ == "__main__":
    main()
