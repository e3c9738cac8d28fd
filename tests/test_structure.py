"""The structure holds: no private reach-ins, a light ``import layerwise``, one version, docs that name real modules."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "layerwise"
HEAVY = {
    "fastapi",
    "uvicorn",
    "matplotlib",
    "prometheus_client",
    "sklearn",
    "seqeval",
    "onnxruntime",
    "tensorflow",
    "keras",
    "keras_hub",
    "ray",
    "pandas",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reach_ins(path: Path) -> list[str]:
    """``X._name`` on anything but ``self``/``cls``, and ``from .m import _name``: private names of other modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
    return found


def test_no_module_reaches_into_private_names_of_another():
    found = [hit for p in sorted(SRC.rglob("*.py")) if p.name != "extractor.py" for hit in private_reach_ins(p)]
    assert found == [], "private names used across modules (make them public and documented):\n" + "\n".join(found)


def test_the_checker_catches_a_reach_in(tmp_path):
    bad = tmp_path / "reach_in.py"
    bad.write_text("from .pipeline import _helper\n\n\ndef f(ex):\n    return ex._stream(1) + self._ok\n")
    assert private_reach_ins(bad) == ["reach_in.py:1: import _helper", "reach_in.py:5: ._stream"]


@pytest.mark.slow
def test_import_layerwise_is_light():
    code = f"import layerwise, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HEAVY)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_subpackages_load_on_first_use():
    code = (
        "import layerwise as lw, sys; a = 'layerwise.heads' in sys.modules; lw.heads; "
        "print(a, 'layerwise.heads' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_version_is_written_once():
    import layerwise

    hits = [p for p in SRC.rglob("*.py") if re.search(r"^__version__\s*=", p.read_text(encoding="utf-8"), re.M)]
    assert [p.name for p in hits] == ["version.py"]
    assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    from importlib.metadata import version

    assert version("layerwise") == layerwise.__version__


def test_architecture_doc_names_only_real_modules():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    named = set(re.findall(r"`((?:src/)?layerwise/[\w/]+(?:\.py)?)`", text))
    assert len(named) >= 15, named
    missing = [n for n in sorted(named) if not (ROOT / "src" / n.removeprefix("src/")).exists()]
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"


@pytest.mark.parametrize(
    "module", ["layerwise.store.layout", "layerwise.store.reader", "layerwise.store.writer", "layerwise.store.export"]
)
def test_store_format_imports_nothing_above_it(module):
    path = SRC / Path(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    above = {"extractor", "engine", "pipeline", "backends", "heads", "probe", "serve", "cli", "capture", "loading"}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 2:
            top = (node.module or "").split(".")[0]
            if top in above:
                bad.append(f"{node.lineno}: from {'.' * node.level}{node.module}")
    assert bad == []
