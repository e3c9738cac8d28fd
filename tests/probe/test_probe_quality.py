"""Probes that measure the layer: converged (as scikit-learn's LogisticRegression), chosen without the reported
split, with bootstrap intervals, and control tasks (issue 38)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerwise.probe.control import control_splits
from layerwise.probe.data import ProbeSplit
from layerwise.probe.linear import _moments, fit_linear
from layerwise.probe.models import ProbeSpec
from layerwise.probe.train import ProbeOptions, fit_probe
from layerwise.probe.uncertainty import interval, item_counts, resample_weights, resampled, score


def _features(n: int, classes: int, width: int = 24, layers: int = 3, seed: int = 0, signal: float = 1.0):
    """``[n, layers, width]`` float16 features whose layer ``k`` carries the label with strength ``k * signal``,
    one large outlier dimension (as hidden states have), and the labels."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    centres = np.random.default_rng(classes).normal(size=(classes, width))  # one task: the same for every split
    x = rng.normal(size=(n, layers, width))
    for k in range(layers):
        x[:, k] += k * signal * centres[y] * 0.6
    x[:, :, 0] *= 40
    return torch.tensor(x, dtype=torch.float16), y


def _sentence_split(x, y, names):
    return ProbeSplit(x, [names[i] for i in y], None, store=None)


def _tagging_split(x, y, names, length=6):
    offsets = np.arange(0, len(y) + 1, length)
    offsets[-1] = len(y)
    return ProbeSplit(x, [names[i] for i in y], offsets, store=None)


def _sklearn_score(train_x, train_y, dev_x, dev_y, strength):
    from sklearn.linear_model import LogisticRegression

    z = train_x.float().numpy()
    mean, scale = _moments(z)
    model = LogisticRegression(C=strength, max_iter=1000).fit((z - mean) / scale, train_y)
    return float((model.predict((dev_x.float().numpy() - mean) / scale) == dev_y).mean())


@pytest.mark.parametrize("task, classes", [("sentence", 2), ("sentence", 4), ("tagging", 5)])
def test_linear_probe_matches_scikit_learn_on_every_layer(task, classes):
    """Every layer's probe: the strength it chose, given to scikit-learn's LogisticRegression on the same
    (standardised) features, scores within 0.2 points; both solvers (scikit-learn, torch L-BFGS) converge."""
    names = [f"c{i}" for i in range(classes)]
    x, y = _features(600, classes, seed=1)
    dx, dy = _features(300, classes, seed=2)
    make = _tagging_split if task == "tagging" else _sentence_split
    train, dev = make(x, y, names), make(dx, dy, names)
    for layer in range(x.shape[1]):
        spec = ProbeSpec(f"layer {layer}", "layer", (layer,), "concat")
        run = fit_probe(spec, train, dev, None, task=task, labels=names, scheme="none", opts=ProbeOptions(), seed=0)
        fit = run.fit
        assert fit["converged"] and fit["solver"] == "scikit-learn lbfgs" and fit["grad_norm"] < 1e-2
        want = _sklearn_score(x[:, layer], y, dx[:, layer], dy, fit["C"])
        assert abs(run.dev["accuracy"] - want) <= 0.002, (layer, run.dev["accuracy"], want)
        # the torch solver (large sets, learned mixes) reaches scikit-learn's optimum: the same weights, and the
        # same score wherever the layer carries the label (on a layer without signal every prediction is a near tie)
        sk = fit_linear(x[:, [layer]], y, classes, strengths=(fit["C"],), solver="sklearn")
        th = fit_linear(x[:, [layer]], y, classes, strengths=(fit["C"],), solver="torch")
        assert th.converged and sk.converged
        assert np.linalg.norm(th.weight - sk.weight) <= 0.02 * np.linalg.norm(sk.weight) + 1e-4, layer
        if layer > 0:
            got = float((th.predict(dx[:, [layer]]) == dy).mean())
            assert abs(got - want) <= 0.002, (layer, got, want)


