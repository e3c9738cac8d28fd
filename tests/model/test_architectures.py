"""Any architecture: 24 tiny random models (the 7 table families, MPNet, ModernBERT, DeBERTa, T5/mT5 encoders and
GPT-2, Llama, Mistral, Qwen2/3, Gemma/Gemma2, Phi3/Phi, GPT-NeoX, OPT, BLOOM decoders) checked against
transformers' own ``output_hidden_states``, for early exit, and for invariance to batch budget, order and padding
side; plus any PyTorch module through ``from_module`` and mappings that must be refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import layerwise as lw
from archs import ALL, END, PAGE, kind, page_block, table
from layerwise import MappingError
from layerwise.model.capture import count_layer_calls
from layerwise.model.discovery import discover

TEXTS = [
    "EU rejects German call to boycott British lamb .",
    "Peter Blackburn",
    ".",
    "The quick brown fox jumps over the lazy dog, again and again!",
    "naïve cafés",
    "a",
]


@pytest.fixture(params=ALL)
def arch(request) -> str:
    return request.param


def _reference(ex, texts):
    enc = ex.tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        out = ex.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"], output_hidden_states=True)
    return out.hidden_states, enc["attention_mask"]


def _scale(x) -> float:
    return max(1.0, float(np.max(np.abs(x), initial=0.0)))


def test_block_equals_output_hidden_states(arch_extractors, arch):
    ex = arch_extractors[arch]
    texts = [t for t in TEXTS if ex.tokenizer(t)["input_ids"]]  # transformers cannot run a row of no token
    ref, mask = _reference(ex, texts)
    assert len(ref) == ex.num_layers + 1, arch
    got = ex.hidden_states(texts, layers="all").tensor
    keep = mask.bool()
    for i in range(ex.num_layers + 1):
        diff = float((got[i, :, : mask.shape[1]][keep] - ref[i][keep]).abs().max())
        assert diff <= 1e-5 * max(1.0, float(ref[i][keep].abs().max())), (arch, i, diff)


def test_raw_site_is_the_layer_output_before_the_final_norm(arch_extractors, arch):
    ex = arch_extractors[arch]
    lmap = ex.loaded.layer_map
    L = ex.num_layers
    block = ex.hidden_states(TEXTS[:2], layers="all").tensor
    raw = ex.hidden_states(TEXTS[:2], layers="all", site="raw").tensor
    same = [i for i in range(L + 1) if not (i == L and lmap.final is not None) and not (i == 1 and lmap.after_first)]
    # (the block site may come from ONNX Runtime under the default backend: the same states within 1e-5)
    torch.testing.assert_close(block[same], raw[same], atol=1e-5, rtol=0, msg=arch)
    if lmap.final is not None:
        assert kind(arch) == "decoder" or arch in ("t5", "mt5", "modernbert")
        with torch.inference_mode():
            assert torch.allclose(lmap.final(raw[L]), block[L], atol=1e-5), arch
        assert not torch.allclose(raw[L], block[L], atol=1e-3), f"{arch}: the final norm changed nothing"


def _final_calls(ex, layers):
    final = ex.loaded.layer_map.final
    if final is None:
        return 0
    calls = []
    handle = final.register_forward_pre_hook(lambda m, a: calls.append(1))
    try:
        ex.hidden_states(TEXTS[:1], layers=layers)
    finally:
        handle.remove()
    return len(calls)


def test_early_exit_runs_no_layer_after_the_deepest(arch_extractors, arch):
    ex = arch_extractors[arch]
    enc = ex.tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    L = ex.num_layers
    for k in range(L + 1):
        assert count_layer_calls(ex.loaded, ids, mask, (k,)) == k, (arch, k)
    assert count_layer_calls(ex.loaded, ids, mask, (0, L)) == L
    if ex.loaded.layer_map.final is not None:
        assert _final_calls(ex, L - 1) == 0 and _final_calls(ex, L) == 1, arch
        assert count_layer_calls(ex.loaded, ids, mask, (L,), "raw") == L


def test_encode_is_invariant_to_budget_order_and_padding_side(arch_extractors, arch):
    ex = arch_extractors[arch]
    left = lw.Extractor(ex.loaded, padding_side="left")
    want = ex.encode(TEXTS, layers="all", combine="concat", pool=None)
    runs = {
        "budget 8": ex.encode(TEXTS, layers="all", combine="concat", pool=None, batch_tokens=8),
        "reversed": ex.encode(TEXTS[::-1], layers="all", combine="concat", pool=None, batch_tokens=40)[::-1],
        "left padding": left.encode(TEXTS, layers="all", combine="concat", pool=None),
        "left, reversed": left.encode(TEXTS[::-1], layers="all", combine="concat", pool=None)[::-1],
    }
    for name, got in runs.items():
        for w, g in zip(want, got):
            assert w.shape == g.shape, (arch, name)
            assert np.abs(w - g).max(initial=0.0) <= 1e-5 * _scale(w), (arch, name, float(np.abs(w - g).max()))
    pooled = {p: ex.encode(TEXTS, layers="-2:", pool=p) for p in ("mean", "last", "max")}
    for p, want_p in pooled.items():
        got_p = left.encode(TEXTS[::-1], layers="-2:", pool=p, batch_tokens=16)[::-1]
        assert np.abs(want_p - got_p).max() <= 1e-5 * _scale(want_p), (arch, p)


def test_describe_states_positions_and_windows(arch_extractors):
    d = {n: arch_extractors[n].describe() for n in ("gpt2", "llama", "t5", "modernbert", "bert", "bloom", "mpnet")}
    assert d["gpt2"]["positions"] == "absolute, at most 64 tokens" and d["gpt2"]["final"] == "ln_f"
    assert d["llama"]["positions"] == "rotary, at most 128 tokens" and d["llama"]["layer_map"] == "layers (discovered)"
    assert d["t5"]["positions"] == "relative, no maximum" and d["t5"]["window"] == 64  # the tokenizer's length
    assert d["t5"]["final"] == "encoder.final_layer_norm"
    assert d["modernbert"]["positions"].startswith("rotary") and d["modernbert"]["final"] == "final_norm"
    assert d["bloom"]["positions"] == "alibi, no maximum" and d["bloom"]["window"] == 64  # the tokenizer says 64
    assert d["mpnet"]["positions"] == "absolute, at most 64 tokens"  # 66 rows minus padding_idx + 1
    assert d["bert"]["layer_map"] == "encoder.layer (table)" and set(d["bert"]["sites"]) >= {"pre_ln", "raw"}
    assert "pre_ln" not in d["llama"]["sites"] and d["llama"]["sites"]["intermediate"] == 37
    assert "positions=rotary" in repr(arch_extractors["llama"])


def test_windows_use_the_architecture_maximum(arch_extractors):
    gpt2 = arch_extractors["gpt2"]  # 64 learned positions: a longer text is windowed, every token gets a state
    long_text = " ".join(["the quick brown fox jumps over the lazy dog"] * 20)
    n = len(gpt2.tokenizer(long_text)["input_ids"])
    assert n > 64
    (tokens,) = gpt2.encode([long_text], layers=-1, pool=None)
    assert tokens.shape == (n, 32) and np.isfinite(tokens).all()
    t5 = arch_extractors["t5"]  # relative positions: any window up to "no maximum" can be asked for
    wide = lw.Extractor(t5.loaded, max_length=4096)
    (states,) = wide.encode([long_text], layers=-1, pool=None)
    assert states.shape[0] == len(t5.tokenizer(long_text)["input_ids"])
    with pytest.raises(ValueError, match=r"max_length=65 is outside 1\.\.64"):
        lw.Extractor(gpt2.loaded, max_length=65)


def test_decoder_word_features_and_last_token_pool(arch_extractors):
    ex = arch_extractors["llama"]
    words = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"]]
    got = ex.encode_words(words, layers="-2:", combine="concat", subword="last")
    assert [g.shape for g in got] == [(4, 64), (2, 64)]
    last = ex.encode(["Peter Blackburn"], layers=-1, pool="last")
    tokens = ex.encode(["Peter Blackburn"], layers=-1, pool=None)[0]
    assert np.allclose(last[0], tokens[-1])  # no suffix token: the last real token


# ---- any PyTorch module ---------------------------------------------------------------------------------------
class TinyEncoder(nn.Module):
    """A hand-written encoder: embeddings, learned positions, three nn.TransformerEncoderLayer."""

    def __init__(self, vocab: int, width: int = 32, layers: int = 3, max_len: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(max_len, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, 2, 48, dropout=0.0, batch_first=True) for _ in range(layers)
        )

    def forward(self, input_ids, attention_mask, *, keep: list | None = None):
        x = self.embed(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        if keep is not None:
            keep.append(x)
        for block in self.blocks:
            x = block(x, src_key_padding_mask=attention_mask == 0)
            if keep is not None:
                keep.append(x)
        return x


@pytest.fixture(scope="module")
def custom(arch_extractors):
    tok = arch_extractors["bert"].tokenizer
    torch.manual_seed(0)
    return TinyEncoder(len(tok)).eval(), tok


def test_from_module_equals_the_modules_own_layer_outputs(custom):
    model, tok = custom
    ex = lw.Extractor.from_module(model, tok, layer_modules="blocks", max_length=64)
    assert ex.num_layers == 3 and ex.hidden_size == 32 and ex.sites == ("block", "raw")
    assert ex.describe()["layer_map"] == "blocks (given)"
    for text in TEXTS:
        enc = tok([text], return_tensors="pt")
        own: list = []
        with torch.inference_mode():
            model(enc["input_ids"], enc["attention_mask"], keep=own)
        got = ex.hidden_states([text], layers="all").tensor
        for i in range(4):
            assert torch.allclose(got[i, 0], own[i][0], atol=1e-5), (text, i)
    enc = tok(TEXTS[:2], padding=True, return_tensors="pt")
    assert count_layer_calls(ex.loaded, enc["input_ids"], enc["attention_mask"], (1,)) == 1
    a = ex.encode(TEXTS, layers="-2:", combine="mean", pool="mean")
    b = ex.encode(TEXTS[::-1], layers="-2:", combine="mean", pool="mean", batch_tokens=8)[::-1]
    assert np.abs(a - b).max() <= 1e-5 * _scale(a)


def test_from_module_takes_a_list_a_call_and_windows(custom):
    model, tok = custom
    ex = lw.Extractor.from_module(model, tok, layer_modules=list(model.blocks), max_length=16,
                                  call=lambda m, ids, mask: m(ids, mask))
    long_text = "the quick brown fox jumps over the lazy dog " * 4
    (tokens,) = ex.encode([long_text], layers=-1, pool=None)
    assert tokens.shape == (len(tok(long_text)["input_ids"]), 32)  # windows of 16 stitched back
    assert ex.describe()["window"] == 16


def test_from_module_refuses_what_is_not_a_chain(custom):
    model, tok = custom
    with pytest.raises(lw.ModelLoadError, match=r"not once each in order"):
        lw.Extractor.from_module(model, tok, layer_modules=list(model.blocks)[::-1])
    with pytest.raises(lw.ModelLoadError, match=r"item 1 does not read what item 0 wrote"):
        lw.Extractor.from_module(model, tok, layer_modules=[model.blocks[0], model.blocks[2]])
    with pytest.raises(lw.ModelLoadError, match=r"module path 'encoder\.layers' not found in TinyEncoder"):
        lw.Extractor.from_module(model, tok, layer_modules="encoder.layers")
    with pytest.raises(lw.ModelLoadError, match=r"call=lambda model, ids, mask"):
        lw.Extractor.from_module(model, tok, layer_modules="blocks", call=lambda m, ids, mask: m(ids))
    with pytest.raises(TypeError, match=r"fast tokenizer"):
        lw.Extractor.from_module(model, object(), layer_modules="blocks")


# ---- mappings that would be wrong are refused at load ----------------------------------------------------------
class ScaledStates(nn.Module):
    """Reports hidden_states that its module list does not produce (each entry doubled)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, output_hidden_states=False, **kw):
        out = self.inner(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
        out.hidden_states = tuple(h * 2 for h in out.hidden_states)
        return out


def test_a_list_that_does_not_produce_hidden_states_is_refused(arch_extractors):
    ex = arch_extractors["llama"]
    with pytest.raises(MappingError) as info:
        discover(ScaledStates(ex.model), ex.tokenizer, name="scaled")
    msg = str(info.value)
    assert "could not map the layers of ScaledStates to its 3 hidden_states" in msg
    assert "inner.layers (2 x LlamaDecoderLayer): the first item's input is not hidden_states[0]" in msg
    assert "Extractor(model, layer_modules='path.to.layers')" in msg


def test_a_wrong_layers_path_is_refused_at_load(arch_dirs):
    # T5's first block holds a list of two sub-layers: the same length as the block list, but not the layers
    with pytest.raises(lw.ModelLoadError, match=r"Tried: encoder\.block\.0\.layer \(2 x T5LayerSelfAttention\)"):
        lw.Extractor(str(arch_dirs["t5"]), layer_modules="encoder.block.0.layer")
    with pytest.raises(lw.ModelLoadError, match=r"layer_modules='encoder\.nothing': module path"):
        lw.Extractor(str(arch_dirs["t5"]), layer_modules="encoder.nothing")
    ok = lw.Extractor(str(arch_dirs["t5"]), layer_modules="encoder.block")
    assert ok.describe()["layer_map"] == "encoder.block (given)"


def test_left_padding_is_refused_where_positions_cannot_follow_the_mask(arch_extractors, monkeypatch):
    ex = arch_extractors["gpt2"]
    monkeypatch.setattr(ex.loaded, "accepts_position_ids", False)  # as a model without position_ids would be
    with pytest.raises(ValueError, match=r"padding_side='left' changes the states of this gpt2 model"):
        lw.Extractor(ex.loaded, padding_side="left")
    with pytest.raises(ValueError, match=r"unknown padding_side 'middle'. Valid values are: right, left"):
        lw.Extractor(ex.loaded, padding_side="middle")


def test_architecture_table_is_generated_from_these_models(arch_extractors):
    page = PAGE.read_text(encoding="utf-8")
    assert END in page
    assert page_block(page) == table(arch_extractors), f"the table of {PAGE} is stale: run python tests/archs.py"
    assert len(ALL) >= 20


def test_custom_module_example_runs_as_shown(capsys):
    page = PAGE.read_text(encoding="utf-8")
    section = page[page.index("## Any PyTorch module") :]
    start = section.index("```python\n") + len("```python\n")
    code = section[start : section.index("\n```", start)]
    torch.manual_seed(0)
    exec(compile(code, str(PAGE), "exec"), {"__name__": "doc_example"})
    printed = capsys.readouterr().out.splitlines()
    shown = [line.split("# ", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
    assert printed == shown


def test_onnx_backend_names_what_it_exports(arch_extractors):
    with pytest.raises(ValueError, match=r"backend='onnx' exports the BERT-family encoders of the family table; "
                                         r"this llama model's layers were discovered at load: use backend='torch'"):
        lw.Extractor(arch_extractors["llama"].loaded, backend="onnx")
    with pytest.raises(ValueError, match=r"padding_side='left' needs backend='torch'"):
        lw.Extractor(arch_extractors["bert"].loaded, backend="onnx", padding_side="left")
