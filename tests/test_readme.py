"""The README's examples run as written: the "Use it from OpenAI / TEI clients" section's server command (on the
embedded default model) and each of its Python examples, whose printed output must match the comment beside the
``print``."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from tiny import cli_server

README = Path(__file__).resolve().parents[1] / "README.md"


def section(title: str) -> str:
    text = README.read_text(encoding="utf-8")
    start = text.index(f"### {title}")
    return text[start : text.index("\n## ", start)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


@pytest.mark.slow
def test_openai_and_tei_client_examples_run_as_written(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    pytest.importorskip("openai")
    pytest.importorskip("langchain_openai")
    text = section("Use it from OpenAI / TEI clients")
    (command,) = blocks(text, "bash")
    args = shlex.split(command.strip())
    assert args[:2] == ["layerwise", "serve"] and args[2:4] == ["--port", "8000"]
    monkeypatch.setattr(hub.constants, "is_offline_mode", lambda: False)  # the suite's HF_HUB_OFFLINE, not a user's
    with cli_server(["serve", *args[4:], "--log-level", "warning"], tmp_path / "server.log", "/health") as url:
        examples = blocks(text, "python")
        assert len(examples) == 3
        for code in examples:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(code.replace("http://127.0.0.1:8000", url), "README.md", "exec"), {})
            promised = [line.split("#", 1)[1].split(":")[0].strip() for line in code.splitlines()
                        if line.startswith("print(") and "#" in line]
            assert out.getvalue().split("\n")[: len(promised)] == promised, (code, out.getvalue())


def test_output_precisions_example_runs_as_written():
    (code,) = blocks(section("Output precisions"), "python")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    promised = [line.split("#", 1)[1].strip() for line in code.splitlines() if line.startswith("print(")]
    assert out.getvalue().strip().split("\n") == promised
