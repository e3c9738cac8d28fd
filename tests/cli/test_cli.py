"""The ``layerwise`` command line through typer's CliRunner.

The default model is loaded by only two invocations (demo, and the ``encode`` JSON case matching
``Extractor.encode``); every other case points ``--model`` at the tiny BERT directory, which loads in a fraction of
a second.
"""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
from typer.testing import CliRunner

from layerwise.cli.demo import sample_sentences
from layerwise.cli.main import app

from tiny import pickle_only_copy

TEXTS = ["I love Paris", "EU rejects German call"]


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture(scope="module")
def tiny(tiny_dirs, tiny_extractors):
    """(``--model`` arguments for the tiny BERT, its Extractor as the reference)."""
    return ["--model", str(tiny_dirs["bert"]), "--device", "cpu"], tiny_extractors["bert"]


def _ok(result):
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def _user_error(result) -> str:
    """A clean CLI error: exit 2, nothing on stdout, no traceback; returns stderr with wrapping undone."""
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())
    assert err.startswith("error: ")
    return err


def test_demo_default_model_per_layer_table(runner):
    result = _ok(runner.invoke(app, ["demo", "--device", "cpu"], env={"COLUMNS": "200"}))
    out = result.stdout
    n = len(sample_sentences())
    assert "model='sentence-transformers/all-MiniLM-L6-v2'" in out and "layers=0..6" in out
    assert re.search(rf"LayerStack\.tensor: \(7, {n}, \d+, 384\)", out)
    rows = [line for line in out.splitlines() if re.search(rf"\({n}, \d+, 384\)", line)]
    labels = ["embeddings"] + [f"layer_{i}" for i in range(1, 7)]
    assert len(rows) == 7
    for idx, (label, row) in enumerate(zip(labels, rows)):
        assert re.search(rf"\b{idx}\b.*\b{label}\b", row), row


def test_encode_json_matches_extractor(runner, default_extractor):
    args = [
        "encode",
        *TEXTS,
        "--layers=-4:",
        "--combine",
        "concat",
        "--pool",
        "mean",
        "--format",
        "json",
        "--device",
        "cpu",
    ]
    doc = json.loads(_ok(runner.invoke(app, args)).stdout)
    assert doc["shape"] == [2, 1536] and doc["layers"] == [3, 4, 5, 6]
    assert doc["model"] == "sentence-transformers/all-MiniLM-L6-v2"
    assert (doc["site"], doc["combine"], doc["pool"]) == ("block", "concat", "mean")
    got = np.asarray(doc["vectors"], dtype=np.float32)
    want = default_extractor.encode(TEXTS, layers="-4:", combine="concat", pool="mean")
    assert got.shape == want.shape == (2, 1536)
    assert np.abs(got - want).max() <= 1e-5
    assert not np.allclose(got[0], got[1])


def test_encode_npy_file_and_stdout(runner, tiny, tmp_path):
    model, ex = tiny
    want = ex.encode(TEXTS, layers=[0, 2], combine="concat", pool="max")
    out = tmp_path / "vectors.npy"
    args = ["encode", *TEXTS, "--layers", "0,2", "--pool", "max", "--format", "npy", *model]
    result = _ok(runner.invoke(app, [*args, "-o", str(out)]))
    assert result.stdout == ""
    got = np.load(out)
    assert got.shape == (2, 64) and got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5
    piped = np.load(io.BytesIO(_ok(runner.invoke(app, args)).stdout_bytes))
    assert np.array_equal(piped, got)


def test_quiet_silences_the_one_time_work_lines(runner, tiny, tmp_path, monkeypatch):
    model, _ = tiny
    args = ["encode", *TEXTS, "--layers", "1", *model]
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "loud"))  # a fresh cache: the export happens, and is said
    loud = _ok(runner.invoke(app, args))
    assert "layerwise: exported" in loud.stderr, loud.stderr
    monkeypatch.setenv("LAYERWISE_CACHE", str(tmp_path / "quiet"))
    quiet = _ok(runner.invoke(app, [*args, "-q"]))
    assert "layerwise:" not in quiet.stderr and quiet.stdout == loud.stdout


def test_encode_pool_none_gives_token_vectors(runner, tiny):
    model, ex = tiny
    texts = ["hello", "I love Paris in the springtime"]
    doc = json.loads(_ok(runner.invoke(app, ["encode", *texts, "--pool", "none", *model])).stdout)
    want = ex.encode(texts, layers=-1, pool=None)
    assert len(doc["vectors"]) == 2 and doc["pool"] == "none" and doc["layers"] == [2]
    assert want[0].shape[0] != want[1].shape[0]  # ragged: one row per token, special tokens included
    for got, ref in zip(doc["vectors"], want):
        got = np.asarray(got, dtype=np.float32)
        assert got.shape == ref.shape and np.abs(got - ref).max() <= 1e-5
    assert doc["shape"] == [[w.shape[0], 32] for w in want]
    err = _user_error(runner.invoke(app, ["encode", *texts, "--pool", "none", "--format", "npy", *model]))
    assert "--format npy needs one vector per text" in err


