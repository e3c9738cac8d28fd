"""Hardening regressions: one-layer indexing of ``LayerStack``, plots without pyplot, probe training that leaves the
global random state alone, CLI bugs told apart from user errors (``--debug``), and the demo table in a pipe.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import typer
from typer.testing import CliRunner

import layerwise.store
from layerwise.cli.demo import sample_sentences
from layerwise.cli.main import app
from layerwise.cli.options import user_errors
from layerwise.encoding.stack import LayerStack
from layerwise.probe.data import ProbeSplit
from layerwise.probe.models import ProbeSpec
from layerwise.probe.train import ProbeOptions, fit_probe

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SRC = Path(__file__).resolve().parents[1] / "src" / "layerwise"


# --- 1. LayerStack: stack[key] is one layer -------------------------------------------------------------------


def _stack(num_layers: int = 3, batch: int = 2, tokens: int = 4, width: int = 5) -> LayerStack:
    k = num_layers + 1
    return LayerStack(
        tensor=torch.arange(k * batch * tokens * width, dtype=torch.float32).reshape(k, batch, tokens, width),
        layers=tuple(range(k)),
        sites=("block",) * k,
        attention_mask=torch.ones(batch, tokens, dtype=torch.long),
        input_ids=torch.zeros(batch, tokens, dtype=torch.long),
        special_tokens_mask=torch.zeros(batch, tokens, dtype=torch.long),
        word_ids=[[None] * tokens for _ in range(batch)],
        offsets=[[(0, 0)] * tokens for _ in range(batch)],
        num_layers=num_layers,
    )


@pytest.mark.parametrize("key, count", [("all", 4), ("-2:", 2), ("1:3", 2), ([0, 1], 2)])
def test_stack_key_selecting_several_layers_is_a_clear_error(key, count):
    stack = _stack()
    for get in (stack.__getitem__, stack.layer):
        with pytest.raises(ValueError) as info:
            get(key)
        msg = str(info.value)
        assert "stack[key] gives ONE layer" in msg
        assert repr(key) in msg and f"selects {count} layers" in msg
        assert f"stack.select({key!r})" in msg
    assert stack.select(key).tensor.shape[0] == count  # the pointer in the message works


def test_stack_one_layer_keys_still_work():
    stack = _stack()
    for key, index in [(-1, 3), ("last", 3), ("layer_2", 2), (0, 0), ("embeddings", 0), ("-2", 2), ([1], 1)]:
        assert torch.equal(stack[key], stack.tensor[index]), key
    sub = stack.select([1, 2])
    assert torch.equal(sub[0], stack.tensor[1])  # an int is a position in the stack (issue 41, item 1)
    with pytest.raises(KeyError, match="was not captured"):
        sub.layer(0)  # model layer 0 is not in it


def test_stack_from_extractor_all_layers(tiny_extractors):
    stack = tiny_extractors["bert"].hidden_states(["I love Paris", "Hi"], layers="all")
    with pytest.raises(ValueError, match=r"key 'all' selects 3 layers .*stack\.select\('all'\)"):
        stack["all"]
    assert torch.equal(stack["-1"], stack.tensor[-1])
    # the docstring's promise: padded positions are zero-filled
    pad = stack.attention_mask == 0
    assert bool(pad.any()) and bool((stack.tensor[:, pad] == 0).all())


def test_stack_docstring_says_padding_is_zero_filled():
    doc = " ".join(LayerStack.__doc__.split())
    assert "filled with zeros" in doc
    assert "hold the model's states for padding tokens" not in doc


# --- 2. Plots with matplotlib's object API: no backend switch, no pyplot --------------------------------------


def test_plots_keep_the_users_backend_and_write_pngs(tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from types import SimpleNamespace

        import matplotlib
        import numpy as np

        matplotlib.use("svg")
        from layerwise.probe import report

        rows = [dict(name="embeddings" if i == 0 else f"layer {i}", kind="layer", layers=(i,), combine="concat",
                     dev_mean=0.5 + 0.1 * i, dev_std=0.01) for i in range(3)]
        rows.append(dict(name="sum last 2", kind="strategy", layers=(1, 2), combine="sum", dev_mean=0.66, dev_std=0.0))
        results = SimpleNamespace(rows=rows, metric_name="accuracy", task_title="toy task", options={"probe": "linear"})
        out = Path(sys.argv[1])
        report.plot_layers(results, out / "layers.png")
        report.plot_similarity(np.array([[1.0, 0.5, 0.2], [0.5, 1.0, 0.7], [0.2, 0.7, 1.0]]), out / "sim.png", "toy")
        print("backend", matplotlib.get_backend())
        print("pyplot", "matplotlib.pyplot" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "backend svg" in done.stdout, done.stdout  # the old code switched it to agg
    assert "pyplot False" in done.stdout, done.stdout
    for name in ("layers.png", "sim.png"):
        data = (tmp_path / name).read_bytes()
        assert len(data) > 1000 and data.startswith(PNG_MAGIC), name


def test_no_pyplot_or_backend_switch_in_src():
    for path in SRC.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"matplotlib\.pyplot|from matplotlib import .*pyplot", text), path
        assert "matplotlib.use(" not in text, path


# --- 3. Probe training: deterministic, global RNG state untouched ---------------------------------------------


def _split(rows: int, labels: list[str], offsets: np.ndarray | None, seed: int) -> ProbeSplit:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, 8, generator=g).to(torch.float16)
    return ProbeSplit(x=x, labels=labels, offsets=offsets, store=None)


def _rng_states() -> tuple:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def _same_states(a: tuple, b: tuple) -> None:
    assert a[0] == b[0], "Python's random state changed"
    assert a[1][0] == b[1][0] and np.array_equal(a[1][1], b[1][1]) and a[1][2:] == b[1][2:], "NumPy's state changed"
    assert torch.equal(a[2], b[2]), "torch's global RNG state changed"


def _probe_case(kind: str) -> dict:
    """Tiny random data: BiLSTM on tagging (sentences of 6 words), MLP on a sentence task; a scalar-mix probe."""
    spec = ProbeSpec("mix", "strategy", (0, 1, 2), "scalar_mix")
    if kind == "bilstm":
        tags = ["B-PER", "I-PER", "O", "B-LOC", "O", "O"] * 6
        off = np.arange(0, len(tags) + 1, 6)
        splits = [_split(len(tags), tags, off, seed) for seed in (1, 2, 3)]
        return {
            "task": "tagging",
            "labels": ["B-LOC", "B-PER", "I-PER", "O"],
            "scheme": "IOB2",
            "splits": splits,
            "spec": spec,
        }
    labels = ["neg", "pos"] * 20
    splits = [_split(len(labels), labels, None, seed) for seed in (1, 2, 3)]
    return {"task": "sentence", "labels": ["neg", "pos"], "scheme": "none", "splits": splits, "spec": spec}


@pytest.mark.parametrize("kind", ["mlp", "bilstm"])
def test_fit_probe_is_deterministic_and_leaves_global_rng_alone(kind):
    case = _probe_case(kind)
    train, dev, test = case["splits"]
    opts = ProbeOptions(probe=kind, hidden=16, dropout=0.5, epochs=3, patience=5, batch_size=8)

    def fit(seed: int):
        return fit_probe(
            case["spec"],
            train,
            dev,
            test,
            task=case["task"],
            labels=case["labels"],
            scheme=case["scheme"],
            opts=opts,
            seed=seed,
        )

    random.seed(123)
    np.random.seed(123)
    torch.manual_seed(123)
    before = _rng_states()
    first = fit(7)
    _same_states(before, _rng_states())
    # consuming the global generators in between does not change the result: the seed alone decides it
    random.random(), np.random.rand(3), torch.rand(3)
    again = fit(7)
    assert (first.dev, first.test, first.epochs, first.weights) == (again.dev, again.test, again.epochs, again.weights)
    assert first.weights is not None and len(first.weights) == 3


# --- 4. CLI: user errors vs bugs, --debug ----------------------------------------------------------------------


@pytest.fixture()
def runner() -> CliRunner:
    return CliRunner()


def _raise(exc: Exception):
    def fail(*args, **kwargs):
        raise exc

    return fail


def test_cli_bug_is_reported_as_a_bug_with_exit_1(runner, monkeypatch):
    monkeypatch.setattr(layerwise.store, "open_store", _raise(TypeError("boom")))
    result = runner.invoke(app, ["inspect", "some-store"], env={"LAYERWISE_DEBUG": None})
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.stdout == "" and "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: unexpected TypeError: boom. This is a bug in layerwise;")
    assert "--debug" in lines[0] and "LAYERWISE_DEBUG=1" in lines[0] and "please report it" in lines[0]


@pytest.mark.parametrize("exc", [KeyError("column"), AttributeError("'NoneType' object has no attribute 'x'")])
def test_cli_other_exceptions_are_bugs_too(runner, monkeypatch, exc):
    monkeypatch.setattr(layerwise.store, "open_store", _raise(exc))
    result = runner.invoke(app, ["inspect", "some-store"], env={"LAYERWISE_DEBUG": None})
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.stderr.startswith(f"error: unexpected {type(exc).__name__}: {exc}. This is a bug in layerwise")


@pytest.mark.parametrize("how", [["--debug"], "env"])
def test_cli_debug_shows_the_traceback_of_a_bug(runner, monkeypatch, how):
    monkeypatch.setattr(layerwise.store, "open_store", _raise(TypeError("boom")))
    args, env = (how, {"LAYERWISE_DEBUG": None}) if how != "env" else ([], {"LAYERWISE_DEBUG": "1"})
    result = runner.invoke(app, [*args, "inspect", "some-store"], env=env)
    assert result.exit_code == 1, (result.output, result.exception)
    err = result.stderr
    assert err.startswith("Traceback (most recent call last):")
    assert "TypeError: boom" in err and "in inspect" in err
    assert err.strip().splitlines()[-1].startswith("error: unexpected TypeError: boom. This is a bug in layerwise")
    # the flag belongs to one invocation: the next one without it is quiet again
    quiet = runner.invoke(app, ["inspect", "some-store"], env={"LAYERWISE_DEBUG": None})
    assert quiet.exit_code == 1 and "Traceback" not in quiet.stderr


@pytest.mark.parametrize("exc", [ValueError("bad store [/x]"), FileNotFoundError("no such file: x")])
def test_cli_user_error_is_one_line_exit_2(runner, monkeypatch, exc):
    monkeypatch.setattr(layerwise.store, "open_store", _raise(exc))
    result = runner.invoke(app, ["inspect", "some-store"], env={"LAYERWISE_DEBUG": None})
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.stdout == "" and result.stderr == f"error: {exc}\n"
    debug = runner.invoke(app, ["--debug", "inspect", "some-store"])
    assert debug.exit_code == 2
    assert "Traceback (most recent call last):" in debug.stderr
    assert debug.stderr.strip().splitlines()[-1] == f"error: {exc}"


def test_cli_real_user_error_and_no_args_help(runner, tmp_path):
    result = runner.invoke(app, ["inspect", str(tmp_path / "nope")], env={"LAYERWISE_DEBUG": None})
    assert result.exit_code == 2 and result.stderr.startswith("error: ") and "is not a layerwise store" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    bare = runner.invoke(app, [], env={"COLUMNS": "200"})
    assert "Usage:" in bare.output and "inspect" in bare.output and "--debug" in bare.output


def test_user_errors_lets_typer_exit_through():
    with pytest.raises(typer.Exit) as info, user_errors():
        raise typer.Exit(0)
    assert info.value.exit_code == 0


# --- 5. demo in a pipe: one table row per line ---------------------------------------------------------------


def test_demo_table_rows_stay_on_one_line_when_piped(runner, tiny_dirs):
    result = runner.invoke(app, ["demo", "--model", str(tiny_dirs["bert"]), "--device", "cpu"], env={"COLUMNS": "80"})
    assert result.exit_code == 0, (result.output, result.exception)
    lines = result.stdout.splitlines()
    n = len(sample_sentences())
    rows = [ln for ln in lines if re.search(rf"\({n}, \d+, 32\)", ln)]
    assert len(rows) == 3, result.stdout  # layers 0..2 of the tiny BERT, one line each
    for label, row in zip(["embeddings", "layer_1", "layer_2"], rows, strict=True):
        assert label in row, row
    for ln in lines:
        if re.search(r"\(\d", ln):
            assert re.search(r"\(\d+(, \d+)*\)", ln), f"shape broken across lines: {ln!r}"
