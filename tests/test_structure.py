"""The structure holds: packages by concept with their own docstrings, no private reach-ins, no import cycle, a light
``import layerwise``, a store read without torch, one error family, one version, and docs/architecture.md true to the
tree (every module it names exists, every module of the tree is named)."""

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


# the standard library's public names that start with an underscore (documented API, not a reach-in)
STDLIB_PUBLIC = {("os", "_exit")}


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_reach_ins(path: Path) -> list[str]:
    """``X._name`` on anything but ``self``/``cls``, and ``from .m import _name``: private names of other modules."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value
            if isinstance(owner, ast.Name) and (owner.id, node.attr) in STDLIB_PUBLIC:
                continue
            if not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")):
                found.append(f"{path.name}:{node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom):
            found += [f"{path.name}:{node.lineno}: import {a.name}" for a in node.names if _private(a.name)]
    return found


def test_no_module_reaches_into_private_names_of_another():
    found = [hit for p in sorted(SRC.rglob("*.py")) for hit in private_reach_ins(p)]
    assert found == [], "private names used across modules (make them public and documented):\n" + "\n".join(found)


def test_the_checker_catches_a_reach_in(tmp_path):
    bad = tmp_path / "reach_in.py"
    bad.write_text("from .windows import _helper\n\n\ndef f(ex):\n    return ex._stream(1) + self._ok\n")
    assert private_reach_ins(bad) == ["reach_in.py:1: import _helper", "reach_in.py:5: ._stream"]


def test_import_layerwise_is_light():
    code = f"import layerwise, sys; print(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(HEAVY)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


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


def _doc_names(text: str | None = None) -> set[str]:
    if text is None:
        text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return {n.removeprefix("src/").rstrip("/") for n in re.findall(r"`((?:src/)?layerwise/[\w/]+(?:\.py)?/?)`", text)}


def test_architecture_doc_names_only_real_modules():
    named = _doc_names()
    assert len(named) >= 15, named
    missing = [n for n in sorted(named) if not (ROOT / "src" / n).exists()]
    assert missing == [], f"docs/architecture.md names modules that do not exist: {missing}"


def test_readme_layout_names_only_real_modules_and_every_package():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    layout = readme[readme.index("## Layout") :].split("\n## ")[0]
    named = _doc_names(layout)
    missing = [n for n in sorted(named) if not (ROOT / "src" / n).exists()]
    assert missing == [], f"the README's Layout names modules that do not exist: {missing}"
    packages = sorted(str(p.parent.relative_to(ROOT / "src")) for p in SRC.glob("*/__init__.py"))
    assert [p for p in packages if p not in named] == [], "the README's Layout leaves out a package"


def test_architecture_doc_names_every_module():
    named = _doc_names()
    modules = sorted(str(p.relative_to(ROOT / "src")) for p in SRC.rglob("*.py")
                     if p.name != "__init__.py" or p.parent == SRC)
    packages = sorted(str(p.parent.relative_to(ROOT / "src")) for p in SRC.rglob("__init__.py") if p.parent != SRC)
    unnamed = [m for m in modules if m not in named and str(Path(m).parent) not in named | {"layerwise/cli"}
               or (m.startswith("layerwise/cli/") and m not in named and m != "layerwise/cli/__init__.py")]
    assert unnamed == [], f"docs/architecture.md does not describe: {unnamed}"
    assert [p for p in packages if p not in named] == []


def test_every_package_opens_with_a_docstring():
    inits = SRC.rglob("__init__.py")
    bare = [str(p.relative_to(SRC)) for p in inits if not ast.get_docstring(ast.parse(p.read_text(encoding="utf-8")))]
    assert bare == []


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports (module level or in a function; not under
    ``TYPE_CHECKING``). ``src`` holds the top package (``src/layerwise``'s parent)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        parts = path.relative_to(src).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if parts[-1] == "__init__" else ".".join(parts[:-1])
        tree = ast.parse(path.read_text(encoding="utf-8"))
        guarded = [n for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)]
        skip = {id(n) for node in guarded for n in ast.walk(node)}
        out = set()
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, ast.ImportFrom) or not node.level:
                continue
            pieces = package.split(".")
            target = ".".join(pieces[: len(pieces) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:  # `from . import a` imports the module a
                sub = src / Path(*f"{target}.{alias.name}".split("."))
                out.add(f"{target}.{alias.name}" if sub.with_suffix(".py").exists() or sub.is_dir() else target)
        graph[module] = out - {module}
    return {k: {m for m in v if m in graph} for k, v in graph.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk meets (as the list of modules around it)."""
    cycles: list[list[str]] = []
    state: dict[str, str] = {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return cycles


def test_no_import_cycle():
    graph = import_graph(ROOT / "src")
    graph = {k: v - {"layerwise"} for k, v in graph.items()}  # the lazy package root imports nothing at load
    assert len(graph) > 80
    assert find_cycles(graph) == []


def test_the_cycle_checker_sees_a_cycle_through_a_lazy_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import x\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import y\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import z\n")
    graph = import_graph(tmp_path)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.a"} and graph["pkg.c"] == set()
    assert find_cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.a"]]


def test_store_reads_without_torch(tmp_path, tiny_extractors):
    from tiny import extract

    src = tmp_path / "c.txt"
    src.write_text("one text\nanother text\n")
    extract(src, tmp_path / "s", model=tiny_extractors["bert"], layers="-2:")
    code = ("import sys, layerwise.store; assert 'torch' not in sys.modules, 'import'; "
            f"x = layerwise.store.open_store({str(tmp_path / 's')!r}).to_numpy(); "
            "assert 'torch' not in sys.modules, 'read'; print(x.shape)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(2, 64)"


def test_import_layerwise_and_its_vocabularies_load_no_torch():
    code = ("import sys, layerwise as lw; from layerwise.encoding.vocab import POOL_MODES; "
            "from layerwise.model.options import ModelOptions; lw.EncodeSpec(layers='-4:'); lw.ModelOptions(); "
            "lw.LayerwiseError; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_one_error_family():
    import layerwise as lw

    family = [lw.SpecError, lw.ModelLoadError, lw.MappingError, lw.MissingExtraError, lw.InputError, lw.StoreError,
              lw.StoreFullError, lw.StoreCorruptError, lw.ExtractError, lw.ExportError, lw.ServiceError]
    assert all(issubclass(e, lw.LayerwiseError) for e in family) and issubclass(lw.LayerwiseError, ValueError)
    assert issubclass(lw.StoreFullError, lw.StoreError) and issubclass(lw.MappingError, lw.ModelLoadError)
    # every exception class defined in the package belongs to it
    defined = []
    for p in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                defined.append((p.name, node.name))
    assert {name for _, name in defined} <= {e.__name__ for e in family} | {"LayerwiseError"}, defined
    assert {f for f, _ in defined} == {"errors.py"}


def test_the_library_raises_its_own_errors():
    """No bare ``raise ValueError(...)`` in the library: every error raised on purpose is of the family (a
    ``TypeError`` for a wrong type stays one)."""
    bare = []
    for p in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and getattr(
                    node.exc.func, "id", None) == "ValueError":
                bare.append(f"{p.relative_to(SRC)}:{node.lineno}")
    assert bare == [], f"raise a LayerwiseError (layerwise/errors.py) instead of ValueError: {bare}"


def test_backend_registry_and_model_options_agree():
    from layerwise.model.backends import BACKENDS
    from layerwise.model.options import BACKEND_NAMES

    assert tuple(BACKENDS) == BACKEND_NAMES


@pytest.mark.parametrize(
    "module", ["layerwise.store.layout", "layerwise.store.reader", "layerwise.store.writer", "layerwise.store.export",
               "layerwise.store.arrow", "layerwise.store.merge"]
)
def test_store_format_imports_nothing_above_it(module):
    path = SRC / Path(*module.split(".")[1:]).with_suffix(".py")
    tree = ast.parse(path.read_text(encoding="utf-8"))
    above = {"extractor", "extraction", "encoding", "model", "heads", "probe", "serve", "cli", "explore", "training"}
    # the description it stores (the spec and its vocabularies), and no computing
    allowed = {"encoding.spec", "encoding.vocab", "errors", "provenance", "version"}
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 2:
            top = (node.module or "").split(".")[0]
            if top in above and node.module not in allowed:
                bad.append(f"{node.lineno}: from {'.' * node.level}{node.module}")
    assert bad == []


def test_the_tests_mirror_the_packages():
    folders = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith(("_", "."))}
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert folders - packages - {"docs"} == set(), "a tests/ folder that is no package of src/layerwise"
    assert any((ROOT / "tests" / "serve").glob("test_*.py"))  # the tests moved there, not only empty folders
    # no test module name twice (pytest imports them by name, from their folders)
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names))
