"""``layerwise train | evaluate | predict`` through typer's CliRunner, on the tiny random BERT (device cpu)."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.heads import HeadConfig, load

from tiny import TOY_FILLER as FILLER  # noqa: F401
from tiny import toy


def _ok(result):
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _user_error(result) -> str:
    """A clean CLI error: exit 2, nothing on stdout, no traceback; returns stderr with wrapping undone."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stdout == "" and "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert err.startswith("error: ")
    return err


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_dirs):
    root = tmp_path_factory.mktemp("heads_cli")
    files = {
        "train": root / "train.tsv",
        "dev": root / "dev.csv",
        "test": root / "test.jsonl",
        "train3": root / "train3.jsonl",
        "dev3": root / "dev3.tsv",
    }
    toy(files["train"], 48, 0), toy(files["dev"], 24, 1), toy(files["test"], 16, 4)
    toy(files["train3"], 60, 2, ("pos", "neg", "mid")), toy(files["dev3"], 30, 3, ("pos", "neg", "mid"))
    common = ["--model", str(tiny_dirs["bert"]), "--device", "cpu", "--cache-dir", str(root / "cache"), "--quiet"]
    return dict(root=root, common=common, model=str(tiny_dirs["bert"]), **files)


def train_args(env, out, *extra, train="train", dev="dev"):
    return ["train", "--train", str(env[train]), "--dev", str(env[dev]), "-o", str(out), *env["common"], *extra]


@pytest.fixture(scope="module")
def trained(runner, env):
    """The README-style run: mlp head on the last two layers, max pool, 3 epochs, with a test file."""
    out = env["root"] / "model"
    args = train_args(
        env,
        out,
        "--test",
        str(env["test"]),
        "--head",
        "mlp",
        "--layers=-2:",
        "--pool",
        "max",
        "--epochs",
        "3",
        "--seed",
        "0",
        "--lr",
        "1e-2",
    )
    return out, _ok(runner.invoke(app, args))


def test_train_prints_epochs_and_scores_and_writes_the_model_dir(env, trained):
    out, result = trained
    epochs = re.findall(r"^epoch (\d+)/3  loss \d+\.\d+  dev accuracy (\d\.\d+)", result.stderr, re.M)
    assert [e for e, _ in epochs] == ["1", "2", "3"]
    assert not re.search(r"^epoch ", result.stdout, re.M)  # per-epoch lines go to stderr only
    metrics = json.loads((out / "metrics.json").read_text())
    dev, test = metrics["dev"], metrics["test"]
    assert f"dev (best epoch {metrics['best_epoch']}): n=24  accuracy {dev['accuracy']:.4f}  macro-F1 " in result.stdout
    assert f"test: n=16  accuracy {test['accuracy']:.4f}  macro-F1 {test['macro_f1']:.4f}" in result.stdout
    assert "confusion (rows = gold, columns = predicted)" in result.stdout
    cfg = HeadConfig.from_json(out / "config.json")
    assert (cfg.classifier, cfg.pool, cfg.layers, cfg.options.model, list(cfg.labels)) == (
        "mlp",
        "max",
        "-2:",
        env["model"],
        ["neg", "pos"],
    )
    assert json.loads((out / "labels.json").read_text()) == {"neg": 0, "pos": 1}
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [e["epoch"] for e in log] == [1, 2, 3]
    assert [f"{e['dev_accuracy']:.4f}" for e in log] == [a for _, a in epochs]
    assert (out / "head.safetensors").is_file() and not (out / "encoder").exists()
    assert list((env["root"] / "cache").iterdir())  # features were cached where we said


def _by_hand(gold, pred, labels):
    conf = [[sum(g == a and p == b for g, p in zip(gold, pred)) for b in labels] for a in labels]
    per = {}
    for i, label in enumerate(labels):
        tp, npred, ngold = conf[i][i], sum(row[i] for row in conf), sum(conf[i])
        p, r = (tp / npred if npred else 0.0), (tp / ngold if ngold else 0.0)
        per[label] = {"precision": p, "recall": r, "f1": 2 * p * r / (p + r) if p + r else 0.0, "support": ngold}
    return conf, per


