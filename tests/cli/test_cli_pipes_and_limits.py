"""Command line and service limits: version, pipes, stdin, encode formats, serve options."""

from __future__ import annotations

import fcntl
import http.client
import json
import os
import pty
import struct
import subprocess
import sys
import termios
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
from typer.testing import CliRunner

import layerwise as lw
from layerwise.cli.main import app
from layerwise.serve import Limits, ServiceError, create_app

from tiny import serve_in_thread


@pytest.fixture(scope="module")
def model(tiny_dirs):
    return ["--model", str(tiny_dirs["bert"])]


def test_version():
    res = CliRunner().invoke(app, ["--version"])
    assert res.exit_code == 0 and res.stdout.strip() == f"layerwise {lw.__version__}"


def test_a_closed_pipe_ends_quietly(tmp_path, model):
    (tmp_path / "in.txt").write_text("word\n" * 3000)
    cmd = (
        f"{sys.executable} -m layerwise.cli.main encode - --quiet --format jsonl {' '.join(model)} "
        f"< {tmp_path / 'in.txt'} | head -c 10"
    )
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {cmd}"],
        capture_output=True,
        text=True,
        timeout=300,
        # PYTHONPATH: the layerwise under test, whether installed or not
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(Path(lw.__file__).parents[1])},
    )
    assert "broken pipe" not in proc.stderr.lower() and "error" not in proc.stderr.lower(), proc.stderr
    assert len(proc.stdout) == 10 and proc.returncode in (0, 141), (proc.returncode, proc.stderr)


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
    res = CliRunner().invoke(
        app, ["encode", "EU rejects", "call", "--format", "jsonl", "--quiet", *model, "--batch-tokens", "8"]
    )
    lines = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["index"] for r in lines] == [0, 1] and lines[0]["shape"] == [32]
    want = ex.encode(["EU rejects", "call"])
    assert np.abs(np.array([r["vector"] for r in lines]) - want).max() <= 1e-5


def test_encode_says_what_it_ran_on(model):
    res = CliRunner().invoke(app, ["encode", "a", *model])
    assert res.exit_code == 0 and "1 text, device cpu, dtype float32, backend auto" in res.stderr
    res = CliRunner().invoke(app, ["encode", "a", "--quiet", *model])
    assert res.stderr == ""


def test_encode_batch_tokens_is_checked(model):
    res = CliRunner().invoke(app, ["encode", "a", "--batch-tokens", "0", *model])
    assert res.exit_code == 2 and "batch_tokens must be a positive int" in res.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--port", "99999"], "--port 99999 is not a TCP port; give one in 1..65535"),
        (["--port", "0"], "--port 0 is not a TCP port"),
        (["--max-texts", "0"], "max_texts must be a positive int, got 0 (CLI: --max-texts)"),
        (["--max-body-bytes", "-1"], "max_body_bytes must be a positive int, got -1"),
        (["--max-text-chars", "0"], "max_text_chars must be a positive int"),
        (["--max-batch-tokens", "0"], "max_batch_tokens must be a positive int"),
    ],
)
def test_serve_options_are_checked_before_starting(argv, message, model):
    res = CliRunner().invoke(app, ["serve", *model, *argv])
    assert res.exit_code == 2 and message in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_limits_validate_in_python():
    with pytest.raises(ValueError, match="max_texts must be a positive int, got 0"):
        Limits(max_texts=0)


def test_layers_minus_zero_on_the_cli(model):
    res = CliRunner().invoke(app, ["encode", "a", "--layers=-0", *model])
    assert res.exit_code == 2 and "holds -0, which is ambiguous" in res.stderr


# --- encode: --pool, progress, bad text given as arguments ----------------------------------------------------------


def test_pool_help_and_accepted_values_agree(model):
    helptext = " ".join(CliRunner().invoke(app, ["encode", "--help"], env={"COLUMNS": "200"}).stdout.split())
    assert "cls, pooler, mean, max, mean_max, last, or 'none' (one vector per token)" in helptext
    for spelling in ("none", "NONE", "None"):
        res = CliRunner().invoke(app, ["encode", "a", "--pool", spelling, "--quiet", *model])
        assert res.exit_code == 0, res.stderr
        doc = json.loads(res.stdout)
        assert doc["pool"] == "none" and doc["spec"]["level"] == "token"
    res = CliRunner().invoke(app, ["encode", "a", "--pool", "MAX", "--quiet", *model])
    assert res.exit_code == 0 and json.loads(res.stdout)["pool"] == "max"
    res = CliRunner().invoke(app, ["encode", "a", "--pool", "avg", *model])
    assert (
        res.exit_code == 2
        and "unknown --pool 'avg'. Valid pool modes are: cls, pooler, mean, max, mean_max, "
        "last, or none (one vector per token)"
        in " ".join(res.stderr.split())
    )
    res = CliRunner().invoke(app, ["encode", "a", "--pool", "attention", *model])
    assert res.exit_code == 2 and "layerwise train --pool attention" in " ".join(res.stderr.split())


def test_lone_surrogate_argument_is_a_user_error_naming_the_text(model):
    res = CliRunner().invoke(app, ["encode", "ok", "bad \udcff", "--quiet", *model])
    err = " ".join(res.stderr.split())
    assert res.exit_code == 2 and err.startswith("error: text 1 holds a lone surrogate") and res.stdout == ""


