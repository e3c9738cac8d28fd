"""One contract for every combine and pool mode: shape, mask respected, input unchanged."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from layerwise.encoding.combine import ScalarMix, combine, learned_combiner
from layerwise.encoding.pooling import AttentionPool, pool, pool_words
from layerwise.encoding.vocab import FIXED_COMBINES, LEARNED_COMBINES, POOL_MODES, WORD_POOL_MODES, combined_shape

K, B, T, W = 3, 4, 9, 8
LENGTHS = [9, 5, 1, 3]


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(K, B, T, W, generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(LENGTHS):
        mask[b, :n] = 1
    return h, mask


def _scramble_padding(h, mask, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = h.clone()
    pad = ~mask.bool()
    noise = torch.randn(h.shape, generator=g) * 100
    out[:, pad] = noise[:, pad]
    return out


COMBINERS = (
    [(m, {"weights": [0.2, 0.3, 0.5]} if m == "weighted" else {}) for m in FIXED_COMBINES]
    + [(learned_combiner(m, K, W), {}) for m in LEARNED_COMBINES]
    + [
        (ScalarMix(K), {}),
        (ScalarMix(K, layer_norm=True, initial_weights=[0.1, -0.3, 0.7]), {}),
        (ScalarMix(K, normalize="sum", initial_weights=[1.0, 2.0, 3.0]), {}),
    ]
)
POOLERS = [m for m in POOL_MODES if m != "attention"] + [AttentionPool(K * W)]


@pytest.mark.parametrize("mode,kw", COMBINERS, ids=lambda x: str(x)[:40])
@pytest.mark.parametrize("pool_mode", POOLERS, ids=lambda x: str(x)[:20])
def test_combine_pool_contract(mode, kw, pool_mode):
    h, mask = _inputs()
    if isinstance(pool_mode, AttentionPool) and mode != "concat":
        pool_mode = AttentionPool(W)
        if mode == "stack":
            pytest.skip("attention pooling pools [batch, tokens, D] features, not stacked layers")
    dense = nn_pooler = None
    if pool_mode == "pooler":
        if mode in ("concat", "stack"):
            pytest.skip("the model pooler takes hidden-size features")
        dense = torch.nn.Linear(W, W)
        nn_pooler = lambda x: torch.tanh(dense(x))  # noqa: E731
    original = h.clone()
    x = combine(h, mode, mask=mask, **kw)
    assert x.shape == (B, T) + combined_shape(mode, K, W)
    with torch.no_grad():
        out = pool(x, mask, pool_mode, pooler=nn_pooler)
    feat = x.shape[2:]
    if pool_mode == "mean_max":
        feat = feat[:-1] + (feat[-1] * 2,)
    assert out.shape == (B,) + tuple(feat)
    assert torch.equal(h, original), "combine/pool wrote into its input"
    # padding cannot change anything
    h2 = _scramble_padding(h, mask)
    with torch.no_grad():
        out2 = pool(combine(h2, mode, mask=mask, **kw), mask, pool_mode, pooler=nn_pooler)
    torch.testing.assert_close(out2, out, atol=1e-5, rtol=1e-5)


def test_combine_formulas():
    h, mask = _inputs()
    torch.testing.assert_close(combine(h, "concat"), torch.cat([h[0], h[1], h[2]], -1))
    torch.testing.assert_close(combine(h, "sum"), h[0] + h[1] + h[2])
    torch.testing.assert_close(combine(h, "mean"), (h[0] + h[1] + h[2]) / 3)
    torch.testing.assert_close(combine(h, "weighted", weights=[1, 0, 2]), h[0] + 2 * h[2])
    torch.testing.assert_close(combine(h, "stack")[:, :, 1], h[1])


def test_scalar_mix_formula_softmax_and_sum():
    h, mask = _inputs()
    w = [0.5, -1.0, 2.0]
    mix = ScalarMix(K, initial_weights=w)
    with torch.no_grad():
        mix.gamma.fill_(1.5)
    s = np.exp(w) / np.exp(w).sum()
    want = 1.5 * sum(float(s[k]) * h[k] for k in range(K))
    torch.testing.assert_close(mix(h, mask), want)
    summed = ScalarMix(K, normalize="sum", initial_weights=[1.0, 1.0, 2.0])
    torch.testing.assert_close(summed(h), (h[0] + h[1] + 2 * h[2]) / 4)
    # learned: gradients reach w and gamma
    mix(h, mask).sum().backward()
    assert mix.weights.grad is not None and mix.gamma.grad is not None


def test_scalar_mix_layer_norm_per_sequence():
    h, mask = _inputs()
    mix = ScalarMix(K, layer_norm=True)
    out = mix(h, mask)
    # independent numpy computation for row 1 (5 real tokens), layer 0 contribution with weight 1/3
    x = h[:, 1, :5].numpy()
    normed = [(x[k] - x[k].mean()) / np.sqrt(x[k].var() + 1e-12) for k in range(K)]
    np.testing.assert_allclose(out[1, :5].detach().numpy(), sum(normed) / 3, atol=1e-5)
    # a row alone gives the same result as inside the batch (statistics never cross sequences)
    alone = mix(h[:, 1:2], mask[1:2])
    torch.testing.assert_close(alone[0, :5], out[1, :5])


def test_scalar_mix_over_and_errors():
    mix = ScalarMix.over(6, include_embeddings=False)
    assert mix.mixture_size == 6 and mix.layers == "1:"
    assert ScalarMix.over(6).mixture_size == 7
    with pytest.raises(ValueError, match="softmax, sum"):
        ScalarMix(3, normalize="max")
    with pytest.raises(ValueError, match="Valid combine modes are: concat, sum, mean, weighted, stack"):
        combine(torch.zeros(2, 1, 1, 1), "median")


def test_pool_values_by_hand():
    x = torch.tensor([[[1.0], [3.0], [100.0]], [[2.0], [-5.0], [7.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    special = torch.tensor([[1, 0, 1], [1, 0, 1]])
    assert pool(x, mask, "mean").flatten().tolist() == pytest.approx([2.0, 4 / 3])
    assert pool(x, mask, "max").flatten().tolist() == [3.0, 7.0]
    assert pool(x, mask, "last").flatten().tolist() == [3.0, 7.0]
    assert pool(x, mask, "cls").flatten().tolist() == [1.0, 2.0]
    assert pool(x, mask, "mean", special=special, skip_special_tokens=True).flatten().tolist() == [3.0, -5.0]
    empty = pool(x, torch.zeros_like(mask), "max")
    assert empty.flatten().tolist() == [0.0, 0.0]
    attn = AttentionPool(1)
    with torch.no_grad():
        attn.query.fill_(0.5)
        got = attn(x, mask.bool())
    w = torch.softmax(torch.tensor([0.5, 1.5]), 0)  # scores x * q / sqrt(1) of the real tokens 1.0 and 3.0 only
    assert got[0].item() == pytest.approx(float(w[0] * 1.0 + w[1] * 3.0))
    w2 = torch.softmax(torch.tensor([1.0, -2.5, 3.5]), 0)
    assert got[1].item() == pytest.approx(float(w2 @ torch.tensor([2.0, -5.0, 7.0])))


def test_word_pooling_by_hand():
    x = torch.arange(12, dtype=torch.float32).reshape(2, 6, 1)
    word_ids = [[None, 0, 0, 1, None, None], [None, 0, 2, 2, 2, None]]
    n_words = [2, 3]
    got = {m: pool_words(x, word_ids, n_words, m) for m in WORD_POOL_MODES}
    assert got["first"][0].flatten().tolist() == [1, 3] and got["last"][0].flatten().tolist() == [2, 3]
    assert got["mean"][0].flatten().tolist() == [1.5, 3] and got["max"][1].flatten().tolist() == [7, 0, 10]
    assert got["first"][1].flatten().tolist() == [7, 0, 8]  # word 1 has no token: zeros
    assert got["first_last"][1].tolist() == [[7, 7], [0, 0], [8, 10]]
    assert got["mean"][1].flatten().tolist() == [7, 0, 9]
    original = x.clone()
    pool_words(x, word_ids, n_words, "mean")
    assert torch.equal(x, original)
    with pytest.raises(ValueError, match="Valid subword modes are: first, last, mean, max, first_last"):
        pool_words(x, word_ids, n_words, "median")


def test_word_pooling_ignores_padding_and_specials():
    x = torch.randn(1, 6, 4)
    ids = [[None, 0, 1, 1, None, None]]
    a = pool_words(x, ids, [2], "max")[0]
    y = x.clone()
    y[0, [0, 4, 5]] = 1e6
    b = pool_words(y, ids, [2], "max")[0]
    torch.testing.assert_close(a, b)
    assert not math.isnan(float(a.sum()))