@pytest.mark.parametrize("three", [False, True])
def test_evaluate_agrees_with_predictions(runner, env, trained, three, tmp_path):
    if three:  # a 3-class per_layer model: also prints its learned layer weights
        out = tmp_path / "m3"
        result = _ok(
            runner.invoke(
                app,
                train_args(
                    env, out, "--head", "per_layer", "--layers", "all", "--epochs", "2", train="train3", dev="dev3"
                ),
            )
        )
        weights = json.loads(result.stdout.split("learned layer weights: ")[1].splitlines()[0])
        assert [w["layer"] for w in weights] == [0, 1, 2] and sum(w["weight"] for w in weights) == pytest.approx(1)
    out, data = (out, env["dev3"]) if three else (trained[0], env["dev"])
    scores = json.loads(_ok(runner.invoke(app, ["evaluate", str(out), str(data), "--json", "--device", "cpu"])).stdout)
    gold = lw.heads.data.read_labelled(data)
    clf = load(out, device="cpu")
    pred = clf.predict(gold.texts)
    conf, per = _by_hand(gold.labels, pred, clf.labels)
    assert scores["labels"] == clf.labels and scores["n"] == len(pred) and scores["skipped"] == 0
    assert scores["accuracy"] == pytest.approx(np.mean([g == p for g, p in zip(gold.labels, pred)]))
    assert scores["confusion"] == conf
    for label in clf.labels:
        assert scores["per_class"][label] == pytest.approx(per[label])
    assert scores["macro_f1"] == pytest.approx(np.mean([per[label]["f1"] for label in clf.labels]))
    text = _ok(runner.invoke(app, ["evaluate", str(out), str(data), "--device", "cpu"])).stdout
    assert f"accuracy {scores['accuracy']:.4f}  macro-F1 {scores['macro_f1']:.4f}" in text
    assert "precision  recall" in text and "confusion (rows = gold" in text


def test_evaluate_unknown_label_names_it_and_the_known_ones(runner, trained, tmp_path):
    (tmp_path / "odd.tsv").write_text("text\tlabel\nparis paris\tpos\nlamb lamb\tmaybe\nlamb\tneutral\n")
    err = _user_error(runner.invoke(app, ["evaluate", str(trained[0]), str(tmp_path / "odd.tsv"), "--device", "cpu"]))
    assert "['maybe', 'neutral'] that the model was not trained on; known labels are: ['neg', 'pos']" in err


def test_evaluate_refuses_a_non_model_directory(runner, env, tmp_path):
    err = _user_error(runner.invoke(app, ["evaluate", str(tmp_path), str(env["dev"]), "--device", "cpu"]))
    assert "is not a layerwise model directory (needs config.json and head.safetensors)" in err


def _check_lines(lines, clf, texts_by_line):
    """Every output line: bad records as {line, error}; good ones with argmax label and probabilities = library."""
    good = [n for n, t in texts_by_line.items() if t is not None]
    want = dict(zip(good, clf.predict_proba([texts_by_line[n] for n in good])))
    assert [doc["line"] for doc in lines] == sorted(texts_by_line)
    for doc in lines:
        if texts_by_line[doc["line"]] is None:
            assert set(doc) == {"line", "error"} and doc["error"]
            continue
        probs = [doc["probs"][label] for label in clf.labels]
        assert set(doc) == {"line", "label", "probs"} and sum(probs) == pytest.approx(1, abs=1e-5)
        assert doc["label"] == clf.labels[int(np.argmax(probs))]
        np.testing.assert_allclose(probs, want[doc["line"]], atol=2e-6)


