"""The documentation site's generated pages (``./dev docs`` builds the whole site with ``--strict`` before the
tests run): every public name of ``import layerwise`` is in the API reference with its docstring, the CLI reference
names every command, included README sections keep their links working, and a link outside the site fails."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest

import layerwise as lw

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def hooks():
    spec = importlib.util.spec_from_file_location("layerwise_docs_hooks", ROOT / "docs" / "_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_public_name_is_in_the_api_reference_with_its_docstring(hooks):
    griffe = pytest.importorskip("griffe")
    page = hooks._api_reference()
    paths = re.findall(r"^::: (\S+)$", page, re.MULTILINE)
    package = griffe.load("layerwise", search_paths=[str(ROOT / "src")])
    documented = set()
    for path in paths:
        obj = package[path.removeprefix("layerwise.")] if path != "layerwise" else package
        assert obj.docstring is not None and obj.docstring.value.strip(), f"{path} has no docstring"
        documented.add(path.rsplit(".", 1)[-1])
    for name in lw.__all__:
        obj = getattr(lw, name)
        if isinstance(obj, (type, types.FunctionType)):
            assert name in documented, name
        elif isinstance(obj, types.ModuleType):
            assert f"::: {obj.__name__}" in page, name
        else:
            assert f"`lw.{name}`" in page, name


def test_the_cli_reference_names_every_command(hooks):
    import typer

    from layerwise.cli.main import app

    page = hooks._cli_reference()
    for name in typer.main.get_command(app).commands:
        assert f"## `layerwise {name}`" in page
    assert "`--num-workers`" in page and "`--stall-timeout`" in page


def test_included_sections_keep_their_links(hooks):
    text = hooks._section((ROOT / "README.md").read_text(encoding="utf-8"), "Which layer knows what")
    assert text.startswith("## Which layer knows what")
    page = hooks._relink(text, "README.md", "how-to/choose-a-layer.md")
    assert "](../probe-sst2/report.html)" in page and "](docs/" not in page
    assert hooks._relink("[b](benchmarks/README.md#x)", "README.md", "how-to/a.md") == "[b](../benchmarks.md#x)"
    with pytest.raises(ValueError, match="leads outside the site"):
        hooks._relink("[d](../shared/DESIGN.md)", "README.md", "index.md")
    with pytest.raises(ValueError, match="no heading starting with"):
        hooks._section("# a\n", "Nothing")


def test_a_page_can_take_only_a_sections_intro(hooks):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    whole = hooks._section(readme, "Corpus extraction")
    intro = hooks._section(readme, "Corpus extraction", intro=True)
    assert whole.startswith(intro) and len(intro) < len(whole) and "### What a store guarantees" not in intro
    assert "What a store guarantees" in whole
