"""Classifier heads (``layerwise.heads``) on the tiny random BERT: training, formulas, masks, saving, caching, errors.

Toy data is separable by construction: every text holds its class word three times plus random filler words, so a
head on a frozen *random* encoder learns it in a few epochs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import layerwise as lw
from layerwise.heads import HeadConfig, LayerAttention, LayerHead, SequenceClassifier, TrainOptions, load, train
from layerwise.heads.data import encode_labels, frozen_features, label_map, read_labelled

from tiny import TOY_FILLER as FILLER  # noqa: F401
from tiny import toy

QUIET = dict(log=lambda line: None)  # and TrainOptions(progress=False)


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_dirs, tiny_extractors):
    root = tmp_path_factory.mktemp("heads")
    files = {
        "train": root / "train.tsv",
        "dev": root / "dev.csv",
        "train3": root / "train3.jsonl",
        "dev3": root / "dev3.tsv",
    }
    toy(files["train"], 48, 0), toy(files["dev"], 24, 1)
    toy(files["train3"], 60, 2, ("pos", "neg", "mid")), toy(files["dev3"], 30, 3, ("pos", "neg", "mid"))
    return dict(root=root, cache=root / "cache", model=str(tiny_dirs["bert"]), ex=tiny_extractors["bert"], **files)


def fit(env, three=False, extractor=None, cache=None, output=None, files=None, **kw):
    """Train a frozen (default) head on the toy data with small, fast settings; ``kw`` = config + train options.

    ``files``: ``(train, dev)`` paths instead of the env's toy files.
    """
    opts = {k: kw.pop(k) for k in list(kw) if k in ("epochs", "lr", "seed", "encoder_lr", "patience")}
    opts = TrainOptions(
        **{"epochs": 6, "lr": 1e-2, "batch_size": 16, "cache_dir": cache or env["cache"], "progress": False, **opts}
    )
    cfg = HeadConfig(model=env["model"], layers=kw.pop("layers", "all"), **kw)
    tr, dv = files or ((env["train3"], env["dev3"]) if three else (env["train"], env["dev"]))
    return train(cfg, tr, dv, model=extractor or env["ex"], options=opts, output=output, **QUIET)


KINDS = [
    dict(classifier="linear", combine="concat", pool="mean"),
    dict(classifier="mlp", three=True),
    dict(classifier="per_layer"),
    dict(pool="cls"),
    dict(combine="sum"),
    dict(combine="mean", three=True),
    dict(combine="scalar_mix"),
    dict(combine="attention"),
    dict(pool="max"),
    dict(pool="mean_max"),
    dict(pool="last"),
    dict(pool="attention"),
    dict(pool="attention", combine="attention"),
]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: "-".join(f"{a}_{v}" for a, v in k.items()))
def test_every_head_kind_learns_a_separable_set(env, kind):
    result = fit(env, patience=10, **kind)
    losses = [e["loss"] for e in result.log]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert result.dev["accuracy"] >= 0.75  # chance: 0.5 (two classes) or 0.33 (three)
    assert result.classifier.labels == (["mid", "neg", "pos"] if kind.get("three") else ["neg", "pos"])


@pytest.mark.parametrize("kind", [dict(layers=-1, pool="mean"), dict(pool="attention", combine="scalar_mix")])
def test_finetune_learns_and_saves_encoder(env, kind, tmp_path):
    ex = lw.Extractor(env["model"], device="cpu")  # fine-tuning updates it in place: never the shared one
    result = fit(env, extractor=ex, mode="finetune", epochs=3, encoder_lr=1e-3, output=tmp_path / "m", **kind)
    losses = [e["loss"] for e in result.log]
    assert losses[-1] < losses[0], losses
    enc = tmp_path / "m" / "encoder"
    assert (enc / "model.safetensors").is_file() and not list(enc.glob("*.bin"))
    tuned, original = lw.Extractor(str(enc), device="cpu").model.state_dict(), env["ex"].model.state_dict()
    assert any(not torch.equal(tuned[k], original[k]) for k in original)  # the fine-tuned encoder was saved
    texts = read_labelled(env["dev"]).texts
    again = load(tmp_path / "m", device="cpu")
    np.testing.assert_allclose(again.predict_proba(texts), result.classifier.predict_proba(texts), atol=1e-6)


@pytest.mark.parametrize(
    "kind",
    [
        dict(classifier="per_layer"),
        dict(pool="attention", combine="attention"),
        dict(combine="scalar_mix", classifier="mlp", pool="mean_max", dropout=0.3),
    ],
)
def test_save_load_round_trip_and_model_dir(env, kind, tmp_path):
    result = fit(env, epochs=2, output=tmp_path / "m", **kind)
    out = tmp_path / "m"
    cfg = HeadConfig.from_json(out / "config.json")
    assert cfg == result.classifier.config and cfg.labels == ("neg", "pos")
    assert json.loads((out / "labels.json").read_text()) == {"neg": 0, "pos": 1}
    assert [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()] == result.log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["dev"] == result.dev and metrics["best_epoch"] == result.best_epoch
    assert (out / "head.safetensors").is_file()
    texts = read_labelled(env["dev"]).texts + ["paris", "an unseen text about lamb and paris"]
    want = result.classifier.predict_proba(texts)
    for clf in (load(out, model=env["ex"]), load(out, device="cpu")):
        np.testing.assert_allclose(clf.predict_proba(texts), want, atol=1e-6)


def test_saved_dir_names_the_encoder_it_was_trained_with(env, tmp_path):
    cfg = HeadConfig(layers=-1)  # no model: the encoder is only given as model=
    result = train(
        cfg,
        env["train"],
        env["dev"],
        model=env["ex"],
        options=TrainOptions(cache_dir=env["cache"], epochs=1, progress=False),
        output=tmp_path / "m",
        **QUIET,
    )
    np.testing.assert_allclose(
        load(tmp_path / "m", device="cpu").predict_proba(["paris"]),
        result.classifier.predict_proba(["paris"]),
        atol=1e-6,
    )


def _randomise(module, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return module.eval()


def test_attention_pool_head_ignores_padded_positions():
    head = _randomise(LayerHead(HeadConfig(labels=["a", "b", "c"], pool="attention", combine="scalar_mix"), 3, 8))
    x, mask = torch.randn(2, 6, 3, 8), torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    y = x.clone()
    y[0, 3:] = 1e3 * torch.randn(3, 3, 8)
    assert torch.allclose(head(x, mask), head(y, mask), atol=1e-6)
    assert not torch.allclose(head(x, mask), head(x, torch.ones_like(mask)), atol=1e-3)  # padding would matter


@pytest.mark.parametrize("pool", ["mean", "max", "last", "attention"])
def test_prediction_alone_equals_prediction_in_a_padded_batch(env, pool):
    clf = SequenceClassifier(HeadConfig(labels=["neg", "pos"], model=env["model"], layers="all", pool=pool), env["ex"])
    _randomise(clf.head, seed=1)
    texts = ["paris lamb", "the fox", " ".join(FILLER * 3), " ".join(FILLER[::-1] * 3)]
    batch = clf.predict_proba(texts)
    for i in (0, 1):
        np.testing.assert_allclose(clf.predict_proba([texts[i]])[0], batch[i], atol=1e-5)


def test_scalar_mix_and_layer_attention_formulas():
    from layerwise.encoding.combine import LayerAttention as CombineLayerAttention

    assert LayerAttention is CombineLayerAttention is lw.LayerAttention  # one attention over layers
    x = torch.randn(3, 4, 5)  # [K, batch, W]: the layer axis first
    mix = lw.ScalarMix(3)
    with torch.no_grad():
        mix.weights.copy_(torch.tensor([0.3, -1.0, 2.0])), mix.gamma.fill_(1.7)
    s = np.exp([0.3, -1.0, 2.0]) / np.exp([0.3, -1.0, 2.0]).sum()
    by_hand = 1.7 * sum(s[k] * x[k].numpy() for k in range(3))
    np.testing.assert_allclose(mix(x).detach().numpy(), by_hand, atol=1e-6)
    np.testing.assert_allclose(mix.mixing_weights().detach().numpy(), s, atol=1e-6)
    att = _randomise(LayerAttention(5))
    a = torch.softmax((x * att.query).sum(-1) / 5**0.5, dim=0)  # [K, batch]
    assert torch.allclose(att.weights(x), a, atol=1e-6)
    assert torch.allclose(att(x), (a[..., None] * x).sum(0), atol=1e-6)
    assert torch.allclose(LayerAttention(5)(x), x.mean(0), atol=1e-6)  # zero query: the mean of the layers


@pytest.mark.parametrize(
    "combine,dim", [("concat", 12), ("sum", 4), ("mean", 4), ("weighted", 4), ("scalar_mix", 4), ("attention", 4)]
)
def test_layer_head_shapes_and_combine(combine, dim):
    weights = [0.2, -0.3, 1.5] if combine == "weighted" else None
    head = _randomise(
        LayerHead(
            HeadConfig(labels=["a", "b", "c"], combine=combine, weights=weights, classifier="mlp", hidden=[7]), 3, 4
        )
    )
    x = torch.randn(5, 3, 4)  # LayerHead.combine takes the layers second-to-last: [batch, K, W]
    assert head.combine(x).shape == (5, dim) and head(x).shape == (5, 3)
    assert head.classifier[1].in_features == dim
    expected = {"concat": x.flatten(1), "sum": x.sum(1), "mean": x.mean(1)}.get(combine)
    if combine == "weighted":
        expected = 0.2 * x[:, 0] - 0.3 * x[:, 1] + 1.5 * x[:, 2]
        assert head.mix is None  # fixed weights: nothing learned to mix
    if combine == "scalar_mix":
        assert isinstance(head.mix, lw.ScalarMix)
        expected = head.mix.gamma * (torch.softmax(head.mix.weights, 0)[None, :, None] * x).sum(1)
    if combine == "attention":
        assert isinstance(head.mix, LayerAttention)
        a = torch.softmax((x * head.mix.query).sum(-1) / 4**0.5, dim=1)  # [batch, K]
        expected = (a[..., None] * x).sum(1)
    assert torch.allclose(head.combine(x), expected, atol=1e-6)
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, 4\]"):
        head(torch.randn(5, 2, 4))


def test_per_layer_logits_are_the_weighted_sum_of_each_layers_logits():
    head = _randomise(LayerHead(HeadConfig(labels=["a", "b"], classifier="per_layer"), 3, 4))
    x, y = torch.randn(6, 3, 4), torch.tensor([0, 1, 1, 0, 1, 0])
    own = [head.layer_classifiers[k](x[:, k]) for k in range(3)]
    w = torch.softmax(head.layer_logit_weights, 0)
    mixed = sum(w[k] * own[k] for k in range(3))
    assert head.per_layer_logits(x).shape == (6, 3, 2)
    assert torch.allclose(head(x), mixed, atol=1e-6)
    assert torch.allclose(head.layer_weights(), w.detach()) and abs(float(w.detach().sum()) - 1) < 1e-6
    aux = sum(F.cross_entropy(o, y) for o in own) / 3
    assert torch.allclose(head.loss(x, y), F.cross_entropy(mixed, y) + aux, atol=1e-6)


def test_attention_pool_head_needs_a_mask_and_mean_max_doubles_width(env):
    head = LayerHead(HeadConfig(labels=["a", "b"], pool="attention"), 2, 4)
    with pytest.raises(ValueError, match="needs token features"):
        head(torch.randn(3, 5, 2, 4))
    clf = SequenceClassifier(
        HeadConfig(labels=["a", "b"], model=env["model"], layers="-2:", pool="mean_max"), env["ex"]
    )
    assert (clf.head.num_layers, clf.head.width) == (2, 64) and clf.features(["paris"])[0].shape == (1, 2, 64)


def test_same_seed_same_weights_other_seed_other_weights(env):
    runs = [fit(env, classifier="mlp", dropout=0.3, epochs=2, seed=s).classifier.head.state_dict() for s in (5, 5, 6)]
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    assert any(not torch.equal(runs[0][k], runs[2][k]) for k in runs[0])


def test_training_leaves_global_rng_state_alone_and_same_seed_same_weights(env):
    random.seed(11), np.random.seed(11), torch.manual_seed(11)
    before = random.getstate(), np.random.get_state(), torch.get_rng_state()
    first = fit(env, classifier="mlp", dropout=0.3, pool="attention", combine="scalar_mix", epochs=2, seed=3)
    after = random.getstate(), np.random.get_state(), torch.get_rng_state()
    assert after[0] == before[0]
    assert after[1][0] == before[1][0] and np.array_equal(after[1][1], before[1][1]) and after[1][2:] == before[1][2:]
    assert torch.equal(after[2], before[2])
    torch.rand(7), np.random.rand(3), random.random()  # other global state: the same seed still gives the same model
    second = fit(env, classifier="mlp", dropout=0.3, pool="attention", combine="scalar_mix", epochs=2, seed=3)
    a, b = first.classifier.head.state_dict(), second.classifier.head.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [{k: v for k, v in e.items() if k != "seconds"} for e in first.log] == [
        {k: v for k, v in e.items() if k != "seconds"} for e in second.log
    ]


def test_second_run_reuses_the_feature_cache(env, tmp_path, monkeypatch):
    import layerwise.heads.data as data

    fit(env, cache=tmp_path, layers=-1, epochs=1)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    statuses = []
    real = data.extract
    monkeypatch.setattr(data, "extract", lambda *a, **k: statuses.append(real(*a, **k).status) or None)
    fit(env, cache=tmp_path, layers=[0, 1], epochs=1)
    assert statuses == ["already_complete", "already_complete"]
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before


def test_feature_cache_is_keyed_by_content_not_path(env, tmp_path, monkeypatch):
    import layerwise.heads.data as data

    cache = tmp_path / "cache"
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    first_copy, second_copy = tmp_path / "a" / "train.tsv", tmp_path / "b" / "copy.tsv"
    shutil.copyfile(env["train"], first_copy), shutil.copyfile(env["train"], second_copy)
    first = fit(env, cache=cache, layers=-1, epochs=2, files=(first_copy, env["dev"]))
    stores = set(cache.iterdir())
    assert len(stores) == 2  # train and dev
    before = {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()}
    calls = []
    real = data.extract
    monkeypatch.setattr(data, "extract", lambda *a, **k: calls.append((a[0], real(*a, **k).status)) or None)

    again = fit(env, cache=cache, layers=-1, epochs=2, files=(second_copy, env["dev"]))  # same bytes, other path/name
    assert calls == [(second_copy, "already_complete"), (env["dev"], "already_complete")]
    assert set(cache.iterdir()) == stores
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*") if p.is_file()} == before
    assert again.dev == first.dev and again.dev["accuracy"] == first.dev["accuracy"]

    lines = second_copy.read_text().splitlines(keepends=True)
    text, label = lines[1].rstrip("\n").split("\t")
    edits = {"label": f"{text}\t{'neg' if label == 'pos' else 'pos'}\n", "text": f"{text} paris\t{label}\n"}
    for what, line in edits.items():  # one label, or one text, edited: a new store, extracted from scratch
        second_copy.write_text("".join([lines[0], line, *lines[2:]]))
        calls.clear()
        fit(env, cache=cache, layers=-1, epochs=1, files=(second_copy, env["dev"]))
        assert calls == [(second_copy, "complete"), (env["dev"], "already_complete")], what
        new = set(cache.iterdir()) - stores
        assert len(new) == 1, (what, new)
        (store,) = map(lw.open_store, new)
        assert store.complete and len(store) == 48
        assert store.column("label")[0] == line.rstrip("\n").split("\t")[1], what
        stores |= new


@pytest.mark.parametrize("pool", ["max", "attention"])
def test_cached_training_features_equal_inference_features(env, tmp_path, pool):
    clf = fit(env, cache=tmp_path, layers=[2, 0], pool=pool, epochs=1).classifier
    (store,) = [
        s
        for s in map(lw.open_store, tmp_path.iterdir())
        if s.manifest["input"]["path"] == os.path.abspath(env["train"])
    ]
    assert store.spec.pool == (None if pool == "attention" else pool)  # attention: token features, pooled by the head
    cached = frozen_features(store, clf.layers, "label")
    texts = read_labelled(env["train"]).texts
    x, mask = clf.features(texts)
    if pool == "attention":
        cx, cmask = cached.batch(torch.arange(len(texts)))
        assert torch.equal(cmask, mask)
        assert torch.allclose(cx, x, atol=1e-5)
    else:
        assert torch.allclose(cached.x, x, atol=1e-5)


def test_per_layer_and_scalar_mix_report_layer_weights(env):
    result = fit(env, three=True, classifier="per_layer")
    clf, dev = result.classifier, read_labelled(env["dev3"])
    assert [e["layer"] for e in result.layers] == [0, 1, 2]
    assert abs(sum(e["weight"] for e in result.layers) - 1) < 1e-5
    own = clf.head.per_layer_logits(clf.features(dev.texts)[0]).argmax(-1)  # [n, K]
    gold = torch.tensor([clf.labels.index(y) for y in dev.labels])
    for k, entry in enumerate(result.layers):
        assert entry["dev_accuracy"] == pytest.approx(float((own[:, k] == gold).float().mean()))
    mix = fit(env, combine="scalar_mix", epochs=2)
    assert [set(e) for e in mix.layers] == [{"layer", "weight"}] * 3
    assert [e["weight"] for e in mix.layers] == pytest.approx(mix.classifier.head.mix.mixing_weights().tolist())
    assert fit(env, epochs=1).layers == []


def test_iter_predict_streams_batch_by_batch(env, monkeypatch):
    clf = SequenceClassifier(HeadConfig(labels=["neg", "pos"], model=env["model"]), env["ex"])
    texts = [f"paris {w}" for w in FILLER[:10]]
    want = clf.predict_proba(texts)
    calls, real = [], lw.Extractor.encode
    monkeypatch.setattr(lw.Extractor, "encode", lambda self, t, *a, **k: calls.append(len(t)) or real(self, t, *a, **k))
    stream = clf.iter_predict(texts, batch_size=4)
    labels, probs = next(stream)
    assert calls == [4] and probs.shape == (4, 2)
    rest = list(stream)
    assert calls == [4, 4, 2]
    np.testing.assert_allclose(np.concatenate([probs] + [p for _, p in rest]), want, atol=1e-6)
    assert labels == [clf.labels[i] for i in want[:4].argmax(1)]
    np.testing.assert_allclose(want.sum(1), 1, atol=1e-6)
    assert clf.predict_proba([]).shape == (0, 2)


def test_head_config_json_round_trip(tmp_path):
    cfg = HeadConfig(
        labels=["x", "y", "z"],
        layers=[0, 2],
        pool="max",
        combine="attention",
        classifier="mlp",
        hidden=[8, 4],
        activation="gelu",
        dropout=0.25,
        mode="finetune",
        model=lw.ModelOptions(max_length=32),
    )
    assert HeadConfig.from_json(cfg.to_json()) == cfg
    cfg.to_json(tmp_path / "c.json")
    assert HeadConfig.from_json(tmp_path / "c.json") == cfg
    flat = {k: v for k, v in json.loads(cfg.to_json()).items() if k != "encode"}  # a layerwise 0.1 (flat) config
    assert HeadConfig.from_dict({**flat, "layers": [0, 2], "pool": "max", "combine": "attention"}) == cfg
    # a config written by layerwise 0.x: the model a path (null: the default), the window beside it, the spec's
    # output dtype named "dtype"
    old = {**flat, "model": None, "max_length": 32, "encode": {**json.loads(cfg.to_json())["encode"]}}
    old["encode"]["dtype"] = old["encode"].pop("output_dtype")
    assert HeadConfig.from_dict(old) == cfg and HeadConfig.from_dict(old).options.max_length == 32
    with pytest.raises(ValueError, match="unknown HeadConfig field.*'poool'.*valid fields are"):
        HeadConfig.from_dict({"poool": "max"})
    with pytest.raises(AttributeError):  # frozen, like every config
        cfg.dropout = 0.5  # type: ignore[misc]


def test_head_config_keeps_its_encode_spec_through_json(tmp_path):
    cfg = HeadConfig(
        labels=["neg", "pos"],
        layers="-2:",
        site="block",
        pool="mean_max",
        combine="weighted",
        weights=[0.25, 0.75],
        classifier="mlp",
        hidden=[8],
    )
    assert isinstance(cfg.encode, lw.EncodeSpec)
    assert (cfg.layers, cfg.site, cfg.pool, cfg.combine, cfg.weights) == (
        "-2:",
        "block",
        "mean_max",
        "weighted",
        (0.25, 0.75),
    )
    data = json.loads(cfg.to_json())
    assert isinstance(data["encode"], dict) and data["encode"] == cfg.encode.to_dict()
    assert data["encode"]["combine"] == "weighted" and data["encode"]["weights"] == [0.25, 0.75]
    assert not {"layers", "site", "pool", "combine", "weights"} & set(data)  # nested, not flat
    again = HeadConfig.from_json(cfg.to_json())
    assert again.encode == cfg.encode and again == cfg
    cfg.to_json(tmp_path / "c.json")
    assert HeadConfig.from_json(tmp_path / "c.json").encode == cfg.encode
    assert HeadConfig(encode=cfg.encode, labels=["neg", "pos"], classifier="mlp", hidden=[8]) == cfg
    for name in ("layers", "site", "pool", "combine", "weights"):
        with pytest.raises(AttributeError):  # read-only views of the spec
            setattr(cfg, name, getattr(cfg, name))


def test_head_config_missing_file_stack_and_weighted(env, tmp_path):
    with pytest.raises(ValueError) as info:
        HeadConfig.from_json("/no/such/config.json")
    assert "/no/such/config.json" in str(info.value) and "does not exist" in str(info.value)
    with pytest.raises(ValueError, match="stack"):
        HeadConfig(combine="stack")
    result = fit(env, combine="weighted", weights=[0.5, 0.5], layers="-2:", patience=10, output=tmp_path / "m")
    losses = [e["loss"] for e in result.log]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    assert result.dev["accuracy"] >= 0.75
    head = result.classifier.head
    assert result.classifier.layers == (1, 2) and head.mix is None and result.layers == []
    x = torch.randn(3, 2, head.width)
    assert torch.allclose(head.combine(x), 0.5 * x[:, 0] + 0.5 * x[:, 1], atol=1e-6)
    texts = read_labelled(env["dev"]).texts
    loaded = load(tmp_path / "m", model=env["ex"])
    assert loaded.config.weights == (0.5, 0.5) and loaded.config.combine == "weighted"
    np.testing.assert_allclose(loaded.predict_proba(texts), result.classifier.predict_proba(texts), atol=1e-6)
    with pytest.raises(ValueError, match="2 weights for 3 selected layers"):  # one weight per layer, checked on build
        fit(env, combine="weighted", weights=[0.5, 0.5], layers="all", epochs=1)


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(pool="avg"), "unknown pool 'avg'. Valid pool values are: cls, mean, max, mean_max, last, attention"),
        (
            dict(combine="median"),
            "unknown combine 'median'. Valid combine values are: concat, sum, mean, weighted, scalar_mix, attention",
        ),
        (
            dict(combine="stack"),
            (
                "combine='stack' keeps the layer axis, which a classifier cannot read; use concat, sum, "
                "mean, weighted, scalar_mix or attention, or classifier='per_layer'"
            ),
        ),
        (dict(classifier="svm"), "unknown classifier 'svm'. Valid classifier values are: linear, mlp, per_layer"),
        (dict(activation="swish"), "unknown activation 'swish'. Valid activation values are: relu, gelu, tanh"),
        (dict(mode="lora"), "unknown mode 'lora'. Valid mode values are: frozen, finetune"),
        (dict(dropout=1.0), "dropout must be in [0, 1), got 1.0"),
        (dict(hidden=[0]), "positive ints (MLP layer sizes), got [0]"),
        (dict(classifier="mlp", hidden=[]), "needs at least one hidden size"),
        (dict(labels=["x"]), "at least 2 labels"),
        (
            dict(classifier="per_layer", pool="attention"),
            "needs a per-layer pool (cls, mean, max, mean_max, last), not 'attention'",
        ),
    ],
)
def test_head_config_rejects_bad_values(kw, message):
    with pytest.raises(ValueError) as info:
        HeadConfig(**kw)
    assert message in str(info.value)


def test_labels_unknown_single_class_and_sorting():
    with pytest.raises(
        ValueError, match=r"\['maybe'\] that the model was not trained on; known labels are: \['neg', 'pos'\]"
    ):
        encode_labels(["pos", "maybe"], ["neg", "pos"], "dev")
    with pytest.raises(ValueError, match="single class \\('pos'\\)"):
        label_map(["pos", "pos"])
    assert label_map(["10", "2", "-1", "2"]) == ["-1", "2", "10"]


@pytest.mark.parametrize(
    "name,content,message",
    [
        (
            "nolabel.tsv",
            "text\tsentiment\nparis\tpos\nlamb\tneg\n",
            "has no column 'label'; its columns are ['text', 'sentiment']",
        ),
        ("notext.csv", "body,label\nparis,pos\nlamb,neg\n", "has no 'text' or 'sentence' column"),
        ("single.tsv", "text\tlabel\nparis\tpos\nlamb\tpos\n", "single class ('pos')"),
        ("empty.tsv", "", "holds no usable record"),
        ("header.tsv", "text\tlabel\n", "holds no usable record"),
        (
            "bad.jsonl",
            '{"text": "", "label": "pos"}\nnot json\n{"text": 3, "label": "neg"}\n',
            "holds no usable record",
        ),
        (
            "dev-unk.tsv",
            "text\tlabel\nparis\tpos\nlamb\tmaybe\n",
            "dev file {dev!r} has label(s) ['maybe'] that the model was not trained on; "
            "known labels are: ['neg', 'pos']",
        ),
    ],
)
@pytest.mark.parametrize("mode", ["frozen", "finetune"])
def test_bad_training_files(env, tmp_path, name, content, message, mode):
    bad = tmp_path / name
    bad.write_text(content)
    files = (env["train"], bad) if name.startswith("dev") else (bad, env["dev"])
    with pytest.raises(ValueError) as info:
        train(
            HeadConfig(model=env["model"], mode=mode),
            *files,
            model=env["ex"],
            options=TrainOptions(cache_dir=tmp_path / "c", epochs=1, progress=False),
            **QUIET,
        )
    assert message.format(dev=str(bad)) in str(info.value)


def test_frozen_mode_skips_records_without_a_label(env, tmp_path):
    (tmp_path / "holes.tsv").write_text("text\tlabel\nparis paris\tpos\nlamb lamb\tneg\nparis lamb\t\nlamb\tneg\n")
    result = train(
        HeadConfig(model=env["model"]),
        tmp_path / "holes.tsv",
        env["dev"],
        model=env["ex"],
        options=TrainOptions(cache_dir=tmp_path / "c", epochs=1, progress=False),
        **QUIET,
    )
    assert result.classifier.labels == ["neg", "pos"]


@pytest.mark.parametrize(
    "kw,message",
    [
        (dict(epochs=0), "epochs must be a positive int, got 0"),
        (dict(lr=-1.0), "lr must be a positive number (e.g. 1e-3), got -1.0"),
        (dict(batch_size=1.5), "batch_size must be a positive int"),
        (dict(metric="f1"), "Valid metrics are: accuracy, macro_f1"),
    ],
)
def test_bad_training_options_fail_before_any_compute(env, tmp_path, kw, message):
    with pytest.raises(ValueError) as info:  # TrainOptions refuses them when it is built: before train() runs at all
        train(
            HeadConfig(model=env["model"]),
            env["train"],
            env["dev"],
            model=env["ex"],
            options=TrainOptions(cache_dir=tmp_path / "c", **kw),
            **QUIET,
        )
    assert message in str(info.value) and not (tmp_path / "c").exists()
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainOptions(**kw)
    with pytest.raises(dataclasses.FrozenInstanceError):  # options cannot be changed after their check
        TrainOptions().epochs = 0