def test_encode_stdin_one_text_per_line(runner, tiny):
    model, ex = tiny
    lines = ["EU rejects German call", "a", "I love Paris"]
    result = _ok(
        runner.invoke(
            app, ["encode", "-", "--layers", "all", "--combine", "mean", *model], input="\n".join(lines) + "\n"
        )
    )
    doc = json.loads(result.stdout)
    assert doc["shape"] == [3, 32] and doc["layers"] == [0, 1, 2]
    want = ex.encode(lines, layers="all", combine="mean", pool="mean")
    assert np.abs(np.asarray(doc["vectors"], dtype=np.float32) - want).max() <= 1e-5
    # a blank line is no text (one row per line, so it is refused rather than skipped), naming it
    res = runner.invoke(app, ["encode", "-", *model], input="a\n\nb\n")
    assert res.exit_code == 2 and "error: text 1 is empty" in res.stderr and res.stdout == "", res.output


def test_encode_weighted_and_options(runner, tiny, tmp_path):
    model, ex = tiny
    out = tmp_path / "v.json"
    args = ["encode", *TEXTS, "-l", "1,2", "-c", "weighted", "--weights", "0.25,0.75", "-p", "cls", "-o", str(out)]
    assert _ok(runner.invoke(app, [*args, *model])).stdout == ""
    doc = json.loads(out.read_text())
    want = ex.encode(TEXTS, layers=[1, 2], combine="weighted", weights=[0.25, 0.75], pool="cls")
    assert doc["shape"] == [2, 32] and np.abs(np.asarray(doc["vectors"]) - want).max() <= 1e-5


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--layers", "9"], ["layer 9 in layer spec 9 is out of range", "this model has layers 0..2",
                             "e.g. --layers -1, --layers 0,1, --layers -2:, --layers all"]),
        (["--layers", "0,9"], ["layer 9 in layer spec '0,9' is out of range"]),
        (["--layers", "[0,9]"], ["layer 9 in layer spec '0,9' is out of range"]),
        (["--layers", "0,[9"], ["--layers '0,[9' holds a bracket", "e.g. --layers 0,3"]),
        (["--layers", "0,0"], ["layer spec '0,0' names layer(s) [0] more than once", "--layers 0,1"]),
        (["--layers", "top4"], ["malformed layer spec 'top4'", "'embeddings', 'last'"]),
        (["--layers", "::0"], ["layer slice '::0' has step 0"]),
        (["--site", "ffn"], ["unknown site 'ffn'. Valid sites are: block, raw, attention, intermediate, pre_ln"]),
        (["--combine", "avg"], ["Valid combine modes are: concat, sum, mean, weighted, stack"]),
        (["--pool", "avg"], ["Valid pool modes are: cls, pooler, mean, max, mean_max, last"]),
        (["--format", "csv"], ["unknown --format 'csv'. Valid formats are: json, jsonl, npy"]),
    ],
)
def test_bad_options_exit_2_with_message(runner, tiny, extra, expected):
    model, _ = tiny
    err = _user_error(runner.invoke(app, ["encode", *TEXTS, *extra, *model]))
    for part in expected:
        assert part in err
    assert "layers=" not in err  # the command line's words, not Python's (layers=[0, 3])


def test_layers_written_as_a_python_list_are_read(runner, tiny):
    """``--layers '[0,2]'`` and ``'[0, 2]'`` are the list 0,2 (they used to fail as "malformed layer spec '[0'")."""
    model, ex = tiny
    for text in ("[0,2]", "[0, 2]"):
        doc = json.loads(_ok(runner.invoke(app, ["encode", *TEXTS, "--layers", text, *model])).stdout)
        assert doc["layers"] == [0, 2]
        want = ex.encode(TEXTS, layers=[0, 2], pool="mean")
        assert np.abs(np.asarray(doc["vectors"], dtype=np.float32) - want).max() <= 1e-5