def test_the_strength_is_chosen_on_train_by_cross_validation():
    """Weak features want strong regularisation, strong features weak; the choice is the best cross-validated
    accuracy on train, recorded for every strength tried."""
    x, y = _features(400, 3, seed=3, signal=2.0)
    fit = fit_linear(x[:, [2]], y, 3)
    assert 3 <= len(fit.scores) <= 10 and fit.scores[fit.strength] == max(fit.scores.values())
    assert list(fit.scores) == sorted(fit.scores)  # scanned from the strongest regularisation up
    assert fit.report()["C"] == fit.strength and fit.report()["converged"]


@pytest.mark.parametrize("probe", ["linear", "mlp"])
def test_selection_never_reads_the_reported_split(probe):
    """Poisoned dev labels (shuffled) change the dev score, never what was chosen: the linear probe's strength and
    iterations, the MLP's stopping step, the predictions."""
    names = ["a", "b", "c"]
    x, y = _features(600, 3, seed=4)  # 60 records held out of train for the MLP to stop on
    dx, dy = _features(120, 3, seed=5)
    train, dev = _sentence_split(x, y, names), _sentence_split(dx, dy, names)
    poisoned = _sentence_split(dx, np.random.default_rng(0).permutation(dy), names)
    spec = ProbeSpec("layer 2", "layer", (2,), "concat")
    opts = ProbeOptions(probe=probe, hidden=16)
    clean = fit_probe(spec, train, dev, None, task="sentence", labels=names, scheme="none", opts=opts, seed=0)
    dirty = fit_probe(spec, train, poisoned, None, task="sentence", labels=names, scheme="none", opts=opts, seed=0)
    assert clean.fit == dirty.fit and clean.predictions == dirty.predictions
    assert clean.dev["accuracy"] != dirty.dev["accuracy"]
    if probe == "mlp":
        assert clean.fit["held_out_items"] == 60


def test_intervals_cover_the_score_and_narrow_with_more_items():
    rng = np.random.default_rng(0)
    gold = list(rng.integers(0, 2, 2000).astype(str))
    pred = [g if rng.random() < 0.8 else ("1" if g == "0" else "0") for g in gold]
    counts = item_counts(gold, pred, "accuracy")
    full = float(score(counts.sum(0)))
    lo, hi = interval(resampled(counts, resample_weights(len(counts))))
    assert lo < full < hi and 0.01 < hi - lo < 0.05
    small = item_counts(gold[:200], pred[:200], "accuracy")
    lo2, hi2 = interval(resampled(small, resample_weights(len(small))))
    assert hi2 - lo2 > hi - lo


def test_entity_f1_from_sentence_counts_is_seqevals():
    from seqeval.metrics import f1_score

    gold = [["B-PER", "I-PER", "O", "B-LOC"], ["O", "B-ORG"], ["I-MISC", "O"]]
    pred = [["B-PER", "I-PER", "O", "O"], ["B-ORG", "B-ORG"], ["I-MISC", "O"]]
    counts = item_counts(gold, pred, "entity F1")
    assert float(score(counts.sum(0))) == pytest.approx(f1_score(gold, pred))


def test_run_intervals_cover_the_scikit_learn_score():
    """The run's reported interval for a layer holds scikit-learn's score of the same probe on the same split."""
    from layerwise.probe.run import _gold_items, _predicted

    names = ["a", "b"]
    x, y = _features(400, 2, seed=6, signal=0.5)
    dx, dy = _features(400, 2, seed=7, signal=0.5)
    train, dev = _sentence_split(x, y, names), _sentence_split(dx, dy, names)
    run = fit_probe(ProbeSpec("layer 1", "layer", (1,), "concat"), train, dev, None, task="sentence", labels=names,
                    scheme="none", opts=ProbeOptions(), seed=0)
    counts = item_counts(_gold_items(dev, "sentence"), _predicted(run, "dev", names, dev, "sentence"), "accuracy")
    lo, hi = interval(resampled(counts, resample_weights(len(counts))))
    assert lo <= _sklearn_score(x[:, 1], y, dx[:, 1], dy, run.fit["C"]) <= hi


