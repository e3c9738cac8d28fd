"""EncodeSpec: validation with messages, resolution against a model, JSON round trips, and the one stream API."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import layerwise as lw
from layerwise.encoding.spec import EncodeSpec


def test_defaults_per_level():
    assert EncodeSpec().pool == "mean" and EncodeSpec().subword is None
    assert EncodeSpec(level="word").subword == "first" and EncodeSpec(level="word").pool is None
    assert EncodeSpec(level="token").pool is None and EncodeSpec(level="token").subword is None


@pytest.mark.parametrize(
    "kw,message",
    [
        ({"level": "doc"}, "unknown level 'doc'. Valid levels are: sentence, token, word"),
        ({"combine": "avg"}, "Valid combine modes are: concat, sum, mean, weighted, stack, scalar_mix, attention"),
        ({"pool": "median"}, "Valid pool modes are: cls, pooler, mean, max, mean_max, last, attention"),
        ({"level": "word", "subword": "middle"}, "Valid subword modes are: first, last, mean, max, first_last"),
        ({"site": "ffn"}, "unknown site 'ffn'. Valid sites are: block, raw, attention, intermediate, pre_ln"),
        ({"output_dtype": "bfloat16"}, "Valid output dtypes are: float32, float16"),
        ({"level": "token", "pool": "max"}, "pool='max' applies to level 'sentence' only"),
        ({"level": "word", "pool": "cls"}, "pool='cls' applies to level 'sentence' only"),
        ({"subword": "last"}, "subword='last' applies to level 'word' only, not level 'sentence'"),
        ({"level": "token", "skip_special_tokens": True}, "skip_special_tokens applies to level 'sentence' only"),
        ({"pool": "cls", "skip_special_tokens": True}, "cannot be used with skip_special_tokens=True"),
        ({"combine": "weighted", "weights": [1.0, math.nan]}, "weight 1 is nan; layer weights must be finite"),
        ({"combine": "weighted", "weights": [1.0, math.inf]}, "weight 1 is inf"),
        ({"combine": "weighted", "weights": ["a"]}, "weight 0 ('a') is not a number"),
        ({"level": "word", "combine": "stack", "subword": "first_last"}, "subword='first_last' concatenates"),
        ({"truncate": "yes"}, "truncate must be True or False, got 'yes'"),
    ],
)
def test_bad_specs_name_the_value_and_the_valid_ones(kw, message):
    with pytest.raises(ValueError) as info:
        EncodeSpec(**kw)
    assert message in str(info.value)


def test_resolve_against_a_model(tiny_extractors):
    ex = tiny_extractors["bert"]  # 2 layers
    spec = EncodeSpec(layers="-2:", combine="concat", pool="mean_max").resolve(ex)
    assert spec.layers == (1, 2) and spec.is_resolved
    assert spec.feature_shape(ex.hidden_size) == (2 * 2 * ex.hidden_size,)
    assert EncodeSpec(layers="all", combine="stack").resolve(ex).feature_shape(32) == (3, 32)
    assert EncodeSpec(layers=[0, 1], level="word", subword="first_last").resolve(ex).feature_shape(32) == (128,)
    with pytest.raises(
        ValueError, match=r"layer 5 in layer spec \[0, 5\] is out of range: this model has layers 0\.\.2"
    ):
        EncodeSpec(layers=[0, 5]).resolve(ex)
    with pytest.raises(ValueError, match="combine='weighted' got 1 weights for 2 selected layers"):
        EncodeSpec(layers="-2:", combine="weighted", weights=[1.0]).resolve(ex)
    with pytest.raises(ValueError, match="site 'attention' exists only in encoder layers 1..L"):
        EncodeSpec(layers=0, site="attention").resolve(ex)
    with pytest.raises(ValueError, match="pool='pooler' applies the model's pooler"):
        EncodeSpec(layers="-2:", pool="pooler").resolve(ex)
    with pytest.raises(ValueError, match="feature_shape needs resolved layers"):
        EncodeSpec(layers="-2:").feature_shape(32)


@pytest.mark.parametrize("mode", ["scalar_mix", "attention"])
def test_learned_combine_names_are_refused_where_nothing_is_trained(tiny_extractors, mode):
    ex = tiny_extractors["bert"]
    with pytest.raises(ValueError) as info:
        ex.encode(["a b"], layers="all", combine=mode)
    text = str(info.value)
    assert f"combine={mode!r} has learned weights" in text and "layerwise train" in text and "probe" in text
    assert EncodeSpec(layers="all", combine=mode).resolve(ex, learned=True).layers == (0, 1, 2)  # heads may


def test_learned_pool_name_is_refused_where_nothing_is_trained(tiny_extractors):
    with pytest.raises(ValueError, match="pool='attention' needs learned weights"):
        tiny_extractors["bert"].encode(["a b"], pool="attention")


@pytest.mark.parametrize(
    "spec",
    [
        EncodeSpec(),
        EncodeSpec(layers="-4:", combine="concat", pool="max", output_dtype="float16"),
        EncodeSpec(layers=[0, 2, 4], combine="weighted", weights=[0.2, 0.3, 0.5], skip_special_tokens=True),
        EncodeSpec(layers=(1, 2), level="word", subword="first_last", truncate=True),
        EncodeSpec(layers="all", level="token", site="pre_ln"),
    ],
)
def test_json_round_trip(spec, tmp_path):
    assert EncodeSpec.from_json(spec.to_json()) == spec
    assert EncodeSpec.from_dict(spec.to_dict()) == spec
    spec.to_json(tmp_path / "spec.json")
    assert EncodeSpec.from_json(tmp_path / "spec.json") == spec
    assert hash(spec) == hash(EncodeSpec.from_json(spec.to_json()))  # frozen and hashable: a batching key


def test_json_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match=r"unknown EncodeSpec field\(s\) \['pooling'\]"):
        EncodeSpec.from_dict({"pooling": "cls"})
    with pytest.raises(ValueError, match="EncodeSpec file '/no/such.json' does not exist"):
        EncodeSpec.from_json("/no/such.json")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(ValueError, match="is not valid JSON"):
        EncodeSpec.from_json(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="only named modes can be written as JSON"):
        EncodeSpec(layers="all", combine=lw.ScalarMix(3)).to_json()


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        EncodeSpec().pool = "max"  # type: ignore[misc]


def test_stream_is_in_input_order_and_equals_encode(tiny_extractors, sentences):
    ex = tiny_extractors["bert"]
    texts = sorted(sentences, key=len) + sentences  # length sorting inside the pipeline must be undone
    spec = EncodeSpec(layers="-2:", combine="mean", pool="max")
    got = list(ex.stream(iter(texts), spec, batch_tokens=16))  # any iterable
    assert [r.index for r in got] == list(range(len(texts)))
    want = ex.encode(texts, layers="-2:", combine="mean", pool="max")
    assert np.abs(np.stack([r.features.numpy() for r in got]) - want).max() <= 1e-5
    assert all(r.features.dtype == torch.float32 for r in got)
    assert [r.tokens.ids for r in got] == [ex.tokenizer(t)["input_ids"] for t in texts]


def test_stream_levels_and_dtype(tiny_extractors):
    ex = tiny_extractors["roberta"]
    toks = list(ex.stream(["a b c", "hello"], EncodeSpec(layers=1, level="token", output_dtype="float16")))
    assert [r.features.shape[0] for r in toks] == [len(r.tokens.ids) for r in toks]
    assert toks[0].features.dtype == torch.float16
    words = list(ex.stream(["EU rejects German call", ["Peter", "Blackburn"]], EncodeSpec(level="word")))
    assert [tuple(r.features.shape) for r in words] == [(4, 32), (2, 32)]
    with pytest.raises(TypeError, match="text 1 must be a string, got int"):
        list(ex.stream(["ok", 5], EncodeSpec()))


def test_the_manifest_the_service_and_a_head_hold_the_same_spec(tiny_extractors, tmp_path):
    from layerwise.serve import EncodeRequest

    spec = EncodeSpec(layers=[1, 2], combine="sum", pool="max")
    req = EncodeRequest(texts=["x"], **{k: v for k, v in spec.to_dict().items() if v is not None})
    assert req.spec() == spec
    head = lw.heads.HeadConfig(encode=spec)
    assert lw.heads.HeadConfig.from_json(head.to_json()).encode == spec
    (tmp_path / "in.txt").write_text("a b\nc d e\n")
    lw.extract(tmp_path / "in.txt", tmp_path / "s", spec, model=tiny_extractors["bert"])
    assert lw.open_store(tmp_path / "s").spec == spec.resolve(tiny_extractors["bert"])