def test_a_text_that_names_a_file_is_refused_and_file_reads_its_lines(runner, tiny, tmp_path, monkeypatch):
    """``layerwise encode texts.txt`` used to encode the nine characters of the name although the file exists: it is
    refused naming --file (the lines) and --as-text (the name itself); --file PATH and --file - read one text a
    line."""
    model, ex = tiny
    lines = ["EU rejects German call", "I love Paris", "Peter Blackburn"]
    (tmp_path / "texts.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    err = _user_error(runner.invoke(app, ["encode", "texts.txt", *model]))
    assert "TEXT 'texts.txt' is the name of an existing file" in err
    assert "--file texts.txt" in err and "--as-text" in err
    want = ex.encode(lines, pool="mean")
    for args, stdin in ((["--file", "texts.txt"], None), (["--file", "-"], "\n".join(lines) + "\n")):
        doc = json.loads(_ok(runner.invoke(app, ["encode", *args, *model], input=stdin)).stdout)
        assert doc["shape"] == [3, 32], args
        assert np.abs(np.asarray(doc["vectors"], dtype=np.float32) - want).max() <= 1e-5
    named = json.loads(_ok(runner.invoke(app, ["encode", "texts.txt", "--as-text", *model])).stdout)
    assert np.abs(np.asarray(named["vectors"], dtype=np.float32) - ex.encode(["texts.txt"], pool="mean")).max() <= 1e-5
    for args, message in (
        (["texts.txt", "--file", "texts.txt"], "give TEXT arguments or --file texts.txt, not both"),
        ([], "nothing to encode: give TEXT arguments, --file PATH"),
        (["--file", "nope.txt"], "--file 'nope.txt' does not exist"),
        (["--file", "."], "--file '.' is a directory"),
    ):
        assert message in _user_error(runner.invoke(app, ["encode", *args, *model])), args
    (tmp_path / "bad.txt").write_bytes(b"fine\n\xff\xfe\n")
    assert "line 2 of 'bad.txt' is not valid UTF-8" in _user_error(
        runner.invoke(app, ["encode", "--file", "bad.txt", *model]))


def test_missing_model_and_pickle_flag(runner, tiny_dirs, tmp_path):
    err = _user_error(runner.invoke(app, ["encode", "x", "--model", str(tmp_path / "nope"), "--device", "cpu"]))
    assert "does not exist" in err and "nope" in err
    pickled = pickle_only_copy(tiny_dirs["bert"], tmp_path / "pickled")
    args = ["encode", "x", "--model", str(pickled), "--device", "cpu"]
    err = _user_error(runner.invoke(app, args))
    assert "holds only a pickle checkpoint" in err and "--allow-pickle" in err
    assert json.loads(_ok(runner.invoke(app, [*args, "--allow-pickle"])).stdout)["shape"] == [1, 32]


def test_help_imports_no_model_code():
    """`layerwise --help` and every command's --help, in a fresh interpreter: neither torch nor transformers is
    imported (the model loads only in the commands that run one)."""
    import subprocess
    import sys

    from layerwise.cli.main import COMMANDS

    child = ("import sys\nfrom layerwise.cli.main import app\n"
             "for args in [['--help']] + [[name, '--help'] for name in sys.argv[1:]]:\n"
             "    try:\n        app(args, prog_name='layerwise')\n    except SystemExit as exc:\n"
             "        assert exc.code == 0, (args, exc.code)\n"
             "    heavy = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
             "    assert not heavy, (args, heavy)\n"
             "print('clean')\n")
    done = subprocess.run([sys.executable, "-c", child, *COMMANDS], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("clean"), done.stderr[-2000:]


def test_the_help_lines_are_the_commands_own(runner):
    """The top-level help lists each command from a table (importing none): each line is the start of that
    command's own docstring, and every command runs."""
    import inspect

    from layerwise.cli.main import COMMANDS, command

    for name, (_, _, line) in COMMANDS.items():
        cmd = command(name)
        own = " ".join(inspect.cleandoc(cmd.callback.__doc__ or "").split("\n\n")[0].split())
        assert own.startswith(line.rstrip(".")), (name, line, own)
    listed = _ok(runner.invoke(app, ["--help"])).stdout
    assert all(name in listed for name in COMMANDS)


def test_help_mentions_risk_of_opt_in_flags(runner):
    out = " ".join(_ok(runner.invoke(app, ["encode", "--help"], env={"COLUMNS": "200"})).stdout.split())
    assert "--allow-pickle" in out and "--trust-remote-code" in out and "RISK" in out


def test_error_is_one_line_at_80_columns(runner, tiny):
    model, _ = tiny
    result = runner.invoke(app, ["encode", "x", "--layers", "9", *model], env={"COLUMNS": "80"})
    assert result.exit_code == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_error_text_is_not_markup(runner, tiny):
    model, _ = tiny
    err = _user_error(runner.invoke(app, ["encode", "x", "--layers", "x[/x]", *model]))
    assert "--layers 'x[/x]' holds a bracket" in err


def test_documented_shard_size_is_the_real_one():
    """The shard size is said in the CLI help and the extraction guide; both must match the engine's constant."""
    from pathlib import Path

    from layerwise.extraction.engine import SHARD_BYTES

    mb = f"~{SHARD_BYTES >> 20} MB"
    res = CliRunner().invoke(app, ["extract", "--help"], env={"COLUMNS": "200"})
    assert mb in " ".join(res.stdout.split())
    guide = (Path(__file__).resolve().parents[2] / "docs" / "how-to" / "extraction.md").read_text(encoding="utf-8")
    assert f"(~{SHARD_BYTES >> 20} MB each)" in guide and not re.search(r"[^,\d]64 MB", guide)
