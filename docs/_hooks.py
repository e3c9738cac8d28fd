"""mkdocs hooks of the layerwise site: the references generated from the code, and repository files shown as pages.

Directives, each alone on a line of a page:

- ``<!-- file: PATH -->``: a whole Markdown file of the repository (``benchmarks/README.md``), its links rewritten
  for the page;
- ``<!-- cli-reference -->``: every command of the ``layerwise`` CLI with its options, from the typer app;
- ``<!-- http-reference -->``: every route of ``layerwise serve``, from its OpenAPI document;
- ``<!-- api-reference -->``: every public name of ``import layerwise`` (``layerwise.__all__``), rendered by
  mkdocstrings from its docstring.

A link in included text that leads nowhere in the site fails the build (the site builds with ``--strict``).
"""

from __future__ import annotations

import os
import posixpath
import re
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^<!-- file: (.+?) -->$|^<!-- (cli|http|api)-reference -->$", re.MULTILINE)
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s]+)(\))")
PAGES = {"README.md": "index.md", "benchmarks/README.md": "benchmarks.md"}  # repository files that are site pages


def _relink(text: str, source: str, page: str) -> str:
    """Rewrite the relative links of ``text`` (written in repository file ``source``) for the site page ``page``."""

    def fix(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
            return m.group(0)
        path, _, anchor = target.partition("#")
        repo = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if repo in PAGES:
            site = PAGES[repo]
        elif repo.startswith("docs/"):
            site = repo[len("docs/"):]
        else:
            raise ValueError(f"{source}: the link {target!r} leads outside the site ({repo}); link a page of docs/")
        rel = posixpath.relpath(site, posixpath.dirname(page) or ".")
        return f"{m.group(1)}{rel}{'#' + anchor if anchor else ''}{m.group(3)}"

    return LINK.sub(fix, text)


def _cli_reference() -> str:
    import typer

    from layerwise.cli.main import app

    group: Any = typer.main.get_command(app)
    ctx = typer.Context(group)
    out = ["Every command of `layerwise`, generated from the command line itself (`layerwise COMMAND --help` says the "
           "same).", ""]
    for name in sorted(group.list_commands(ctx)):
        cmd = group.get_command(ctx, name)
        out += [f"## `layerwise {name}`", "", (cmd.help or "").strip().split("\n\n")[0], ""]
        args = [p for p in cmd.params if p.param_type_name == "argument"]
        opts = [p for p in cmd.params if p.param_type_name == "option" and not getattr(p, "hidden", False)]
        usage = " ".join([f"layerwise {name}", *(str(a.name).upper() for a in args), "[OPTIONS]"])
        out += ["```", usage, "```", ""]
        if opts:
            out += ["| option | default | what it does |", "|---|---|---|"]
            for p in opts:
                names = ", ".join(f"`{o}`" for o in [*p.opts, *p.secondary_opts])
                default = "" if p.default in (None, (), []) or callable(p.default) else f"`{p.default}`"
                text = (p.help or "").replace("|", "\\|").replace("\n", " ")
                out.append(f"| {names} | {default} | {text} |")
            out.append("")
    return "\n".join(out)


def _http_reference() -> str:
    import layerwise as lw
    from layerwise.serve.app import create_app

    doc = create_app(lw.Extractor(device="cpu")).openapi()
    out = ["Every route of `layerwise serve`, generated from its OpenAPI document (served at `/openapi.json`; "
           "schemathesis checks the server against it).", ""]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out += [f"## `{method.upper()} {path}`", "", op.get("summary", ""), ""]
            description = (op.get("description") or "").strip()
            if description:
                out += [description, ""]
            body = op.get("requestBody", {}).get("content", {})
            for kind, content in body.items():
                ref = content.get("schema", {}).get("$ref", "")
                out.append(f"Request body: `{kind}`" + (f", schema `{ref.rsplit('/', 1)[-1]}`" if ref else ""))
            codes = ", ".join(f"`{code}` {r.get('description', '')}" for code, r in op.get("responses", {}).items())
            out += ["", f"Responses: {codes}", ""]
    schemas = doc.get("components", {}).get("schemas", {})
    out += ["## Schemas", ""]
    for name, schema in sorted(schemas.items()):
        props = schema.get("properties") or {}
        out += [f"### `{name}`", "", (schema.get("description") or "").strip(), ""]
        if props:
            out += ["| field | type | description |", "|---|---|---|"]
            for field, spec in props.items():
                kind = spec.get("type") or " or ".join(str(a.get("type", a.get("$ref", "")).rsplit("/", 1)[-1])
                                                       for a in spec.get("anyOf", []))
                text = (spec.get("description") or "").replace("|", "\\|").replace("\n", " ")
                out.append(f"| `{field}` | {kind} | {text} |")
            out.append("")
    return "\n".join(out)


def _api_reference() -> str:
    import layerwise as lw

    out = ["Every public name of `import layerwise as lw` (`lw.__all__`), from its docstring.", ""]
    constants = []
    for name in lw.__all__:
        obj = getattr(lw, name)
        if isinstance(obj, types.ModuleType):
            out += [f"::: {obj.__name__}", "    options:", "      show_root_heading: true", "      heading_level: 2",
                    ""]
        elif isinstance(obj, (type, types.FunctionType)):
            out += [f"::: {obj.__module__}.{name}", ""]
        else:
            constants.append((name, obj))
    out += ["## Constants", "", "| name | value |", "|---|---|"]
    out += [f"| `lw.{name}` | `{value!r}` |" for name, value in constants]
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Expand the directives of one page (see the module docstring)."""
    where = page.file.src_uri

    def expand(m: re.Match) -> str:
        path, ref = m.group(1), m.group(2)
        if path:
            text = (ROOT / path).read_text(encoding="utf-8")
            text = re.sub(r"^# .*\n", "", text, count=1)  # the page has its own title
            return _relink(text, path, where)
        return {"cli": _cli_reference, "http": _http_reference, "api": _api_reference}[ref]()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return DIRECTIVE.sub(expand, markdown)