def test_control_task_selectivity_is_near_zero_on_random_features():
    """Features with no information: the task and its control are both at chance, selectivity about 0; on
    informative features the task is far above its control."""
    names = ["a", "b", "c"]
    rng = np.random.default_rng(8)
    for informative, low, high in ((False, -0.1, 0.1), (True, 0.3, 1.0)):
        x, y = _features(1000, 3, seed=9, signal=2.0 if informative else 0.0)
        dx, dy = _features(600, 3, seed=10, signal=2.0 if informative else 0.0)
        if not informative:
            y, dy = rng.integers(0, 3, 1000), rng.integers(0, 3, 600)
        splits = {"train": _sentence_split(x, y, names), "dev": _sentence_split(dx, dy, names)}
        control = control_splits(splits)
        assert set(control["train"].labels) <= set(names) and len(control["dev"]) == 600
        spec = ProbeSpec("layer 2", "layer", (2,), "concat")
        task = fit_probe(spec, splits["train"], splits["dev"], None, task="sentence", labels=names, scheme="none",
                         opts=ProbeOptions(), seed=0).dev["accuracy"]
        ctrl = fit_probe(spec, control["train"], control["dev"], None, task="sentence",
                         labels=sorted(set(control["train"].labels)), scheme="none", opts=ProbeOptions(),
                         seed=0).dev["accuracy"]
        assert low <= task - ctrl <= high, (informative, task, ctrl)


def test_mlp_budget_follows_the_data():
    opts = ProbeOptions(probe="mlp")
    assert opts.budget(4) == (300, 10)  # a small set: the minimum number of steps
    assert opts.budget(100)[0] == 4000 and opts.budget(10_000)[0] == 20_000
    assert ProbeOptions(probe="mlp", epochs=3).budget(50) == (150, 25)


def test_patience_follows_the_budget():
    """A quarter of the checks (at least 3): a noisy held-out score on a small set does not stop a head after
    4 of its 40 epochs."""
    from layerwise.heads import TrainOptions
    from layerwise.training.budget import patience_for

    assert patience_for(40) == 10 and patience_for(4) == 3
    assert TrainOptions().patience is None and TrainOptions().epochs_for(32, "frozen") == 40
    assert TrainOptions().epochs_for(32, "finetune") == 10 and TrainOptions(epochs=2).epochs_for(32, "frozen") == 2
    with pytest.raises(Exception, match="patience must be a positive int, got 0"):
        TrainOptions(patience=0)
    with pytest.raises(Exception, match="held_out must be a share of the training records"):
        TrainOptions(held_out=1.5)


def test_linear_probe_errors_name_the_valid_values():
    x, y = _features(20, 2)
    with pytest.raises(Exception, match="Valid values are: concat, sum, scalar_mix"):
        fit_linear(x, y, 2, "mean")
    with pytest.raises(Exception, match="sklearn, torch"):
        fit_linear(x, y, 2, solver="liblinear")


