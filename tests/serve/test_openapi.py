"""The OpenAPI document is true to the service: schemathesis (``st run --checks all``) over every route of the real
service (served by uvicorn in a thread, as ``layerwise serve`` serves it), with bounded examples and a fixed seed,
finds no failure: no undocumented status, no response outside its schema, no schema-valid body refused except by the
rules a schema cannot say (listed, per operation, in ``tests/schemathesis.toml``), no schema-violating body accepted,
no 500, and ``Allow`` headers that name exactly the documented methods."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tiny import serve_in_thread, wait_until

CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_schemathesis_finds_nothing(tiny_dirs, tmp_path):
    pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")
    st = shutil.which("st", path=str(Path(sys.executable).parent)) or shutil.which("st")
    assert st, "the schemathesis command (st) is not installed"
    import layerwise as lw
    from layerwise.serve import create_app

    with serve_in_thread(create_app(lw.Extractor(str(tiny_dirs["bert"]), device="cpu"))) as url:
        _wait_ready(url)  # /ready answers 503 while auto prepares a depth (by design, tested in test_serve.py)
        run = subprocess.run([st, "--config-file", str(CONFIG), "run", f"{url}/openapi.json", "--checks", "all",
                              "--max-examples", "25", "--seed", "1", "--no-color"],
                             cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "passed" in run.stdout


def _wait_ready(url: str, timeout: float = 300) -> None:
    import urllib.error
    import urllib.request

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=10) as answer:
                return answer.status == 200
        except urllib.error.HTTPError as exc:
            assert exc.code == 503, exc
            return False

    wait_until(ready, timeout, "the server ready (GET /ready 200)", interval=0.5)


def test_the_document_states_the_rules_between_fields(tiny_extractors):
    """What the service refuses between fields is schema-invalid in its document (JSON Schema if/then), and what it
    accepts is schema-valid: checked with jsonschema on the served document's request bodies."""
    jsonschema = pytest.importorskip("jsonschema")
    from layerwise.serve import create_app

    app = create_app(tiny_extractors["bert"])
    doc = app.openapi()
    schemas = doc["components"]["schemas"]

    def valid(name: str, body: dict) -> bool:  # the body's schema, its $refs resolved in the document's components
        return jsonschema.Draft202012Validator({**schemas[name], "components": doc["components"]}).is_valid(body)

    assert valid("EncodeRequest", {"words": [["a", "b"]], "level": "word"})
    assert not valid("EncodeRequest", {"words": [["a", "b"]]})  # words need level word
    assert not valid("EncodeRequest", {"texts": ["a"], "calibration": {"min": [0.0], "max": [1.0]}})
    assert not valid("EncodeRequest", {"texts": ["a"], "output_dtype": "int8"})  # int8 needs calibration
    assert not valid("EncodeRequest", {"texts": ["a"], "weights": [1.0]})  # weights need combine weighted
    assert not valid("EncodeRequest", {"texts": ["a"], "combine": "weighted"})  # and the reverse
    assert valid("EncodeRequest", {"texts": ["a"], "combine": "weighted", "weights": [1.0]})
    assert not valid("EncodeRequest", {"texts": ["a"], "pool": "cls", "skip_special_tokens": True})
    assert not valid("EncodeRequest", {"texts": ["a"], "site": "nowhere"})
    assert valid("EncodeRequest", {"texts": ["a"], "site": tiny_extractors["bert"].sites[-1], "dimensions": 4.0})
    assert not valid("EmbedRequest", {"inputs": "a", "truncation_direction": "Left"})
