"""Results do not depend on batch budget, input order, length sorting or padding (<= 1e-5)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import layerwise as lw

VARIED = [
    "The cat sat.",
    "EU rejects German call to boycott British lamb .",
    ".",
    "A considerably longer sentence, with commas, numbers like 1,234 and a few rare words such as sesquipedalian.",
    "Hi",
    "naïve cafés and émigrés",
    "Why?",
    "Token-level features need masks: padding must never enter a mean, a max or an attention pool.",
]


def _configs(ex):
    return [
        dict(layers=-1, combine="concat", pool="mean"),
        dict(layers=f"-{min(4, ex.num_layers)}:", combine="concat", pool="max"),
        dict(layers="all", combine="mean", pool="mean_max", skip_special_tokens=True),
        dict(layers=[0, 2], combine="sum", pool="last"),
        dict(layers="1:", combine="weighted", weights=[0.5] * ex.num_layers, pool="cls"),
    ]


def _check_invariant(ex, texts):
    for cfg in _configs(ex):
        ref = ex.encode(texts, batch_tokens=100_000, **cfg)
        one = ex.encode(texts, batch_tokens=1, **cfg)  # one text per batch
        np.testing.assert_allclose(one, ref, atol=1e-5, rtol=0, err_msg=str(cfg))
        perm = list(range(len(texts)))
        random.Random(0).shuffle(perm)
        shuffled = ex.encode([texts[i] for i in perm], batch_tokens=64, **cfg)
        np.testing.assert_allclose(shuffled, ref[perm], atol=1e-5, rtol=0, err_msg=str(cfg))
        ex.sort_by_length = False
        try:
            unsorted = ex.encode(texts, batch_tokens=64, **cfg)
        finally:
            ex.sort_by_length = True
        np.testing.assert_allclose(unsorted, ref, atol=1e-5, rtol=0, err_msg=str(cfg))


def test_default_model_invariance(default_extractor):
    _check_invariant(default_extractor, VARIED)


def test_tiny_family_invariance(tiny_extractors, family):
    _check_invariant(tiny_extractors[family], VARIED[:6])


def test_single_vs_batched_equals_alone(default_extractor):
    """A text's vector is the same alone as inside a batch of long neighbours."""
    alone = default_extractor.encode(["Hi"], layers="-2")
    batched = default_extractor.encode(VARIED, layers="-2")
    np.testing.assert_allclose(batched[4], alone[0], atol=1e-5, rtol=0)


def test_encode_words_invariance(default_extractor):
    words = [t.split() for t in VARIED]
    ref = default_extractor.encode_words(words, layers="-4:", combine="concat", subword="mean", batch_tokens=100_000)
    one = default_extractor.encode_words(words, layers="-4:", combine="concat", subword="mean", batch_tokens=1)
    for a, b, w in zip(one, ref, words):
        assert a.shape == (len(w), 1536)
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)


def test_token_level_output(default_extractor):
    toks = default_extractor.encode(["I love Paris", "."], layers=[1, 6], combine="concat", pool=None)
    assert [t.shape for t in toks] == [(5, 768), (3, 768)]
    stack = default_extractor.hidden_states(["I love Paris"], layers=[1, 6])
    np.testing.assert_allclose(toks[0][:, 384:], stack.tensor[1, 0].numpy(), atol=1e-5, rtol=0)


@pytest.mark.real_model
def test_matches_sentence_transformers_mean_pooling(default_extractor):
    """Mean pooling on the last layer equals sentence-transformers on 100 varied sentences (cos >= 0.99999)."""
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(lw.default_model_path(), device="cpu")
    rng = random.Random(1)
    words = (
        "layer model token paris EU the a of bank river money naïve 1996 résumé !? , ; running ran "
        "unbelievably quick brown fox jumps lazy dog transformer attention"
    ).split()
    sentences = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))) for _ in range(90)]
    sentences += VARIED + ["x"] * 2
    ours = default_extractor.encode(sentences, layers=-1, pool="mean")
    theirs = model.encode(sentences, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)
    cos = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    assert len(sentences) == 100
    assert cos.min() >= 0.99999, cos.min()
    # long texts: the model's sentence_bert_config.json says max_seq_length 256, which is layerwise's window too;
    # sentence-transformers cuts there, so truncate=True gives its vectors (the default windows the whole text)
    assert default_extractor.max_length == 256
    long = ["word " * 400, " ".join(rng.choice(words) for _ in range(700)), "naïve résumé " * 150]
    ours = default_extractor.encode(sentences + long, layers=-1, pool="mean", truncate=True)
    theirs = model.encode(sentences + long, batch_size=16, convert_to_numpy=True, normalize_embeddings=False)
    cos = (ours * theirs).sum(1) / (np.linalg.norm(ours, axis=1) * np.linalg.norm(theirs, axis=1))
    assert cos.min() >= 0.99999, cos.min()
    # normalize=True is sentence-transformers' Normalize module: unit vectors, equal to its normalised output
    unit = default_extractor.encode(sentences + long, layers=-1, pool="mean", truncate=True, normalize=True)
    theirs = model.encode(sentences + long, batch_size=16, convert_to_numpy=True, normalize_embeddings=True)
    assert np.abs(np.linalg.norm(unit, axis=1) - 1).max() <= 1e-5
    assert np.abs(unit - theirs).max() <= 1e-5