def test_predict_jsonl_keeps_order_and_reports_bad_records_in_place(runner, env, trained, tmp_path):
    records = [
        ('{"text": "paris paris paris"}', "paris paris paris"),
        ("not json", None),
        ('{"text": "lamb lamb fox"}', "lamb lamb fox"),
        ('{"text": ""}', None),
        ('{"body": "paris"}', None),
        ('{"text": 7}', None),
        ('{"text": "monday lamb"}', "monday lamb"),
        ('{"text": "the dog"}', "the dog"),
    ]
    (tmp_path / "in.jsonl").write_text("".join(r + "\n" for r, _ in records))
    texts = {n: t for n, (_, t) in enumerate(records, 1)}
    result = _ok(
        runner.invoke(
            app, ["predict", str(trained[0]), str(tmp_path / "in.jsonl"), "--batch-size", "2", "--device", "cpu"]
        )
    )
    _check_lines([json.loads(line) for line in result.stdout.splitlines()], load(trained[0], device="cpu"), texts)


def test_predict_stdin_and_output_file(runner, trained, tmp_path):
    stdin = "paris paris lamb\n\nlamb lamb\n   \nthe fox said paris\n"
    texts = {n: (line if line.strip() else None) for n, line in enumerate(stdin.splitlines(), 1)}
    to_stdout = _ok(runner.invoke(app, ["predict", str(trained[0]), "-", "--device", "cpu"], input=stdin)).stdout
    out = tmp_path / "out.jsonl"
    result = _ok(runner.invoke(app, ["predict", str(trained[0]), "-", "-o", str(out), "--device", "cpu"], input=stdin))
    assert result.stdout == "" and out.read_text() == to_stdout
    _check_lines([json.loads(line) for line in to_stdout.splitlines()], load(trained[0], device="cpu"), texts)


def test_predict_streams_2000_texts_in_batches(runner, trained, tmp_path, monkeypatch):
    texts = [f"{random.Random(i).choice(['paris', 'lamb'])} {FILLER[i % len(FILLER)]} {i}" for i in range(2000)]
    (tmp_path / "many.txt").write_text("\n".join(texts) + "\n")
    want = load(trained[0], device="cpu").predict(texts)
    calls, real = [], lw.Extractor.encode
    monkeypatch.setattr(lw.Extractor, "encode", lambda self, t, *a, **k: calls.append(len(t)) or real(self, t, *a, **k))
    result = _ok(
        runner.invoke(
            app, ["predict", str(trained[0]), str(tmp_path / "many.txt"), "--batch-size", "100", "--device", "cpu"]
        )
    )
    docs = [json.loads(line) for line in result.stdout.splitlines()]
    assert [d["line"] for d in docs] == list(range(1, 2001))
    assert [d["label"] for d in docs] == want
    assert calls == [100] * 20


@pytest.mark.parametrize(
    "extra,message",
    [
        (
            ["--head", "per_layer", "--pool", "attention"],
            "needs a per-layer pool (cls, mean, max, mean_max, last), not 'attention'",
        ),
        (["--pool", "avg"], "unknown pool 'avg'. Valid pool values are: cls, mean, max, mean_max, last, attention"),
        (["--combine", "stack"], "combine='stack' keeps the layer axis, which a classifier cannot read"),
        (["--combine", "avg"], "Valid combine values are: concat, sum, mean, weighted, scalar_mix, attention"),
        (["--head", "svm"], "unknown --head 'svm'. Valid values are: linear, mlp, per_layer"),
        (["--head", "mlp", "--hidden", "abc"], "--hidden item 'abc' is not a positive int; give layer sizes like"),
        (["--head", "mlp", "--hidden", "64,0"], "--hidden item '0' is not a positive int"),
        (["--combine", "weighted", "--weights", "1,x"], "--weights item 'x' is not a number"),
        (["--mode", "lora"], "unknown --mode 'lora'. Valid values are: frozen, finetune"),
        (["--activation", "swish"], "unknown --activation 'swish'. Valid values are: relu, gelu, tanh"),
        (["--dropout", "1.5"], "dropout must be in [0, 1), got 1.5"),
        (["--metric", "f1"], "unknown --metric 'f1'. Valid values are: accuracy, macro_f1"),
        (["--epochs", "0"], "epochs must be a positive int, got 0"),
        (["--lr", "0"], "lr must be a positive number (e.g. 1e-3), got 0.0"),
        (["--label-column", "sentiment"], "has no column 'sentiment'; its columns are ['text', 'label']"),
        (["--text-column", "body"], "has no column 'body'"),
        (["--layers", "9"], "layer 9 in layer spec 9 is out of range"),
    ],
)
def test_train_bad_options_are_clean_errors(runner, env, tmp_path, extra, message):
    err = _user_error(runner.invoke(app, train_args(env, tmp_path / "m", *extra)))
    assert message in err and not (tmp_path / "m").exists()


