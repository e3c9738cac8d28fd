"""``layerwise probe`` on the command line (typer's CliRunner) with the tiny random BERT: the run, bad input, the
output directory (``--overwrite`` replaces only an earlier probe output) and dev labels the training data lacks."""

from __future__ import annotations

import json
import re

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
    # the table on stdout (Markdown, each column naming its split), the logs and the summary on stderr
    assert "| layer 1 | [1] | - |" in result.stdout and "| concat last 2 | [1, 2] | concat |" in result.stdout
    assert "dev entity F1 [95% CI]" in result.stdout
    # what each score is over, the strength chosen and whether the fit converged, beside the scores
    assert re.search(r"dev entity F1 \[95% CI\] \([\d,]+ sentences, [\d,]+ words\)", result.stdout), result.stdout
    assert "| C | converged |" in result.stdout and "token accuracy" in result.stderr
    assert "features: train" not in result.stdout and "best:" not in result.stdout
    assert "within the noise of the best" in result.stderr or "ahead of every other probe" in result.stderr
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
        (["--task", "parsing"], "unknown --task 'parsing'. Valid values are: sentence, tagging"),
        (["--probe", "svm"], "unknown --probe 'svm'. Valid values are: linear, mlp, bilstm"),
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


def probe_cli(conll, tiny_dirs, out, *args, dev=None):
    """``layerwise probe`` on ``conll`` (one epoch) into ``out``."""
    return CliRunner().invoke(
        app,
        ["probe", "--train", str(conll), "--dev", str(dev or conll), "--model", str(tiny_dirs["bert"]), "--device",
         "cpu", "-o", str(out), "--epochs", "1", "--layers-only", *args],
    )


def files_of(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flags", [[], ["--overwrite"]])
def test_probe_command_refuses_files_it_did_not_write(tmp_path, conll, tiny_dirs, flags):
    out = tmp_path / "out"
    out.mkdir()
    (out / "results.csv").write_bytes(b"layer,my score\n1,0.93\n")
    (out / "report.html").write_bytes(b"<html><body>my own report</body></html>\n")
    before = files_of(out)
    result = probe_cli(conll, tiny_dirs, out, *flags)
    text = " ".join(result.output.split())
    assert result.exit_code == 2, (result.output, result.exception)
    assert f"error: output {str(out)!r} holds results.csv, report.html, which layerwise probe did not write" in text
    assert "layerwise never replaces files it did not write, even with --overwrite: choose another directory" in text
    assert "Traceback" not in result.output
    assert files_of(out) == before and sorted(p.name for p in out.iterdir()) == ["report.html", "results.csv"]


def test_probe_command_replaces_its_own_output_only_with_overwrite(tmp_path, conll, tiny_dirs):
    out = tmp_path / "out"
    first = probe_cli(conll, tiny_dirs, out)
    assert first.exit_code == 0, (first.output, first.exception)
    assert json.loads((out / "results.json").read_text())["format"] == "layerwise-probe"
    (out / "notes.txt").write_text("mine")
    before = files_of(out)
    refused = probe_cli(conll, tiny_dirs, out, "--hidden", "8")
    text = " ".join(refused.output.split())
    assert refused.exit_code == 2 and f"error: output {str(out)!r} holds an earlier layerwise probe output" in text
    assert "pass --overwrite (overwrite=True) to replace it, or choose another directory (-o)" in text
    assert files_of(out) == before
    again = probe_cli(conll, tiny_dirs, out, "--overwrite", "--hidden", "8")
    assert again.exit_code == 0, (again.output, again.exception)
    data = json.loads((out / "results.json").read_text())
    assert data["options"]["hidden"] == 8 and data["format"] == "layerwise-probe"
    assert (out / "notes.txt").read_text() == "mine"


def test_probe_command_names_dev_labels_train_lacks(tmp_path, conll, tiny_dirs):
    dev = tmp_path / "dev.conll"
    dev.write_text(CONLL + "\nOlympic NNP B-NP B-EVENT\nGames NNP I-NP I-EVENT\nopen VB B-VP O\n"
                   "\nWorld NNP B-NP B-EVENT\nCup NNP I-NP I-EVENT\n")
    out = tmp_path / "out"
    result = probe_cli(conll, tiny_dirs, out, dev=dev)
    assert result.exit_code == 0, (result.output, result.exception)
    text = " ".join(result.output.split())
    note = "dev: 4 of 15 words have labels the training data lacks: B-EVENT (2), I-EVENT (2); entity F1 follows seqeval"
    assert f"warning: {note}" in text  # logged before training
    assert text.count("B-EVENT (2), I-EVENT (2)") == 2  # and under the table
    data = json.loads((out / "results.json").read_text())
    assert data["unseen_labels"] == {"dev": {"B-EVENT": 2, "I-EVENT": 2}}


def test_results_go_to_stdout_and_progress_to_stderr_in_a_real_shell(tmp_path, conll, tiny_dirs):
    """``layerwise probe ... > out.txt``: the results table is in the file (it used to be on stderr, the file empty),
    the progress and notices are not; a single layer's row combines nothing ("-", not "concat")."""
    import subprocess
    import sys

    out_txt, err_txt = tmp_path / "out.txt", tmp_path / "err.txt"
    cmd = [sys.executable, "-m", "layerwise.cli.main", "probe", "--train", str(conll), "--dev", str(conll),
           "--model", str(tiny_dirs["bert"]), "--device", "cpu", "-o", str(tmp_path / "res"), "--layers-only"]
    with out_txt.open("w") as out, err_txt.open("w") as err:
        done = subprocess.run(cmd, stdout=out, stderr=err, timeout=300)
    stdout, stderr = out_txt.read_text(), err_txt.read_text()
    assert done.returncode == 0, stderr[-3000:]
    assert "NER tagging (ner.conll)" in stdout and "| layer 1 | [1] | - |" in stdout and "| embeddings | [0] | - |" \
        in stdout, stdout
    assert "best:" in stderr and "best:" not in stdout and "features:" not in stdout
    assert "concat" not in stdout  # --layers-only: every row is one layer


def test_a_table_without_task_suggests_task_sentence(tmp_path, tiny_dirs):
    """``--task`` defaults to tagging; a .tsv of labelled records is named and ``--task sentence`` suggested."""
    data = tmp_path / "sst.tsv"
    data.write_text("sentence\tlabel\na fine film\t1\na dull film\t0\n")
    result = CliRunner().invoke(app, ["probe", "--train", str(data), "--dev", str(data), "--model",
                                      str(tiny_dirs["bert"]), "--device", "cpu", "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert "sst.tsv' is read as tsv, a label per record" in err and "--format conll" in err, err
    assert "layerwise probe --task sentence" in err, err
    assert not (tmp_path / "out").exists()