def _run_with_stderr_on_a_terminal(args: list[str]) -> tuple[int, str, str]:
    """Run ``layerwise ARGS`` with stderr on a pseudo-terminal: (exit status, stdout, what the terminal showed)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "layerwise.cli.main", *args],
            stdout=subprocess.PIPE,
            stderr=slave,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "COLUMNS": "120"},
        )
    finally:
        os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(master)
    out = proc.stdout.read().decode() if proc.stdout else ""
    return proc.wait(timeout=120), out, seen.decode("utf-8", "replace")


def test_progress_bar_on_a_terminal_unless_quiet(model):
    status, out, term = _run_with_stderr_on_a_terminal(["encode", "a", "b c", "d", *model])
    assert status == 0 and len(json.loads(out)["vectors"]) == 3
    assert "0/3" in term and "text" in term, term  # tqdm's bar: "encode:   0%| | 0/3 [...text/s]"
    assert "3 texts, device cpu, dtype float32, backend auto" in term
    status, out, term = _run_with_stderr_on_a_terminal(["encode", "a", "b c", "d", "--quiet", *model])
    assert status == 0 and len(json.loads(out)["vectors"]) == 3 and term == ""


# --- the service: bad text, unknown fields, options for another level, Client.encode_words ------------------------


@pytest.fixture(scope="module")
def service(tiny_extractors):
    """A real HTTP service on the tiny BERT, run by uvicorn in a thread of this process."""
    with serve_in_thread(create_app(tiny_extractors["bert"])) as url:
        yield url


def _post(url: str, body: bytes | dict) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn = http.client.HTTPConnection(urlparse(url).hostname, urlparse(url).port, timeout=120)
    try:
        conn.request("POST", "/v1/encode", body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize(
    "body,needle",
    [
        (b'{"texts": ["ok", "bad \\ud800"]}', "text 1 holds a lone surrogate"),
        (b'{"texts": ["ok", "fine", "x\\udcff y"], "level": "token"}', "text 2 holds a lone surrogate"),
        (b'{"words": [["ok"], ["a", "b\\udcff"]], "level": "word"}', "word 1 of item 1 holds a lone surrogate"),
        (b'{"texts": ["ok", "a b\\udcff"], "level": "word"}', "word 1 of item 1 holds a lone surrogate"),
    ],
)
def test_service_lone_surrogate_is_422_naming_the_index(service, body, needle):
    status, detail = _post(service, body)
    assert status == 422 and needle in json.dumps(detail), detail
    assert _post(service, {"texts": ["still serving"]})[0] == 200


def test_service_refuses_unknown_fields_naming_them(service):
    status, detail = _post(service, {"texts": ["hi"], "pooling": "cls", "layer": 0})
    assert status == 422, detail
    named = {tuple(d["loc"]) for d in detail["detail"] if d["type"] == "extra_forbidden"}  # type: ignore[index]
    assert named == {("body", "pooling"), ("body", "layer")}


def test_service_pool_at_token_level_is_422(service):
    status, detail = _post(service, {"texts": ["hi"], "level": "token", "pool": "max"})
    assert status == 422 and "pool='max' applies to level 'sentence' only" in json.dumps(detail), detail


def test_service_empty_words_names_the_field(service):
    status, detail = _post(service, {"words": [], "level": "word"})
    assert status == 422 and "'words' is empty" in json.dumps(detail), detail


def test_client_encode_words_equals_extractor(service, tiny_extractors):
    ex = tiny_extractors["bert"]
    words = [["EU", "rejects", "German", "call"], ["Peter", "Blackburn"], ["a"]]
    for kw in ({}, {"layers": "-2:", "subword": "mean"}, {"layers": [0, 2], "combine": "mean", "subword": "last"}):
        got = lw.Client(service).encode_words(words, **kw)
        want = ex.encode_words(words, **kw)
        assert (
            [g.shape for g in got]
            == [w.shape for w in want]
            == [(4, got[0].shape[1]), (2, got[0].shape[1]), (1, got[0].shape[1])]
        )
        for g, w in zip(got, want):
            assert np.abs(g - np.asarray(w)).max() <= 1e-5
    with pytest.raises(lw.InputError, match="words must be a list of word lists"):
        lw.Client(service).encode_words(["EU", "rejects"])
    with pytest.raises(ServiceError, match="lone surrogate"):
        lw.Client(service).encode_words([["ok", "\ud800"]])


def test_encode_and_predict_never_replace_a_file_without_overwrite(tmp_path, model):
    out = tmp_path / "notes.txt"
    out.write_text("my notes")
    res = CliRunner().invoke(app, ["encode", "a", "-o", str(out), "--quiet", *model])
    assert res.exit_code == 2 and "exists; layerwise does not replace files: pass --overwrite" in res.stderr
    assert out.read_text() == "my notes"
    res = CliRunner().invoke(app, ["encode", "a", "-o", str(out), "--quiet", "--overwrite", *model])
    assert res.exit_code == 0 and json.loads(out.read_text())["shape"] == [1, 32]
    res = CliRunner().invoke(app, ["predict", str(tmp_path), "-", "-o", str(out)], input="x\n")
    assert res.exit_code == 2 and "exists; layerwise does not replace files" in res.stderr
