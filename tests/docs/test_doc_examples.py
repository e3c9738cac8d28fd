"""The examples of the README and of the documentation pages run as written, and print what their comments promise:
the Python example of the README and of the site's landing page, the README's command-line block (on the embedded
default model), the serving guide's server command with each of its OpenAI / TEI client examples, and the concepts
page's output precisions and windows examples. (The any-module example and the architecture table are checked in
``test_architectures.py``, the shard size in ``test_cli.py``.)"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import sae_env

from tiny import cli_server

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def section(path: Path, title: str) -> str:
    """The Markdown section of ``path`` whose heading is ``## title``/``### title`` (to the next ``##`` heading)."""
    text = path.read_text(encoding="utf-8")
    start = re.search(rf"^##+ {re.escape(title)}", text, flags=re.M)
    assert start, f"{path} has no heading {title!r}"
    end = text.find("\n## ", start.end())
    return text[start.start() : end if end >= 0 else len(text)]


def blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def run_printing(code: str, where: str) -> list[str]:
    """Run ``code`` and return the lines it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, where, "exec"), {"__name__": "doc_example"})
    return out.getvalue().strip().split("\n")


def promised(code: str, *, until: str = "\n") -> list[str]:
    """What the comments beside the ``print(...)`` lines of ``code`` say they print (up to ``until``)."""
    return [line.split("# ", 1)[1].split(until)[0].strip() for line in code.splitlines()
            if line.startswith("print(") and "# " in line]


@pytest.mark.parametrize("where", ["README.md", "docs/index.md"])
def test_front_page_python_example_prints_what_it_says(where):
    text = (ROOT / where).read_text(encoding="utf-8")
    (code,) = blocks(section(ROOT / where, "In Python") if where == "README.md" else text, "python")
    assert run_printing(code, where) == promised(code, until=": ")


def test_readme_large_models_example_prints_what_it_says():
    (code,) = blocks(section(README, "Large models on small machines"), "python")
    assert run_printing(code, "README.md") == promised(code, until=":")


def test_sae_how_to_python_blocks_run_and_print_what_they_say(tmp_path):
    """The Python blocks of the SAE how-to, in order as one script, in a folder beside a stand-in SST-2 train file: the
    store written and read, the sparsify SAE trained with its loss falling, SAELens's config built (in a process of
    its own: importing SAELens sets the transformers logger's level for the whole process)."""
    trainer = sae_env.python()  # (sparsify and SAELens are not imported here: see the docstring)
    page = ROOT / "docs" / "how-to" / "sae-activations.md"
    shared = tmp_path / "shared" / "data" / "sst2"
    shared.mkdir(parents=True)
    rows = [f"{['a dull mess', 'a moving and warm film', 'boring and slow', 'a joy to watch'][i % 4]} , take {i}"
            f"\t{i % 2}" for i in range(160)]
    (shared / "train.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n", encoding="utf-8")
    work = tmp_path / "work"
    work.mkdir()
    code = blocks(page.read_text(encoding="utf-8"), "python")
    script = "\n".join(code) + "\nprint(cfg.hook_name)\n"
    run = subprocess.run([trainer, "-c", script], cwd=work, capture_output=True, text=True, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"})
    assert run.returncode == 0, run.stderr[-3000:]
    want = [line for c in code for line in promised(c)] + ["blocks.5.hook_resid_post"]
    said = [line for line in run.stdout.strip().split("\n") if not line.startswith("Triton not installed")]
    assert said == want  # (sparsify says on stdout, when imported, that it runs without Triton here)


def test_readme_command_line_block_runs_as_written(tmp_path):
    (script,) = blocks(section(README, "In Python"), "bash")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    encoded = json.loads(res.stdout.splitlines()[0])
    assert encoded["layers"] == [3, 4, 5, 6] and len(encoded["vectors"]) == 2 and len(encoded["vectors"][0]) == 1536
    assert res.stderr.splitlines()[-1].startswith("feats: intact (1 shard, 2 records); computed by "), res.stderr


def test_openai_and_tei_client_examples_run_as_written(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    pytest.importorskip("openai")
    pytest.importorskip("langchain_openai")
    page = ROOT / "docs" / "how-to" / "serving.md"
    text = section(page, "Use it from OpenAI / TEI clients")
    (command,) = blocks(text, "bash")
    args = shlex.split(command.strip())
    assert args[:2] == ["layerwise", "serve"] and args[2:4] == ["--port", "8000"]
    monkeypatch.setattr(hub.constants, "is_offline_mode", lambda: False)  # the suite's HF_HUB_OFFLINE, not a user's
    with cli_server(["serve", *args[4:], "--log-level", "warning"], tmp_path / "server.log", "/health") as url:
        examples = blocks(text, "python")
        assert len(examples) == 3
        for code in examples:
            want = promised(code, until=":")
            assert run_printing(code.replace("http://127.0.0.1:8000", url), str(page))[: len(want)] == want, code


def test_output_precisions_example_runs_as_written():
    page = ROOT / "docs" / "concepts.md"
    (code,) = blocks(section(page, "Output precisions"), "python")
    assert run_printing(code, str(page)) == promised(code)


def test_layer_stack_example_prints_what_it_says():
    """The one rule of a LayerStack (positions in capture order, model layers by ``layer()``), as the page says."""
    page = ROOT / "docs" / "concepts.md"
    (code,) = blocks(section(page, "What `hidden_states` returns"), "python")
    assert run_printing(code, str(page)) == promised(code, until=":")


def test_windows_example_gives_what_it_says():
    page = ROOT / "docs" / "concepts.md"
    (code,) = blocks(section(page, "Windows: long texts"), "python")
    *setup, last = code.strip().splitlines()
    scope: dict = {}
    exec("\n".join(setup), scope)
    expression, comment = last.split("#", 1)
    assert repr(eval(expression, scope)) == comment.split(":")[0].strip()


def test_readme_export_block_runs_and_its_serve_line_serves_the_export(tmp_path):
    openai = pytest.importorskip("openai")
    st = pytest.importorskip("sentence_transformers")
    text = section(README, "A layer as a model")
    export_block, serve_block = blocks(text, "bash")
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", export_block], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "(1, 384)" and "min cosine 1.0000000" in res.stderr
    args = shlex.split(serve_block.splitlines()[0])
    assert args[:4] == ["layerwise", "serve", "--model", "minilm-l3"] and args[4] == "--port"
    want = st.SentenceTransformer(str(tmp_path / "minilm-l3"), device="cpu").encode(["I love Paris"])
    with cli_server(["serve", "--model", str(tmp_path / "minilm-l3"), "--log-level", "warning"],
                    tmp_path / "server.log", "/health") as url:
        got = openai.OpenAI(base_url=f"{url}/v1", api_key="x").embeddings.create(model="minilm-l3",
                                                                                 input=["I love Paris"])
    assert max(abs(a - b) for a, b in zip(got.data[0].embedding, want[0])) < 1e-5
