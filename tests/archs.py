"""Tiny random models of every architecture the tests cover (hidden 32, 2-3 layers), beyond the seven families.

Each is built from its transformers config, saved to a directory (safetensors) with a tokenizer trained in-process,
and loaded back through layerwise's real loading path. ``python tests/archs.py`` regenerates the table of supported
architectures in ``docs/how-to/any-architecture.md`` from what these models report once loaded (the table is never
written by hand; a test checks it is current).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoModel, PreTrainedTokenizerFast

from tiny import CORPUS, FAMILIES, HEADS, HIDDEN, INTER, LAYERS, MAXPOS, wordpiece
from tiny import build as build_family


def _bpe(template: str | None) -> tuple[Tokenizer, dict]:
    """Byte-level BPE (GPT-2 / Llama-3 / Qwen style); ``template`` like ``"<s> $A"``, or no special tokens."""
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<|endoftext|>"]  # Qwen2Tokenizer pads with <|endoftext|>
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    if template:
        names = [w for w in template.split() if w.startswith("<")]
        tok.post_processor = processors.TemplateProcessing(
            single=template, special_tokens=[(n, tok.token_to_id(n)) for n in names]
        )
    return tok, dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")  # no pad token: layerwise adds one


def _mpnet_tok() -> tuple[Tokenizer, dict]:
    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.WordPiece(unk_token="<unk>"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(CORPUS, trainers.WordPieceTrainer(vocab_size=200, special_tokens=specials))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
    )
    return tok, dict(bos_token="<s>", eos_token="</s>", cls_token="<s>", sep_token="</s>", pad_token="<pad>",
                     unk_token="<unk>", mask_token="<mask>")


def _t5_tok() -> tuple[Tokenizer, dict]:
    specials = ["<pad>", "</s>", "<unk>"]
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(CORPUS, trainers.UnigramTrainer(vocab_size=200, special_tokens=specials, unk_token="<unk>"))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return tok, dict(pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


_C = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=INTER)
_DEC = dict(_C, num_key_value_heads=1, max_position_embeddings=128)


def _ids(tok: Tokenizer, **names: str) -> dict[str, int]:
    return {k: tok.token_to_id(v) for k, v in names.items()}


# name -> (kind, tokenizer builder, config class name, config kwargs given the tokenizer, model class name)
ARCHS: dict[str, tuple[str, Callable[[], tuple[Tokenizer, dict]], str, Callable[[Tokenizer], dict], str]] = {
    "mpnet": ("encoder", _mpnet_tok, "MPNetConfig",
              lambda t: dict(_C, max_position_embeddings=MAXPOS + 2,
                             **_ids(t, pad_token_id="<pad>", bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "modernbert": ("encoder", wordpiece, "ModernBertConfig",
                   lambda t: dict(_C, num_hidden_layers=3, global_attn_every_n_layers=2, local_attention=4,
                                  max_position_embeddings=MAXPOS,
                                  **_ids(t, pad_token_id="[PAD]", cls_token_id="[CLS]", sep_token_id="[SEP]",
                                         bos_token_id="[CLS]", eos_token_id="[SEP]")), "AutoModel"),
    "deberta": ("encoder", wordpiece, "DebertaConfig",
                lambda t: dict(_C, max_position_embeddings=MAXPOS, relative_attention=True, max_relative_positions=16,
                               pos_att_type=["c2p", "p2c"], **_ids(t, pad_token_id="[PAD]")), "AutoModel"),
    "t5": ("encoder", _t5_tok, "T5Config",
           lambda t: dict(d_model=HIDDEN, d_kv=16, d_ff=INTER, num_layers=LAYERS, num_heads=HEADS,
                          relative_attention_num_buckets=8, **_ids(t, pad_token_id="<pad>", eos_token_id="</s>"),
                          decoder_start_token_id=0), "T5EncoderModel"),
    "mt5": ("encoder", _t5_tok, "MT5Config",
            lambda t: dict(d_model=HIDDEN, d_kv=16, d_ff=INTER, num_layers=LAYERS, num_heads=HEADS,
                           relative_attention_num_buckets=8, **_ids(t, pad_token_id="<pad>", eos_token_id="</s>"),
                           decoder_start_token_id=0), "MT5EncoderModel"),
    "gpt2": ("decoder", lambda: _bpe(None), "GPT2Config",
             lambda t: dict(n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_inner=INTER, n_positions=MAXPOS,
                            **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "llama": ("decoder", lambda: _bpe("<s> $A"), "LlamaConfig",
              lambda t: dict(_DEC, head_dim=16, **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "mistral": ("decoder", lambda: _bpe("<s> $A"), "MistralConfig",
                lambda t: dict(_DEC, head_dim=16, sliding_window=4, **_ids(t, bos_token_id="<s>", eos_token_id="</s>")),
                "AutoModel"),
    "qwen2": ("decoder", lambda: _bpe(None), "Qwen2Config",
              lambda t: dict(_DEC, **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "qwen3": ("decoder", lambda: _bpe(None), "Qwen3Config",
              lambda t: dict(_DEC, head_dim=16, **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "gemma": ("decoder", lambda: _bpe("<s> $A"), "GemmaConfig",
              lambda t: dict(_DEC, head_dim=16,
                             **_ids(t, bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>")), "AutoModel"),
    "gemma2": ("decoder", lambda: _bpe("<s> $A"), "Gemma2Config",
               lambda t: dict(_DEC, head_dim=16, sliding_window=4,
                              **_ids(t, bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>")), "AutoModel"),
    "phi3": ("decoder", lambda: _bpe("<s> $A"), "Phi3Config",
             lambda t: dict(_DEC, **_ids(t, bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>")),
             "AutoModel"),
    "phi": ("decoder", lambda: _bpe(None), "PhiConfig",
            lambda t: dict(_DEC, **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "gpt_neox": ("decoder", lambda: _bpe(None), "GPTNeoXConfig",
                 lambda t: dict(_C, max_position_embeddings=128, rotary_pct=0.5,
                                **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
    "opt": ("decoder", lambda: _bpe("<s> $A"), "OPTConfig",
            lambda t: dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, ffn_dim=INTER,
                           max_position_embeddings=MAXPOS, word_embed_proj_dim=HIDDEN,
                           **_ids(t, bos_token_id="<s>", eos_token_id="</s>", pad_token_id="<pad>")), "AutoModel"),
    "bloom": ("decoder", lambda: _bpe(None), "BloomConfig",
              lambda t: dict(hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS,
                             **_ids(t, bos_token_id="<s>", eos_token_id="</s>")), "AutoModel"),
}

ALL = FAMILIES + tuple(ARCHS)


def build(name: str, directory: Path, seed: int = 0) -> Path:
    """Save a tiny random model of architecture ``name`` (a family of ``tiny.py`` or a key of :data:`ARCHS`)."""
    if name in FAMILIES:
        return build_family(name, directory, seed)
    _, make_tok, config_cls, config_kw, model_cls = ARCHS[name]
    tok, special = make_tok()
    config = getattr(transformers, config_cls)(vocab_size=tok.get_vocab_size(), **config_kw(tok))
    torch.manual_seed(seed)
    cls: Any = AutoModel if model_cls == "AutoModel" else getattr(transformers, model_cls)
    model = cls.from_config(config) if cls is AutoModel else cls(config)
    with torch.no_grad():  # larger than the default init so layers differ visibly and errors cannot hide
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=MAXPOS, **special).save_pretrained(directory)
    return directory


def kind(name: str) -> str:
    """``"encoder"`` or ``"decoder"``."""
    return "encoder" if name in FAMILIES else ARCHS[name][0]


def table(extractors: dict[str, Any]) -> str:
    """The markdown table of supported architectures (``docs/how-to/any-architecture.md``), from loaded extractors
    (one per architecture)."""
    rows = ["| architecture | kind | layers found at | how | final norm (`raw` = before it) | sites | positions |",
            "|---|---|---|---|---|---|---|"]
    for name in ALL:
        d = extractors[name].describe()
        path, how = d["layer_map"].rsplit(" (", 1)
        sites = ", ".join(s for s in d["sites"] if s not in ("block", "raw"))
        rows.append(f"| {d['architecture']} | {kind(name)} | `{path}` | {how.rstrip(')')} | "
                    f"{'`' + d['final'] + '`' if d['final'] else '-'} | block, raw{', ' + sites if sites else ''} | "
                    f"{d['positions'].split(',')[0]} |")
    return "\n".join(rows)


BEGIN, END = "<!-- architectures:begin (generated by python tests/archs.py) -->", "<!-- architectures:end -->"


PAGE = Path(__file__).resolve().parent.parent / "docs" / "how-to" / "any-architecture.md"  # where the table stands


def page_block(page: str) -> str:
    """The generated table as it stands in the page (between the markers)."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[start:end].strip()


if __name__ == "__main__":  # regenerate the table
    import tempfile

    import layerwise as lw

    root = Path(tempfile.mkdtemp())
    exs = {n: lw.Extractor(str(build(n, root / n)), device="cpu") for n in ALL}
    text = PAGE.read_text(encoding="utf-8")
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    PAGE.write_text(text[:start] + "\n" + table(exs) + "\n" + text[end:], encoding="utf-8")
    print(f"{PAGE.name} table: {len(ALL)} architectures", file=sys.stderr)
