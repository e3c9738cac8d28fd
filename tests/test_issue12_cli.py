"""Issue 12, command line and service limits: version, pipes, stdin, encode formats, serve options."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.serve import Limits


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return ["--model", str(tiny_dirs["bert"])]


def test_version():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"layerwise {lw.__version__}"


def test_a_closed_pipe_ends_quietly(tmp_path, model):
    (tmp_path / "in.txt").write_text("word\n" * 3000)
    cmd = (f"{sys.executable} -m layerwise.cli.main encode - --quiet --format jsonl {' '.join(model)} "
           f"< {tmp_path / 'in.txt'} | head -c 10")
    proc = subprocess.run(["bash", "-c", f"set -o pipefail; {cmd}"], capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})
    assert "Broken pipe" not in proc.stderr and "error" not in proc.stderr, proc.stderr
    assert len(proc.stdout) == 10


def test_stdin_dash_must_be_alone_and_utf8(model):
    res = CliRunner().invoke(app, ["encode", "a", "-", *model], input="x\n")
    assert res.exit_code == 2 and "'-' (read texts from stdin) must be the only TEXT argument" in res.stderr
    res = CliRunner().invoke(app, ["encode", "-", "--quiet", *model], input=b"ok\nbad \xff\n")
    assert res.exit_code == 2 and "line 2 of stdin is not valid UTF-8" in res.stderr and res.stdout == ""
    res = CliRunner().invoke(app, ["encode", "-", "--quiet", *model], input="caf\u00e9\nok\n".encode())
    assert res.exit_code == 0 and len(json.loads(res.stdout)["vectors"]) == 2


def test_npy_goes_exactly_to_the_given_path(tmp_path, model):
    out = tmp_path / "out.bin"
    res = CliRunner().invoke(app, ["encode", "a b", "c", "-f", "npy", "-o", str(out), "--quiet", *model])
    assert res.exit_code == 0 and out.is_file() and not (tmp_path / "out.bin.npy").exists()
    assert np.load(out).shape == (2, 32)


def test_pool_none_any_case_with_tokens_offsets_and_jsonl(model, tiny_extractors):
    ex = tiny_extractors["bert"]
    res = CliRunner().invoke(app, ["encode", "EU rejects", "call", "--pool", "None", "--quiet", *model])
    assert res.exit_code == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["tokens"][0] == ex.tokenizer.convert_ids_to_tokens(ex.tokenizer("EU rejects")["input_ids"])
    assert doc["offsets"][1][1] == [0, 4] and doc["spec"]["level"] == "token"
    res = CliRunner().invoke(app, ["encode", "EU rejects", "call", "--format", "jsonl", "--quiet", *model,
                                   "--batch-tokens", "8"])
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["index"] for r in lines] == [0, 1] and lines[0]["shape"] == [32]
    want = ex.encode(["EU rejects", "call"])
    assert np.abs(np.array([r["vector"] for r in lines]) - want).max() <= 1e-5


def test_encode_says_what_it_ran_on(model):
    res = CliRunner().invoke(app, ["encode", "a", *model])
    assert res.exit_code == 0 and "1 text, device cpu, dtype float32, backend torch" in res.stderr
    res = CliRunner().invoke(app, ["encode", "a", "--quiet", *model])
    assert res.stderr == ""


def test_encode_batch_tokens_is_checked(model):
    res = CliRunner().invoke(app, ["encode", "a", "--batch-tokens", "0", *model])
    assert res.exit_code == 2 and "batch_tokens must be a positive int" in res.stderr


@pytest.mark.parametrize("argv,message", [
    (["--port", "99999"], "--port 99999 is not a TCP port; give one in 1..65535"),
    (["--port", "0"], "--port 0 is not a TCP port"),
    (["--max-texts", "0"], "max_texts must be a positive int, got 0 (CLI: --max-texts)"),
    (["--max-body-bytes", "-1"], "max_body_bytes must be a positive int, got -1"),
    (["--max-text-chars", "0"], "max_text_chars must be a positive int"),
    (["--max-batch-tokens", "0"], "max_batch_tokens must be a positive int"),
])
def test_serve_options_are_checked_before_starting(argv, message, model):
    res = CliRunner().invoke(app, ["serve", *model, *argv])
    assert res.exit_code == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_limits_validate_in_python():
    with pytest.raises(ValueError, match="max_texts must be a positive int, got 0"):
        Limits(max_texts=0)


def test_layers_minus_zero_on_the_cli(model):
    res = CliRunner().invoke(app, ["encode", "a", "--layers=-0", *model])
    assert res.exit_code == 2 and "holds -0, which is ambiguous" in res.stderr