def _noisy_copies(n: int, layers: int = 4, classes: int = 3, width: int = 48, seed: int = 0):
    """``[n, layers, width]``: every layer carries the same signal under its own noise (layer ``k``'s noise ``1 +
    0.2 k``), so a mix of them beats any one; one large outlier dimension, as hidden states have."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n)
    centres = np.random.default_rng(5).normal(size=(classes, width))
    x = np.stack([0.35 * centres[y] + rng.normal(size=(n, width)) * (1 + 0.2 * k) for k in range(layers)], 1)
    x[:, :, 0] *= 40
    return x.astype(np.float32), y


def test_a_learned_mix_is_at_least_the_uniform_mix_of_its_layers():
    """The learned scalar mix reaches a training objective no higher than the probe on the uniform mean of the same
    standardised layers (what scikit-learn would fit on it), at the same strength; it spreads its weight over layers
    that all help, leaning on the least noisy, instead of collapsing onto one (0.9999 on one layer before)."""
    x, y = _noisy_copies(3000)
    mix = fit_linear(x, y, 3, "scalar_mix")
    mean, scale = _moments(x)
    uniform = fit_linear(((x - mean) / scale).mean(1)[:, None, :], y, 3, strengths=(mix.strength,), solver="torch")
    assert mix.objective <= uniform.objective + 1e-6
    singles = [fit_linear(x[:, [k]], y, 3, strengths=(mix.strength,)).objective for k in range(4)]
    assert mix.objective < min(singles)
    assert mix.mix.max() < 0.6 and int(np.argmax(mix.mix)) == 0  # spread out, most on the least noisy layer
    assert set(mix.starts) == {"uniform", "lean on input 0"} and mix.report()["starts"]
    np.testing.assert_array_equal(mix.predict(x[:50]), mix.logits(x[:50]).argmax(1))


def test_a_learned_mix_that_validates_below_the_uniform_mix_gives_way_to_it(monkeypatch):
    """The learned mix is checked on the strength scan's held-out folds against the uniform mix fitted on the same
    rows: where it scores lower there (here a learned fit that has lost its weights), the uniform mix is the fit, and
    the report says which was kept and on how many rows."""
    import layerwise.probe.linear as linear

    x, y = _noisy_copies(1500)
    honest = fit_linear(x, y, 3, "scalar_mix")
    v = honest.mix_validation
    assert v["kept"] == "learned" and v["rows"] == 1500 and 0.5 < v["uniform"] <= v["learned"] <= 1
    assert honest.report()["mix_validation"] == v
    real = linear.solve

    def broken(problem, strength, **kwargs):  # every learned mix's fit loses its weights (its objective kept)
        sol = real(problem, strength, **kwargs)
        if kwargs.get("learn_mix"):
            sol.bias[:] = np.array([5.0, -5.0, -5.0], dtype=np.float32)  # always class 0
        return sol

    monkeypatch.setattr(linear, "solve", broken)
    fit = fit_linear(x, y, 3, "scalar_mix")
    assert fit.mix_validation["kept"] == "uniform" and fit.mix_validation["learned"] < fit.mix_validation["uniform"]
    np.testing.assert_allclose(fit.mix, 0.25)
    assert (fit.predict(x) == y).mean() > 0.7  # the uniform mix's probe, not the broken one


def test_the_table_says_how_c_was_chosen_what_the_control_is_and_flags_one_hot_mixes():
    from types import SimpleNamespace

    from layerwise.probe.report import method_note, one_hot_layer

    collapsed = {"name": "weighted sum last 4", "layers": [3, 4, 5, 6], "weights": [0.0, 0.9995, 0.0003, 0.0002]}
    mixed = {"name": "scalar mix all", "layers": [0, 1, 2], "weights": [0.2, 0.5, 0.3]}
    assert one_hot_layer(collapsed) == 4 and one_hot_layer(mixed) is None
    assert one_hot_layer({"name": "layer 2", "layers": [2], "weights": None}) is None
    tagging = SimpleNamespace(options={"probe": "linear", "control": False}, metric_name="entity F1", task="tagging",
                              rows=[collapsed, mixed])
    note = method_note(tagging)
    assert "chosen by cross-validated token accuracy on the training split (the table reports entity F1)" in note
    assert "weighted sum last 4 put all but 0.001 of its weight on one layer" in note
    kept = dict(mixed, fits=[{"mix_validation": {"kept": "uniform", "learned": 0.8, "uniform": 0.81}}])
    note = method_note(SimpleNamespace(options={"probe": "linear"}, metric_name="accuracy", task="sentence",
                                       rows=[kept]))
    assert "scalar mix all kept the uniform mix of its layers" in note
    sentence = SimpleNamespace(options={"probe": "linear", "control": True}, metric_name="accuracy", task="sentence",
                               rows=[mixed])
    assert "the control scores about chance" in method_note(sentence)
