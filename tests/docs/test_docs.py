"""The documentation site's generated pages (``./dev docs`` builds the whole site with ``--strict`` before the
tests run): every public name of ``import layerwise`` is in the API reference with its docstring, the CLI reference
names every command, included files keep their links working, a link outside the site fails, and the README's links
lead to real pages."""

from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest

import layerwise as lw

ROOT = Path(__file__).resolve().parents[2]


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


def test_included_files_keep_their_links(hooks):
    text = (ROOT / "benchmarks" / "README.md").read_text(encoding="utf-8")
    page = hooks._relink(text, "benchmarks/README.md", "benchmarks.md")
    assert "](benchmarks/" not in page
    assert hooks._relink("[b](benchmarks/README.md#x)", "README.md", "how-to/a.md") == "[b](../benchmarks.md#x)"
    report = hooks._relink("[p](docs/probe-sst2/report.html)", "README.md", "how-to/a.md")
    assert report == "[p](../probe-sst2/report.html)"
    assert hooks._relink("[w](https://x.org/a.md)", "README.md", "how-to/a.md") == "[w](https://x.org/a.md)"
    with pytest.raises(ValueError, match="leads outside the site"):
        hooks._relink("[d](../shared/DESIGN.md)", "README.md", "index.md")


def test_every_page_is_in_the_site_and_every_readme_link_resolves():
    """The README is the front page of the repository: each of its relative links leads to a file that exists, and
    every page of ``docs/`` it or the site names is built (listed in ``mkdocs.yml``'s nav, or linked from a page)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", readme) if not re.match(r"^[a-z]+:", t)]
    assert len(links) >= 15
    assert [t for t in links if t and not (ROOT / t).exists()] == []
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    texts = {page: (ROOT / "docs" / page).read_text(encoding="utf-8") for page in pages}
    orphans = [p for p in pages if p not in nav and not any(p in text for other, text in texts.items() if other != p)]
    assert orphans == [], "pages neither in the nav nor linked from a page"
    assert [p for p, text in texts.items() if "<!-- readme" in text] == []  # the guides are the source now


def test_the_design_lives_in_the_repository():
    """The design is a page of the repository, linked from the README, the site's nav and the architecture page, and
    nothing points at a design outside the repository, which a clone does not have (issue 41, item 10). Its layout
    names only packages and modules the tree has."""
    design = ROOT / "docs" / "design.md"
    assert design.is_file()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/design.md)" in readme
    assert "- Design: design.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "](design.md)" in (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    texts = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    assert [p for p in texts if "shared/DESIGN" in p.read_text(encoding="utf-8")] == []
    text = design.read_text(encoding="utf-8")
    layout = text[text.index("src/layerwise/\n") : text.index("\ntests/")]
    parts = []
    for line in layout.splitlines()[1:]:
        if line.startswith("  ") and not line.startswith("   "):  # a name column, not a description's second line
            parts += [t for t in line.split()[:3] if t.endswith(("/", ".py"))]
    assert len(parts) >= 14, parts
    assert [p for p in parts if not (ROOT / "src" / "layerwise" / p.rstrip("/")).exists()] == []


@pytest.mark.parametrize("run", ["probe-sst2", "probe-ud-upos"])
def test_the_published_probe_runs_combine_nothing_for_one_layer(run):
    """A single layer's row combines nothing: '-' in the published results (json, md, csv), never 'concat'."""
    import json

    rows = json.loads((ROOT / "docs" / run / "results.json").read_text())["rows"]
    assert {r["combine"] for r in rows if len(r["layers"]) == 1} == {"-"}
    assert not re.search(r"\| \[\d+\] \| concat \|", (ROOT / "docs" / run / "results.md").read_text())
    assert not re.search(r",\[\d+\],concat,", (ROOT / "docs" / run / "results.csv").read_text())


def test_the_explorer_page_and_choose_a_layer_cite_the_same_sst2_run():
    """The explorer page names the best single layer of the run choose-a-layer publishes (docs/probe-sst2), with its
    score, so the two pages cannot drift apart."""
    import json

    rows = json.loads((ROOT / "docs" / "probe-sst2" / "results.json").read_text())["rows"]
    best = max((r for r in rows if r["kind"] == "layer"), key=lambda r: r["dev_mean"])
    text = " ".join((ROOT / "docs" / "how-to" / "explorer.md").read_text().split())
    assert f"agrees on layer {best['layers'][0]} as the best single layer ({100 * best['dev_mean']:.1f}%)" in text
    assert "first 10,000 training sentences" in (ROOT / "docs" / "how-to" / "choose-a-layer.md").read_text()
    assert "the first 10,000 train sentences" in text
