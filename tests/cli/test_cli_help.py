"""Every command's ``--help`` as a user reads it (typer's CliRunner, a fixed terminal width): brackets in the text
survive rich's markup, options show their value's kind (``TEXT``, ``INTEGER``; a flag nothing) rather than Python
annotations (``<bool>``, ``<str>``, ``<list[str]>``), and the usage line names arguments as click does (``TEXT...``,
``[STORE]``), not ``{texts}...``. Choice flags are refused naming the flag and the valid values."""

from __future__ import annotations

import re

import pytest
import typer.rich_utils
from typer.testing import CliRunner

from layerwise.cli.main import COMMANDS, app


@pytest.fixture
def helps(monkeypatch) -> dict[str, str]:
    """``layerwise --help`` (key ``""``) and each command's ``--help``, rendered 200 columns wide."""
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", 200)  # read once at import from TERMINAL_WIDTH
    runner = CliRunner()
    out = {}
    for name in ["", *COMMANDS]:
        result = runner.invoke(app, [name, "--help"] if name else ["--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (name, result.output)
        out[name] = result.stdout
    return out


def test_no_python_annotations_in_any_help(helps):
    for name, text in helps.items():
        found = re.findall(r"<(?:bool|str|int|float|path|list\[[a-z]+\])>", text)
        assert not found, (name, found)
        assert not re.search(r"\{[a-z_]+\}", text), (name, "usage with {name}")


def test_usage_lines_name_arguments_as_click_does(helps):
    def usage(name: str) -> str:
        return " ".join(helps[name].split("Usage:")[1].splitlines()[0].split())

    assert usage("encode") == "layerwise encode [OPTIONS] [TEXT]..."
    assert usage("merge") == "layerwise merge [OPTIONS] PARTS..."
    assert usage("evaluate") == "layerwise evaluate [OPTIONS] MODEL_DIR DATA"
    assert usage("explore") == "layerwise explore [OPTIONS] [STORE]"
    assert usage("export-model") == "layerwise export-model [OPTIONS] [MODEL]"


def test_option_values_are_named_and_flags_take_none(helps):
    text = helps["encode"]
    assert re.search(r"--layers\s+-l\s+TEXT\b", text), text
    assert re.search(r"--batch-tokens\s+INTEGER\b", text) and re.search(r"--file\s+PATH\b", text)
    assert re.search(r"--calibration\s+PATH\b", text)
    normalize = next(line for line in text.splitlines() if "--normalize" in line)
    assert re.search(r"--normalize\s+L2-normalise", normalize), normalize  # a flag: no value between them
    assert re.search(r"--probe\s+TEXT\b", helps["explore"])  # a repeatable option: one value each time
    assert re.search(r"--dropout\s+FLOAT\b", helps["train"])


def test_brackets_survive_in_every_help(helps):
    """rich read "[openvino]" as a style tag and dropped it ("pip install 'layerwise'")."""
    flat = {name: " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split()) for name, text in helps.items()}
    assert "pip install 'layerwise[openvino]'" in flat["encode"] and "'layerwise[tf]'" in flat["encode"]
    assert "pip install 'layerwise'" not in flat["encode"]
    assert "layerwise[openvino] is installed" in flat["extract"]
    for name, text in flat.items():
        assert "'layerwise'" not in text, name
    assert '{"line": N, "error": "..."}' in flat[""]  # the command list keeps its text too


@pytest.mark.parametrize("command, flag, value, valid", [
    ("train", "--head", "mpl", "linear, mlp, per_layer"),
    ("train", "--mode", "frozen2", "frozen, finetune"),
    ("train", "--activation", "swish", "relu, gelu, tanh"),
    ("train", "--metric", "f1", "accuracy, macro_f1"),
    ("probe", "--task", "tag", "sentence, tagging"),
    ("probe", "--probe", "mpl", "linear, mlp, bilstm"),
    ("probe", "--scheme", "BIO", "auto, none, IOB1, IOB2, IOBES"),
])
def test_a_bad_choice_names_the_flag_and_the_valid_values(tmp_path, command, flag, value, valid):
    """``--head mpl`` said "unknown classifier"; the flag is ``--head``. Refused before any model loads."""
    data = tmp_path / "d.tsv"
    data.write_text("text\tlabel\na\t0\nb\t1\n")
    args = [command, "--train", str(data), "--dev", str(data), flag, value, "--model", str(tmp_path / "no-model")]
    if command == "train":
        args += ["-o", str(tmp_path / "out")]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    err = " ".join(result.stderr.split())
    assert f"error: unknown {flag} {value!r}. Valid values are: {valid}" in err, err


def test_metavar_without_typer_type_descriptors():
    """typer releases before ``type_descriptor`` (the one on the GPU machine's image, 2026-11-26) have only click's
    ``param.type``: the command line still builds, and an option shows click's name of its type."""
    import click

    from layerwise.cli.main import metavar

    class OldOption:  # what such a typer hands over: no type_descriptor
        is_flag = False
        type = click.INT

    assert metavar(OldOption()) == "INTEGER"
    OldOption.type = click.Path()
    assert metavar(OldOption()) == "PATH"
