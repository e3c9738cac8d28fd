"""One forward pass for several specs (``Extractor.encode_shared``, what the service's batches run): each part's
results equal its own ``encode_tokenized``, whatever the parts ask (layers in any order, combine, pool, level,
precision, dimensions, windows of a long text), with a step after every forward batch; and the rule that a blank text
is refused, as the schema says it."""

from __future__ import annotations

import re

import pytest
import torch

import layerwise as lw
from layerwise.corpus.records import NON_BLANK, is_blank

SPECS = [
    lw.EncodeSpec(layers=1, pool="cls"),
    lw.EncodeSpec(layers="all", combine="mean", pool="max", output_dtype="float16"),
    lw.EncodeSpec(layers=[2, 0], level="token"),  # not in ascending order
    lw.EncodeSpec(layers=-1, level="word", subword="mean"),
    lw.EncodeSpec(layers=[1, 2], combine="concat", pool="mean", normalize=True, dimensions=16),
]
TEXTS = ["EU rejects German call", "a much longer text about the layers of a model " * 12, "x"]


@pytest.mark.parametrize("segments", [None, [[0, 3], [1, 2, 4]], [[0], [1], [2], [3], [4]]])
@pytest.mark.parametrize("family", ["bert", "roberta", "deberta-v2"])
def test_each_part_equals_its_own_encoding(tiny_extractors, family, segments):
    ex = tiny_extractors[family]
    ex = lw.Extractor(ex.backend, max_length=32)  # the long text is cut into windows
    parts = []
    for spec in SPECS:
        items = [t.split() for t in TEXTS] if spec.level == "word" else TEXTS
        parts.append((ex.tokenize(items, words=spec.level == "word"), spec))
    got: dict[tuple[int, int], torch.Tensor] = {}
    steps = 0
    for step in ex.encode_shared(parts, batch_tokens=64, segments=segments):
        steps += 1
        for p, result in step:
            assert (p, result.index) not in got
            got[p, result.index] = result.features
    assert len(got) == len(SPECS) * len(TEXTS)
    assert steps > 3  # a step per forward batch (windows of 32 tokens, 64 tokens a batch), some with no text done
    for p, (toks, spec) in enumerate(parts):
        for lone in ex.encode_tokenized(toks, spec):
            shared = got[p, lone.index]
            assert shared.shape == lone.features.shape and shared.dtype == lone.features.dtype
            tol = 2e-3 if spec.output_dtype == "float16" else 1e-5
            assert torch.allclose(shared.float(), lone.features.float(), atol=tol), (p, lone.index)


def test_parts_at_different_sites_or_segments_that_miss_a_part_are_refused(tiny_extractors):
    ex = tiny_extractors["bert"]
    toks = ex.tokenize(["hi"], words=False)
    with pytest.raises(lw.SpecError, match="share one site"):
        list(ex.encode_shared([(toks, lw.EncodeSpec(layers=1)), (toks, lw.EncodeSpec(layers=1, site="attention"))]))
    with pytest.raises(lw.SpecError, match="exactly once"):
        list(ex.encode_shared([(toks, lw.EncodeSpec(layers=1)), (toks, lw.EncodeSpec(layers=2))], segments=[[0]]))


def test_the_schema_pattern_is_the_blank_rule_over_every_code_point():
    rx = re.compile(NON_BLANK)
    wrong = [hex(c) for c in range(0x110000) if (rx.search(chr(c)) is None) != is_blank(chr(c))]
    assert wrong == []
    assert is_blank(" \t\u3000\x1f") and not is_blank(" a ")
