"""``layerwise probe`` on the command line (typer's CliRunner) with the tiny random BERT."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from layerwise.cli.main import app

CONLL = """-DOCSTART- -X- -X- O

EU NNP B-NP B-ORG
rejects VBZ B-VP O
German JJ B-NP B-MISC
call NN I-NP O
. . O O

Peter NNP B-NP B-PER
Blackburn NNP I-NP I-PER
went VBD B-VP O
to TO B-PP O
Paris NNP B-NP B-LOC
"""


@pytest.fixture
def conll(tmp_path):
    path = tmp_path / "ner.conll"
    path.write_text(CONLL)
    return path


def test_probe_command(tmp_path, conll, tiny_dirs):
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "probe",
            "--train",
            str(conll),
            "--dev",
            str(conll),
            "--task",
            "tagging",
            "--column",
            "ner",
            "--model",
            str(tiny_dirs["bert"]),
            "--device",
            "cpu",
            "-o",
            str(out),
            "--epochs",
            "1",
        ],
    )
    assert result.exit_code == 0, (result.output, result.exception)
    text = result.output
    assert "best:" in text and "NER tagging (ner.conll)" in text
    for name in ("embeddings", "layer 1", "layer 2", "concat last 2", "second-to-last"):
        assert name in text, name
    best = " ".join(text[text.index("best:") :].split())  # the console wraps long lines
    for name in ("results.md", "results.csv", "results.json", "layers.png", "similarity.png", "report.html"):
        assert (out / name).is_file() and name in best, name
    data = json.loads((out / "results.json").read_text())
    assert data["options"]["scheme"] == "IOB2" and data["options"]["epochs"] == 1 and len(data["rows"]) == 10
    top = max(data["rows"], key=lambda r: r["dev_mean"])
    assert best.startswith(f"best: {top['name']} (dev entity F1 {100 * top['dev_mean']:.2f}); wrote ")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "parsing"], "Valid tasks are: sentence, tagging"),
        (["--probe", "svm"], "Valid probes are: linear, mlp, bilstm"),
        (["--restarts", "0"], "restarts must be a positive int"),
        (["--crf"], "crf=True is the output layer of the bilstm probe; use probe='bilstm' (got 'linear')"),
        (["--probe", "bilstm", "--task", "sentence"], "use it with task='tagging'"),
    ],
)
def test_probe_command_bad_input(tmp_path, conll, tiny_dirs, args, message):
    result = CliRunner().invoke(
        app,
        [
            "probe",
            "--train",
            str(conll),
            "--dev",
            str(conll),
            "--model",
            str(tiny_dirs["bert"]),
            "--device",
            "cpu",
            "-o",
            str(tmp_path / "out"),
            *args,
        ],
    )
    assert result.exit_code == 2 and message in " ".join(result.output.split())
    assert "Traceback" not in result.output and not (tmp_path / "out").exists()