CONLLU = "".join(
    f"# sent_id = {n}\n1\t{a}\t{a}\tPROPN\tNNP\t_\t2\tnsubj\t_\t_\n2\t{b}\t{b}\tVERB\tVBZ\t_\t0\troot\t_\t_\n"
    f"3\t{c}\t{c}\tNOUN\tNN\t_\t2\tobj\t_\t_\n\n"
    for n, (a, b, c) in enumerate([("Paris", "loves", "lamb"), ("EU", "rejects", "call"), ("Peter", "writes", "code")]
                                  * 40)
)


@pytest.mark.parametrize("extra", [[], ["--label-column", "upos"]])
def test_train_on_word_tags_names_probe_tagging(runner, env, tmp_path, extra):
    """``train --train ud.conllu --label-column upos`` took each sentence's tag list as one label and printed a 110 KB
    line; without --label-column it blamed a --keep never passed. Now: refused before the model loads, in one short
    line naming the file, what it holds and ``layerwise probe --task tagging``."""
    (tmp_path / "ud.conllu").write_text(CONLLU)
    args = train_args(env, tmp_path / "m", *extra)
    args[args.index(str(env["train"]))] = str(tmp_path / "ud.conllu")
    err = _user_error(runner.invoke(app, args))
    assert "the training file" in err and "ud.conllu' is CoNLL-U, a tag per word" in err, err
    assert "one label per record" in err and "layerwise probe --task tagging --column upos" in err
    assert "--keep" not in err and len(err) < 600
    assert not (tmp_path / "m").exists()


def test_a_list_as_a_label_is_refused_in_one_short_line(runner, env, tmp_path):
    """A JSONL whose label column holds a list (a tag per word) is refused naming the line, not printed whole."""
    rows = [{"text": f"word {i} " * 5, "label": ["NOUN"] * 2000 if i == 3 else ["pos", "neg"][i % 2]}
            for i in range(20)]
    (tmp_path / "tags.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for mode in ("frozen", "finetune"):
        args = train_args(env, tmp_path / "m", "--mode", mode, "--epochs", "1")
        args[args.index(str(env["train"]))] = str(tmp_path / "tags.jsonl")
        err = _user_error(runner.invoke(app, args))
        assert "label column 'label' holds a list of 2000 values, not one label" in err, (mode, err)
        assert "tags.jsonl" in err and "layerwise probe --task tagging" in err and len(err) < 600, mode


@pytest.mark.parametrize(
    "content,message",
    [
        ("text\tlabel\nparis\tpos\nlamb\tpos\n", "the training data has a single class ('pos')"),
        ("", "holds no usable record (empty file, or every record was bad)"),
        ("text\tlabel\n\t\n \tpos\n", "holds no usable record (empty file, or every record was bad)"),
    ],
)
def test_train_bad_training_file(runner, env, tmp_path, content, message):
    (tmp_path / "bad.tsv").write_text(content)
    args = train_args(env, tmp_path / "m")
    args[args.index(str(env["train"]))] = str(tmp_path / "bad.tsv")
    assert message in _user_error(runner.invoke(app, args))
