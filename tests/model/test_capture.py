"""Numerical truth: captured sites equal transformers' hidden_states and an independent computation."""

from __future__ import annotations

import pytest
import torch

from layerwise.model.capture import capture, count_layer_calls

from tiny import module_hook_count

TEXTS = ["EU rejects German call to boycott British lamb .", "Peter Blackburn", ".", "naïve cafés in Paris"]


def _batch(ex, texts=TEXTS):
    enc = ex.tokenizer(texts, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"]


def _reference(ex, ids, mask):
    with torch.inference_mode():
        out = ex.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    return out.hidden_states


def _max_diff(a, b, mask):
    keep = mask.bool()
    return float((a[keep] - b[keep]).abs().max())


def test_block_equals_hidden_states_every_family(tiny_extractors, family):
    ex = tiny_extractors[family]
    ids, mask = _batch(ex)
    ref = _reference(ex, ids, mask)
    assert len(ref) == ex.num_layers + 1
    got = capture(ex.loaded, ids, mask, layers=tuple(range(ex.num_layers + 1)))
    assert got.shape == (ex.num_layers + 1, len(TEXTS), ids.shape[1], ex.hidden_size)
    for i in range(ex.num_layers + 1):
        assert _max_diff(got[i], ref[i], mask) <= 1e-5, f"{family} layer {i}"


def test_block_equals_hidden_states_default_model(default_extractor):
    ex = default_extractor
    ids, mask = _batch(ex)
    ref = _reference(ex, ids, mask)
    got = ex.hidden_states(TEXTS, layers="all").tensor
    for i in range(7):
        assert _max_diff(got[i, :, : ids.shape[1]], ref[i], mask) <= 1e-5


def _ffn_from_attention(family, layer, att):
    """Independent recomputation of (intermediate, pre_ln, block) from the attention site, using the same modules."""
    if family == "distilbert":
        inter = layer.ffn.activation(layer.ffn.lin1(att))
        pre = layer.ffn.lin2(inter) + att
        return inter, pre, layer.output_layer_norm(pre)
    if family == "albert":
        inter = layer.activation(layer.ffn(att))
        pre = layer.ffn_output(inter) + att
        return inter, pre, layer.full_layer_layer_norm(pre)
    inter = layer.intermediate(att)
    pre = layer.output.dense(inter) + att
    return inter, pre, layer.output.LayerNorm(pre)


def test_sites_equal_independent_computation(tiny_extractors, family):
    ex = tiny_extractors[family]
    ids, mask = _batch(ex)
    ref = _reference(ex, ids, mask)
    modules = ex.loaded.layer_map.layers
    layers = tuple(range(1, ex.num_layers + 1))
    att = capture(ex.loaded, ids, mask, layers, "attention")
    inter = capture(ex.loaded, ids, mask, layers, "intermediate")
    pre = capture(ex.loaded, ids, mask, layers, "pre_ln")
    assert inter.shape[-1] == 37 and att.shape[-1] == 32  # intermediate_size of the tiny configs
    for k, i in enumerate(layers):
        layer = modules[min(i - 1, len(modules) - 1)]
        with torch.inference_mode():
            want_inter, want_pre, want_block = _ffn_from_attention(family, layer, att[k])
        assert _max_diff(inter[k], want_inter, mask) <= 1e-5
        assert _max_diff(pre[k], want_pre, mask) <= 1e-5
        if family == "deberta-v2" and i == 1:
            continue  # the tiny DeBERTa has a convolution after layer 1 (hidden_states[1] is its output)
        assert _max_diff(want_block, ref[i], mask) <= 1e-5  # the attention site feeds the layer's own output


def test_attention_site_is_input_of_feed_forward(default_extractor):
    """On the real model, LayerNorm(pre_ln) is the block output and the FFN of the attention site reproduces it."""
    ex = default_extractor
    ids, mask = _batch(ex)
    ref = _reference(ex, ids, mask)
    att = capture(ex.loaded, ids, mask, (3,), "attention")[0]
    pre = capture(ex.loaded, ids, mask, (3,), "pre_ln")[0]
    layer = ex.model.encoder.layer[2]
    with torch.inference_mode():
        assert _max_diff(layer.output.LayerNorm(pre), ref[3], mask) <= 1e-5
        assert _max_diff(layer.output(layer.intermediate(att), att), ref[3], mask) <= 1e-5


@pytest.mark.parametrize("k", [0, 1, 2])
def test_early_exit_runs_no_later_layer(tiny_extractors, family, k):
    ex = tiny_extractors[family]
    ids, mask = _batch(ex)
    assert count_layer_calls(ex.loaded, ids, mask, (k,)) == k
    if k >= 1:
        assert count_layer_calls(ex.loaded, ids, mask, (k,), "attention") == k


def test_early_exit_default_model_counts(default_extractor):
    ex = default_extractor
    ids, mask = _batch(ex)
    for k in range(7):
        assert count_layer_calls(ex.loaded, ids, mask, (k,)) == k
    assert count_layer_calls(ex.loaded, ids, mask, (0, 2)) == 2


def test_only_requested_layers_kept_and_order(default_extractor):
    ex = default_extractor
    ids, mask = _batch(ex)
    got = capture(ex.loaded, ids, mask, (4, 1))
    ref = _reference(ex, ids, mask)
    assert got.shape[0] == 2
    assert _max_diff(got[0], ref[4], mask) <= 1e-5 and _max_diff(got[1], ref[1], mask) <= 1e-5


def test_hooks_removed_even_on_error(default_extractor):
    ex = default_extractor
    before = module_hook_count(ex.model)
    ids, mask = _batch(ex)
    capture(ex.loaded, ids, mask, (2,))
    assert module_hook_count(ex.model) == before
    bad = ids.clone()
    bad[0, 1] = 10**7  # out of vocabulary: torch raises inside the forward pass
    with pytest.raises((IndexError, RuntimeError)):
        capture(ex.loaded, bad, mask, (2,))
    assert module_hook_count(ex.model) == before


def test_layer_stack_helpers(default_extractor):
    stack = default_extractor.hidden_states(["I love Paris", "Hi"], layers="all")
    assert stack.labels[0] == "embeddings" and stack.labels[-1] == "layer_6"
    assert torch.equal(stack["last"], stack.tensor[6]) and torch.equal(stack[-2], stack.tensor[5])
    assert torch.equal(stack.layer("layer_3"), stack.tensor[3]) and torch.equal(stack[0], stack.tensor[0])
    sub = stack.select("-4:")
    assert sub.layers == (3, 4, 5, 6) and torch.equal(sub.tensor, stack.tensor[3:])
    with pytest.raises(KeyError, match="not captured"):
        default_extractor.hidden_states(["x"], layers=[1]).layer(2)
    assert stack.word_ids[0] == [None, 0, 1, 2, None]
    assert stack.offsets[0][1] == (0, 1)
    assert stack.attention_mask[1].tolist() == [1, 1, 1, 0, 0]
    assert (stack.tensor[:, 1, 3:] == 0).all()  # padding is zeroed


@pytest.mark.parametrize("spec,model_layers", [("all", list(range(7))), ([0, 3, 5], [0, 3, 5]), ("-2:", [5, 6]),
                                               ([4, 1], [4, 1]), ("0,1,2", [0, 1, 2]), (2, [2])])
def test_layer_stack_iteration_len_and_positions_agree(default_extractor, spec, model_layers):
    """One rule: iteration, len, int and slice indexing (negative ints too) are positions in capture order;
    stack.layer(i) and string keys are model layers (issue 41, item 1)."""
    stack = default_extractor.hidden_states(["I love Paris", "Hi"], layers=spec)
    n = len(model_layers)
    items = list(stack)  # iterating ends after the last captured layer (it used to run on into a SpecError)
    assert len(items) == len(stack) == stack.tensor.shape[0] == n and list(stack.layers) == model_layers
    for k, (model_layer, h) in enumerate(zip(stack.layers, stack)):
        assert torch.equal(h, stack.tensor[k]) and torch.equal(stack[k], h) and torch.equal(stack[k - n], h)
        assert torch.equal(stack.layer(model_layer), h) and torch.equal(stack[stack.labels[k]], h)
    assert torch.equal(stack[-1], stack.tensor[-1]) and torch.equal(stack.layer(model_layers[-1]), stack[-1])
    tail = stack[1:]
    assert tail.layers == tuple(model_layers[1:]) and torch.equal(tail.tensor, stack.tensor[1:]) and len(tail) == n - 1
    for bad in (n, -n - 1):
        with pytest.raises(IndexError, match=rf"stack position {bad} is out of range: this stack holds {n} layer"):
            stack[bad]
    with pytest.raises(ValueError, match=r"stack\[key\] gives ONE layer, but key \[0, 1\] selects 2 layers .*"
                                         r"use stack\.select\(\[0, 1\]\)"):
        stack[[0, 1]]  # a list is a spec of model layers, as stack.layer(key)


def test_layer_stack_subset_positions_differ_from_model_layers(default_extractor):
    stack = default_extractor.hidden_states(["I love Paris"], layers=[0, 3, 5])
    assert torch.equal(stack[1], stack.layer(3)) and torch.equal(stack[-1], stack.layer(5))
    assert torch.equal(stack["layer_3"], stack[1]) and torch.equal(stack["embeddings"], stack[0])
    with pytest.raises(KeyError, match=r"model layer -1 \(index 6\) was not captured; this stack holds \['embeddings', "
                                       r"'layer_3', 'layer_5'\].*stack.layer\(i\) is model layer i"):
        stack.layer(-1)
    with pytest.raises(KeyError, match="not captured"):
        stack["last"]  # a name is a model layer: layer 6 was not captured
    assert stack.select([5, 0]).layers == (5, 0)

