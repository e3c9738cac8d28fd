"""The command line as a new user meets it (issue 55): every bad option or path is one ``error:`` line with a hint,
``-q`` on every command, ``verify`` on a file, ``train`` without ``--dev``, progress where stderr is no terminal."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from layerwise.cli.main import COMMANDS, app
from layerwise.progress import LineProgress


def _one_error_line(result) -> str:
    assert result.exit_code == 2, (result.output, result.exception)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "╭" not in result.stderr and "Traceback" not in result.stderr and result.stdout == ""
    return lines[0]


@pytest.mark.parametrize("argv, said", [
    (["verify", "--bogus", "x"], "error: No such option: --bogus; see 'layerwise verify --help'"),
    (["extract"], "error: Missing argument 'INPUT'; see 'layerwise extract --help'"),
    (["nope"], "error: No such command 'nope'; see 'layerwise --help'"),
    (["encode", "--batch-tokens", "many", "x"], "error: Invalid value for '--batch-tokens'"),
])
def test_a_bad_option_is_one_error_line_naming_the_help(argv, said):
    assert _one_error_line(CliRunner().invoke(app, argv)).startswith(said)


def test_the_real_command_says_a_bad_option_in_one_line():
    from pathlib import Path

    command = Path(sys.executable).with_name("layerwise")  # the installed command, as a user types it
    done = subprocess.run([str(command), "extract", "--nope", "x"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == "error: No such option: --nope (Possible options: --model); see 'layerwise " \
                                  "extract --help'"


def test_verify_on_a_file_says_it_is_not_a_store(tmp_path):
    src = tmp_path / "texts.txt"
    src.write_text("hello\n")
    line = _one_error_line(CliRunner().invoke(app, ["verify", str(src)]))
    assert "not a store" in line and "is a file" in line and f"layerwise extract {src} -o STORE" in line
    assert "Errno" not in line


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_takes_q(name):
    res = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--quiet" in res.stdout and "-q" in res.stdout, res.stdout


def test_verify_q_says_nothing_for_an_intact_store_and_the_problems_of_a_damaged_one(tiny_dirs, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("one text\nanother text\n")
    model = ["--model", str(tiny_dirs["bert"])]
    assert CliRunner().invoke(app, ["extract", str(src), "-o", str(tmp_path / "s"), *model, "-q"]).exit_code == 0
    res = CliRunner().invoke(app, ["verify", str(tmp_path / "s"), "-q"])
    assert res.exit_code == 0 and res.stdout == "" and res.stderr == "", res.output
    shard = next((tmp_path / "s").glob("shard-*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])  # real damage: the shard cut short
    res = CliRunner().invoke(app, ["verify", str(tmp_path / "s"), "-q"])
    assert res.exit_code == 1 and shard.name in res.stdout, res.output


def test_progress_on_a_stderr_that_is_no_terminal_is_plain_periodic_lines(tiny_dirs, tmp_path):
    """Under nohup or in a log file the extraction says where it is, in plain lines (no \\r bar); a job shorter
    than the interval says nothing."""
    src = tmp_path / "in.txt"
    src.write_text("".join(f"sentence number {i} of the corpus\n" for i in range(40)))
    run = [sys.executable, "-m", "layerwise.cli.main", "extract", str(src), "--model", str(tiny_dirs["bert"]),
           "--shard-records", "8", "--batch-tokens", "64"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LAYERWISE_PROGRESS_SECONDS": "0.000001"}
    env.pop("LAYERWISE_QUIET", None)
    done = subprocess.run([*run, "-o", str(tmp_path / "a")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("layerwise: extract ")]
    assert len(lines) >= 2 and "\r" not in done.stderr, done.stderr
    assert "/40 rec (" in lines[0] and "rec/s" in lines[0] and lines[-1].startswith("layerwise: extract 40/40 rec "
                                                                                    "(100%)")
    env["LAYERWISE_PROGRESS_SECONDS"] = "3600"
    done = subprocess.run([*run, "-o", str(tmp_path / "b")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "layerwise: extract " not in done.stderr, done.stderr
    env["LAYERWISE_PROGRESS_SECONDS"] = "0.000001"
    done = subprocess.run([*run, "-o", str(tmp_path / "c"), "-q"], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_a_line_progress_says_the_rate_and_the_time_left():
    import io

    out = io.StringIO()
    bar = LineProgress(total=100, initial=20, desc="extract", unit="rec", every=0.0, file=out)
    bar.update(30)
    bar.set_postfix_str("900 tok/s, 0 skipped")
    bar.update(10)
    bar.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("layerwise: extract 50/100 rec (50%), ") and " left" in lines[0]
    assert lines[1].endswith("900 tok/s, 0 skipped") and lines[-1].startswith("layerwise: extract 60/100 rec (60%)")
    assert " in all" in lines[-1] and " left" not in lines[-1]
    silent = io.StringIO()
    with LineProgress(total=5, every=3600, file=silent) as quiet_bar:
        quiet_bar.update(5)
    assert silent.getvalue() == ""  # shorter than the interval: nothing at all


def test_train_without_dev_holds_out_its_dev_set_and_says_so(tiny_dirs, tmp_path):
    src = tmp_path / "train.tsv"
    src.write_text("sentence\tlabel\n" + "".join(f"{'good fine' if i % 2 else 'bad poor'} film {i}\t{i % 2}\n"
                                                 for i in range(500)))
    res = CliRunner().invoke(app, ["train", "--train", str(src), "-o", str(tmp_path / "m"), "--model",
                                   str(tiny_dirs["bert"]), "--epochs", "1", "--cache-dir", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    said = " ".join(res.stderr.split())
    assert "no dev file: 50 of the 500 training records are held out as the dev set" in said
    assert "dev (held out of train) (best epoch 1)" in res.stdout
    help_text = " ".join(CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "the epoch is chosen on --held-out of train, not on dev" in help_text.replace("│ ", "")
