"""Rows that leave a batch at their own depth (``layerwise.model.ragged``): each row runs only its layers, the
states equal a full pass's on every row that ran a layer, the layers really run fewer rows, a model where cutting the
batch changes the states is found and run the old way, and ``encode_shared`` on PyTorch gives every part its own
lone result."""

from __future__ import annotations

import pytest
import torch

import layerwise as lw
from layerwise.model.backends.pytorch import TorchBackend
from layerwise.model.capture import capture, keep_counts
from layerwise.model.discovery import probe_batch
from layerwise.model.ragged import batch_keys, verify

# encoders, an encoder-decoder's encoder, decoders with rotary positions and causal masks, ModernBERT's local attention
ARCHITECTURES = ["bert", "deberta-v2", "mpnet", "t5", "gpt2", "llama", "qwen3", "gemma2", "opt", "modernbert"]


def _batch(tokenizer, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = probe_batch(tokenizer)
    pick = torch.arange(rows) % ids.shape[0]
    return ids[pick], mask[pick]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_each_row_runs_its_own_layers_and_gets_the_full_pass_states(arch_extractors, name):
    backend = TorchBackend(arch_extractors[name].backend.loaded)
    lm = backend.loaded
    depth = lm.num_layers
    keys = batch_keys(lm)
    assert 0 in keys  # the hidden states are the layer's first input
    assert backend.can_leave_early(depth, "block") and verify(lm, depth, keys)
    ids, mask = _batch(lm.tokenizer, 4)
    depths = [depth, depth, 1, 1]
    layers = tuple(range(depth + 1))
    ran: list[int] = []
    handles = [layer.register_forward_hook(lambda m, a, out: ran.append(int((out[0] if isinstance(out, tuple)
                                                                                else out).shape[0])))
               for layer in lm.layer_map.layers]
    try:
        ragged = capture(lm, ids, mask, layers, depths=depths, keys=keys)
    finally:
        for handle in handles:
            handle.remove()
    assert ran == keep_counts(depths, lm.num_layers)[1:]  # layer 1 ran 4 rows, the others 2
    full = capture(lm, ids, mask, layers)
    scale = float(full.abs().max())
    for k, layer in enumerate(layers):
        rows = [r for r, d in enumerate(depths) if d >= layer]
        real = mask[rows].bool()
        assert torch.allclose(ragged[k, rows][real], full[k, rows][real], atol=1e-5 * max(1.0, scale)), layer
        assert not ragged[k, [r for r in range(4) if r not in rows]].any()  # rows that did not run it: zeros


def test_a_model_whose_states_change_when_the_batch_is_cut_runs_every_row_to_the_depth(arch_extractors):
    # BLOOM's ALiBi bias carries batch x heads rows, which the layer inputs' batch rule does not cut: the check
    # finds it, and encode_shared then runs each depth's rows in batches of their own (results still exact)
    ex = lw.Extractor(TorchBackend(arch_extractors["bloom"].backend.loaded))
    assert ex.backend.ragged_price(ex.num_layers, "block") is None
    _parts_equal_lone_encodings(ex)


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_encode_shared_on_pytorch_gives_each_part_its_own_result(arch_extractors, name):
    ex = lw.Extractor(TorchBackend(arch_extractors[name].backend.loaded), max_length=16)
    assert ex.backend.ragged_price(ex.num_layers, "block") == 1.0
    _parts_equal_lone_encodings(ex)


def _parts_equal_lone_encodings(ex: lw.Extractor) -> None:
    one = "last" if ex.causal else "cls"  # a decoder's first token has seen nothing (refused there)
    specs = [lw.EncodeSpec(layers=1, pool=one), lw.EncodeSpec(layers=-1, pool="mean"),
             lw.EncodeSpec(layers=[0, 1], level="token"), lw.EncodeSpec(layers="all", combine="mean", pool="max")]
    texts = ["EU rejects German call", "a longer text about the layers of a model that needs windows " * 3, "x"]
    parts = [(ex.tokenize(texts, words=False), spec) for spec in specs]
    got = {(p, r.index): r.features for step in ex.encode_shared(parts, batch_tokens=48) for p, r in step}
    for p, (toks, spec) in enumerate(parts):
        for lone in ex.encode_tokenized(toks, spec):
            assert torch.allclose(got[p, lone.index], lone.features, atol=1e-5), (p, lone.index)


def test_row_depths_must_come_deepest_first_and_fit_the_layers(tiny_extractors):
    with pytest.raises(lw.SpecError, match="deepest first"):
        keep_counts([1, 2], 2)
    assert keep_counts([3, 2, 2, 0], 3) == [4, 3, 3, 1]
    lm = tiny_extractors["bert"].backend.loaded
    ids, mask = _batch(lm.tokenizer, 2)
    with pytest.raises(lw.SpecError, match="none deeper than max"):
        capture(lm, ids, mask, (1,), depths=[2, 1], keys=batch_keys(lm))
